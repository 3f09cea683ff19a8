"""The one seam between dtrun and the ``modal`` SDK (1.6.x). Tests replace :class:`ModalAPI`.

Nothing here runs at import time; ``modal`` is imported inside each method. Records are plain
dataclasses so the adapter and the test fake share one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

APP_NAME = "dtrun"
REMOTE_DIR = "/root/dtrun"
_IGNORE = [".venv", ".git", "runs", "**/__pycache__", "*.pyc", ".pytest_cache", "benchmarks/results"]


@dataclass(frozen=True)
class SandboxSpec:
    """Everything ``modal.Sandbox.create`` gets from dtrun."""

    name: str
    command: list[str]
    env: dict[str, str]
    gpu: str
    """``"<TYPE>:<N>"``, e.g. ``"H100:8"``."""
    timeout: int
    """Seconds; Modal kills the sandbox then (max 24 h): dtrun's hard deadline."""
    tags: dict[str, str] = field(default_factory=dict)
    region: str | None = None
    workdir: str | None = None
    """Local project directory copied into the image and pip-installed (None: not needed)."""
    secrets: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    """Secret environment (``LaunchRequest.secrets``), sent as ``modal.Secret.from_dict``; never
    stored or logged by dtrun."""


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    name: str
    tags: dict[str, str]


class ModalAPI:
    """Thin wrapper over ``modal.App.lookup``, ``modal.Sandbox.create/from_id/list``, ``poll`` and
    ``terminate``. Methods raise Modal's own exceptions; the adapter maps them."""

    def __init__(self, app_name: str = APP_NAME) -> None:
        self.app_name = app_name

    def _image(self, workdir: str | None) -> Any:
        import modal

        image = modal.Image.debian_slim(python_version="3.11")
        if workdir:
            image = image.add_local_dir(workdir, REMOTE_DIR, copy=True, ignore=_IGNORE).run_commands(
                f"cd {REMOTE_DIR} && python -m pip install -q -e .")
        return image

    def create(self, spec: SandboxSpec) -> str:
        import modal

        app = modal.App.lookup(self.app_name, create_if_missing=True)
        secrets = [modal.Secret.from_dict(dict(spec.secrets))] if spec.secrets else None
        sb = modal.Sandbox.create(
            *spec.command, app=app, name=spec.name, tags=spec.tags, image=self._image(spec.workdir),
            env=dict(spec.env), secrets=secrets, timeout=spec.timeout, gpu=spec.gpu, region=spec.region,
            workdir=REMOTE_DIR if spec.workdir else None,
        )
        return sb.object_id

    def poll(self, sandbox_id: str) -> int | None:
        """None while running, else the exit code (Modal: 124 = timed out, 137 = terminated)."""
        import modal

        return modal.Sandbox.from_id(sandbox_id).poll()

    def terminate(self, sandbox_id: str) -> None:
        import modal

        modal.Sandbox.from_id(sandbox_id).terminate()

    def list(self, tags: dict[str, str]) -> list[SandboxRecord]:
        """Sandboxes still running with at least these tags."""
        import modal

        out = []
        for sb in modal.Sandbox.list(tags=tags):
            t = sb.get_tags()
            out.append(SandboxRecord(sb.object_id, t.get("dtrun_name", ""), t))
        return out

    def logs(self, sandbox_id: str, tail: int) -> str:
        """The sandbox's stdout so far (only once it has finished: reading blocks otherwise)."""
        import modal

        sb = modal.Sandbox.from_id(sandbox_id)
        if sb.poll() is None:
            return ""
        text = sb.stdout.read() + sb.stderr.read()
        return "\n".join(text.splitlines()[-tail:])

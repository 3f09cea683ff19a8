"""The one seam between dtrun and the ``modal`` SDK (1.6.x).

Nothing here runs at import time; ``modal`` is imported inside each method. Records are plain
dataclasses so the adapter and its tests share one vocabulary. Tests drive this class through the
real SDK against a local fake of Modal's gRPC control plane (tests/fakes/fake_modal_server.py).

Three things go below the SDK's public surface, because the public one drops what dtrun needs:

* a sandbox's **result status** (OOM kill, eviction, timeout, internal failure…): the SDK keeps the
  server's ``GenericResult`` on the sandbox (``_impl.result``) but ``poll()`` returns only an exit
  code; :meth:`ModalAPI.result` reads the proto;
* the **GPU wait**: ``Sandbox.create`` waits up to ``_SANDBOX_SCHEDULING_TIMEOUT`` (21 min) for a
  GPU, then terminates the unscheduled sandbox and raises ``ResourceExhaustedError("Insufficient
  capacity…")``. :meth:`ModalAPI.create` sets that module constant to the configured bound so the
  SDK's own path (terminate + error) runs after dtrun's wait, not 21 minutes;
* the **image build's progress**: which layer is being built (the SDK builds a layer's base layers
  first, and has no per-layer hook): each layer object's loader is wrapped to say so first
  (:func:`_announce_layer`), for the live view's "building image: layer k of n".
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

APP_NAME = "dtrun"
REMOTE_DIR = "/root/dtrun"
_IGNORE = [".venv", ".git", "runs", "**/__pycache__", "*.pyc", ".pytest_cache", "benchmarks/results"]

# The torch build for Modal's GPU hosts. Modal states its hosts' NVIDIA driver in its CUDA guide
# (https://modal.com/docs/guide/cuda); this choice assumes it says R570 or newer (not re-read in the
# offline session that wrote this: see the README's Modal notes). The default PyPI torch wheel for
# recent releases is a CUDA 13.0 build that needs R580+; cu128 wheels run on R570+, so the node
# image takes torch from this index. Override with DTRUN_MODAL_TORCH_INDEX (…/whl/cu130 on R580+).
TORCH_INDEX = "https://download.pytorch.org/whl/cu128"

DEFAULT_GPU_WAIT = 5 * 60
"""Seconds ``Sandbox.create`` waits for a GPU before dtrun calls it no capacity (Modal: 21 min)."""

# GenericResult.status → dtrun's word for it (modal_proto's enum, by number: no import needed).
RESULT_STATUS = {0: "running", 1: "success", 2: "failure", 3: "terminated", 4: "timeout",
                 5: "init_failure", 6: "internal_failure", 7: "idle_timeout", 8: "eviction",
                 9: "thrashing", 10: "oom"}

_sched_lock = threading.Lock()

LOG_READ_SECONDS = 2.0
"""How long a read of a running sandbox's output waits for what Modal streams."""
_read_for: Any = None


@dataclass(frozen=True)
class SandboxSpec:
    """Everything ``modal.Sandbox.create`` gets from dtrun."""

    name: str
    command: list[str]
    env: dict[str, str]
    gpu: str
    """``"<TYPE>:<N>"``, e.g. ``"H100:8"``."""
    timeout: int
    """Seconds; Modal kills the sandbox then (max 24 h)."""
    tags: dict[str, str] = field(default_factory=dict)
    region: str | None = None
    workdir: str | None = None
    """Local project directory: its declared dependencies, then its code, go into the image."""
    cpu: float | None = None
    """Physical cores requested (Modal's ``cpu``)."""
    memory_mb: int | None = None
    """Memory requested, MiB (Modal's ``memory``)."""
    base_image: str | None = None
    """A registry image to build on (None: Modal's debian-slim with Python 3.11)."""
    gpu_wait: float = DEFAULT_GPU_WAIT
    """Seconds to wait for a GPU before giving up with no capacity."""
    deadline: float | None = None
    """Unix time the sandbox must be gone by: the timeout is cut to it after the image is built
    (the build's minutes do not push Modal's kill past dtrun's deadline)."""
    secrets: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    """Secret environment (``LaunchRequest.secrets``), sent as ``modal.Secret.from_dict``; never
    stored or logged by dtrun."""


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    name: str
    tags: dict[str, str]


@dataclass(frozen=True)
class SandboxResult:
    """How a sandbox stands: ``status`` is ``running`` or a RESULT_STATUS word."""

    status: str
    exitcode: int | None = None
    exception: str = ""

    @property
    def running(self) -> bool:
        return self.status == "running"


class DeadlinePassed(Exception):
    """The deadline passed while the image was building: nothing was created."""


class BuildFailed(Exception):
    """The image build failed (not transient). ``logs``: the build's output, as streamed."""

    def __init__(self, message: str, image_id: str, logs: str) -> None:
        super().__init__(message)
        self.image_id = image_id
        self.logs = logs


def declared_dependencies(workdir: str | os.PathLike[str]) -> list[str]:
    """``[project].dependencies`` of the project at ``workdir`` (what the node needs to run)."""
    import tomllib

    path = Path(workdir) / "pyproject.toml"
    if not path.is_file():
        return []
    return list(tomllib.loads(path.read_text()).get("project", {}).get("dependencies", []))


def _is_torch(req: str) -> bool:
    import re

    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower() == "torch"


def image_layers(workdir: str | None, base_image: str | None = None,
                 torch_index: str | None = None) -> list[tuple[str, Any]]:
    """The node image as its layers, each ``(what it adds, the image up to it)``; they change at
    different rates:

    1. base (``base_image`` from a registry, or debian-slim + Python 3.11);
    2. torch, from the CUDA build chosen for Modal's driver (``TORCH_INDEX``) — GBs, rarely changes;
    3. the project's other declared dependencies (``pyproject.toml``);
    4. the code, copied in, then installed with ``--no-deps`` (an edit rebuilds only these two).
    """
    import modal

    if base_image:
        image = modal.Image.from_registry(base_image, add_python="3.11")
    else:
        image = modal.Image.debian_slim(python_version="3.11")
    layers = [("base", image)]
    if not workdir:
        return layers
    deps = declared_dependencies(workdir)
    torch = [d for d in deps if _is_torch(d)]
    rest = [d for d in deps if not _is_torch(d)]
    if torch:
        index = torch_index or os.environ.get("DTRUN_MODAL_TORCH_INDEX") or TORCH_INDEX
        layers.append(("torch", layers[-1][1].pip_install(*torch, index_url=index)))
    if rest:
        layers.append(("dependencies", layers[-1][1].pip_install(*rest)))
    layers.append(("code", layers[-1][1].add_local_dir(workdir, REMOTE_DIR, copy=True, ignore=_IGNORE)))
    layers.append(("install", layers[-1][1].run_commands(f"cd {REMOTE_DIR} && python -m pip install -q --no-deps -e .")))
    return layers


def build_image(workdir: str | None, base_image: str | None = None, torch_index: str | None = None) -> Any:
    """The node image (:func:`image_layers`' top layer)."""
    return image_layers(workdir, base_image, torch_index)[-1][1]


def _announce_layer(layer: Any, build_log: "_BuildLog", k: int, n: int, label: str) -> None:
    """``build_log.layer(k, n, label)`` when the SDK starts loading this layer (its base layers are
    loaded first, so in order 1…n; a cached layer passes at once). The SDK has no per-layer hook:
    this wraps the layer object's own loader (``_load``), under the public surface."""
    from modal._utils.async_utils import synchronizer

    raw = synchronizer._translate_in(layer)
    load = raw._load

    async def announced(obj: Any, *args: Any, **kwargs: Any) -> Any:
        build_log.layer(k, n, label)
        return await load(obj, *args, **kwargs)

    raw._load = announced


class Cancelled(Exception):
    """The launch was cancelled (terminate by name) while the image was building: nothing created."""


class _BuildLog:
    """The image build's streamed log lines, for one create, and where the build is: which layer
    (``layer(k, n, what)`` before each is built), reported to ``on_progress`` with the newest line
    as ``{"phase": "image", "layer": k, "layers": n, "label": what, "since": unix time, "line": …}``."""

    def __init__(self, on_line: Callable[[str], None] | None,
                 on_progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.lines: list[str] = []
        self.on_line = on_line
        self.on_progress = on_progress
        self.where: dict[str, Any] | None = None

    def layer(self, k: int, n: int, label: str) -> None:
        self.where = {"phase": "image", "layer": k, "layers": n, "label": label, "since": time.time(), "line": ""}
        self._report()

    def add(self, line: str) -> None:
        self.lines.append(line)
        if self.on_line is not None:
            self.on_line(line)
        if self.where is not None and line.strip():
            self.where["line"] = line.strip()[:200]
            self._report()

    def _report(self) -> None:
        if self.on_progress is not None and self.where is not None:
            try:
                self.on_progress(dict(self.where))
            except Exception:  # noqa: BLE001 - a display hook never fails a launch
                pass


_build_logs: set[_BuildLog] = set()
_router_installed = False


def _install_log_router() -> None:
    """Once per process: an SDK output manager (otherwise the silent default) that hands the image
    build's streamed log lines to every create in progress (the SDK has no per-call hook)."""
    global _router_installed
    from modal._output.manager import DisabledOutputManager, OutputManager

    class Router(DisabledOutputManager):
        async def put_streaming_log(self, log: Any, prefix: str = "") -> None:
            with _sched_lock:
                active = list(_build_logs)
            for line in (log.data or "").splitlines():
                for b in active:
                    b.add(line)

    if not _router_installed and type(OutputManager.get()) is DisabledOutputManager:
        OutputManager._set(Router())
        _router_installed = True


class ModalAPI:
    """Thin wrapper over ``modal.App.lookup``, ``modal.Sandbox.create/from_id/from_name/list``,
    ``poll`` and ``terminate``. Methods raise Modal's own exceptions (and :class:`BuildFailed`);
    the adapter maps them."""

    def __init__(self, app_name: str = APP_NAME, on_build_line: Callable[[str], None] | None = None) -> None:
        self.app_name = app_name
        self.on_build_line = on_build_line
        self._app_id: str | None = None

    def _app(self) -> Any:
        import modal

        app = modal.App.lookup(self.app_name, create_if_missing=True)
        self._app_id = app.app_id
        return app

    def app_id(self) -> str:
        if self._app_id is None:
            self._app()
        assert self._app_id is not None
        return self._app_id

    def _layers(self, spec: SandboxSpec) -> list[tuple[str, Any]]:
        return image_layers(spec.workdir, spec.base_image)

    def create(self, spec: SandboxSpec, should_cancel: Callable[[], bool] | None = None,
               on_progress: Callable[[dict[str, Any]], None] | None = None) -> str:
        """Build the image layer by layer (``on_progress`` hears which, with the build's newest log
        line), then create the sandbox (unless ``should_cancel()`` says so by then) and wait for
        its GPU at most ``spec.gpu_wait`` seconds."""
        import modal
        import modal.sandbox._impl_v1 as v1
        from modal.exception import ImageBuildError

        app = self._app()
        secrets = [modal.Secret.from_dict(dict(spec.secrets))] if spec.secrets else None
        build_log = _BuildLog(self.on_build_line, on_progress)
        with _sched_lock:
            if not hasattr(v1, "_SANDBOX_SCHEDULING_TIMEOUT"):
                warnings.warn("modal: this SDK has no _SANDBOX_SCHEDULING_TIMEOUT; the GPU wait is Modal's own")
            # one process-wide SDK constant, read when this create starts waiting for a GPU
            v1._SANDBOX_SCHEDULING_TIMEOUT = float(spec.gpu_wait)
            _build_logs.add(build_log)
            _install_log_router()
        try:
            layers = self._layers(spec)
            for k, (label, layer) in enumerate(layers, 1):  # the live view's "layer k of n"
                _announce_layer(layer, build_log, k, len(layers), label)
            image = layers[-1][1]
            image.build(app)  # every layer built (or found cached) before the timeout is fixed
            if should_cancel is not None and should_cancel():
                raise Cancelled(f"{spec.name}: launch cancelled while the image was building")
            timeout, env = spec.timeout, dict(spec.env)
            to_deadline = False
            if spec.deadline is not None:
                left = int(spec.deadline - time.time())
                to_deadline = left <= timeout
                timeout = min(timeout, left)
                if timeout <= 0:
                    raise DeadlinePassed(f"{spec.name}: the deadline passed while the image was building")
            if to_deadline:  # the node ends at the deadline: its deadline check stops it, no planned restart
                env.pop("DTRUN_NODE_TIMEOUT_SECONDS", None)
            elif "DTRUN_NODE_TIMEOUT_SECONDS" in env:
                env["DTRUN_NODE_TIMEOUT_SECONDS"] = str(timeout)
            sb = modal.Sandbox.create(
                *spec.command, app=app, name=spec.name, tags=spec.tags, image=image,
                env=env, secrets=secrets, timeout=timeout, gpu=spec.gpu, region=spec.region,
                cpu=spec.cpu, memory=spec.memory_mb, workdir=REMOTE_DIR if spec.workdir else None,
            )
        except ImageBuildError as e:
            raise BuildFailed(str(e), getattr(e, "image_id", ""), "\n".join(build_log.lines)) from None
        finally:
            with _sched_lock:
                _build_logs.discard(build_log)
        return sb.object_id

    def _result_of(self, sb: Any) -> SandboxResult:
        from modal._utils.async_utils import synchronizer

        sb.poll()
        res = synchronizer._translate_in(sb)._impl.result  # the server's GenericResult (see module doc)
        if res is None or not res.status:
            return SandboxResult("running")
        code = sb.returncode
        return SandboxResult(RESULT_STATUS.get(res.status, "failure"), code, res.exception or "")

    def result(self, sandbox_id: str) -> SandboxResult:
        import modal

        return self._result_of(modal.Sandbox.from_id(sandbox_id))

    def find(self, name: str) -> str:
        """The id of the newest sandbox named ``name`` in the dtrun app, finished or not
        (NotFoundError if none)."""
        import modal
        from modal.exception import NotFoundError

        try:  # a running one: modal 1.6 looks up V2 by name, then falls back to V1 (GPU sandboxes)
            return modal.Sandbox.from_name(self.app_name, name).object_id
        except NotFoundError:
            pass
        # a finished one: only the V2 lookup takes include_terminated (assumed to see V1 sandboxes
        # too, as SandboxListV2 does; NotFoundError otherwise)
        return modal.Sandbox.from_name(self.app_name, name, include_terminated=True).object_id

    def terminate(self, sandbox_id: str) -> None:
        import modal

        modal.Sandbox.from_id(sandbox_id).terminate()

    def list(self, tags: dict[str, str]) -> list[SandboxRecord]:
        """Running sandboxes of the dtrun app with at least these tags (listed by the app's id)."""
        import modal

        out = []
        for sb in modal.Sandbox.list(app_id=self.app_id(), tags=tags):
            t = sb.get_tags()
            out.append(SandboxRecord(sb.object_id, t.get("dtrun_name", ""), t))
        return out

    def logs(self, sandbox_id: str, tail: int, wait: float = LOG_READ_SECONDS) -> str:
        """The sandbox's stdout and stderr: all of it once it has finished (read to EOF); while it
        runs, what Modal streams within ``wait`` seconds (the SDK's own read blocks until EOF)."""
        import modal
        from modal._utils.async_utils import synchronizer

        sb = modal.Sandbox.from_id(sandbox_id)
        if sb.poll() is None:
            global _read_for
            if _read_for is None:
                _read_for = synchronizer.create_blocking(_read_streams_for)
            out, err = _read_for(synchronizer._translate_in(sb), wait)
        else:
            out, err = sb.stdout.read(), sb.stderr.read()
        text = out + ("\n--- stderr ---\n" + err if err else "")
        return "\n".join(text.splitlines()[-tail:])


async def _read_streams_for(sb: Any, seconds: float) -> tuple[str, str]:
    """stdout and stderr of a running sandbox as streamed within ``seconds`` (on the SDK's loop)."""
    import asyncio

    bufs: tuple[list[str], list[str]] = ([], [])

    async def collect(stream: Any, buf: list[str]) -> None:
        async for chunk in stream:
            buf.append(chunk)

    tasks = [asyncio.ensure_future(collect(sb.stdout, bufs[0])), asyncio.ensure_future(collect(sb.stderr, bufs[1]))]
    _, pending = await asyncio.wait(tasks, timeout=seconds)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return "".join(bufs[0]), "".join(bufs[1])



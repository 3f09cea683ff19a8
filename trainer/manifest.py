"""Finding the ``dtrun data prepare`` manifest beside ``trainer.data`` (no numpy, no tokenizer:
the dry run reads it on the user's machine, so it stays cheap to import)."""

from __future__ import annotations

import os
from typing import Any

MANIFEST = "manifest.json"


def manifest_dir(data: str) -> str:
    """The folder whose manifest.json describes ``trainer.data`` (a folder, file or glob)."""
    d = data
    if any(ch in d for ch in "*?[") or d.endswith((".bin", ".npy")):
        d = d.rsplit("/", 1)[0] if "/" in d else "."
    return d


def read_manifest(data: str) -> dict[str, Any] | None:
    """The ``data prepare`` manifest beside ``trainer.data``, or None (synthetic, other shards)."""
    if data == "synthetic":
        return None
    from orchestrator.contract import runuri

    d = manifest_dir(data if "://" in data else os.path.abspath(os.path.expanduser(data)))
    try:
        return runuri.read_json(runuri.join(d, MANIFEST))
    except Exception:  # noqa: BLE001 - unreadable: the loader reports the data problem itself
        return None

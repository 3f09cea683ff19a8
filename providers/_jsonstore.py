"""A small JSON file shared between dtrun processes, locked with ``fcntl.flock`` around each use.

Providers keep what they must remember across processes here (the SkyPilot adapter: the last
job status seen per cluster and which clusters dtrun took down; Modal: the same per sandbox).
Never secrets.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterator

_tlock = threading.RLock()


def dtrun_home() -> Path:
    return Path(os.environ.get("DTRUN_HOME") or "~/.dtrun").expanduser()


@contextlib.contextmanager
def locked_json(path: Path, default: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the file's dict (``default`` if absent or unreadable); write it back if changed."""
    import fcntl

    with _tlock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a+") as lf:
            fcntl.flock(lf.fileno(), fcntl.LOCK_EX)
            try:
                try:
                    data = json.loads(path.read_text())
                except (FileNotFoundError, json.JSONDecodeError):
                    data = dict(default or {})
                before = json.dumps(data, sort_keys=True)
                yield data
                after = json.dumps(data, sort_keys=True)
                if after != before:
                    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
                    tmp.write_text(after)
                    os.chmod(tmp, 0o600)
                    os.replace(tmp, path)
            finally:
                fcntl.flock(lf.fileno(), fcntl.LOCK_UN)

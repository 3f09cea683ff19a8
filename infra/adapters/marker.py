"""The ``marker`` checkpoint format and progress lines, standard library only.

A script following the contract without importing anything of dtrun does the same by hand:
write its checkpoint folder under ``$DTRUN_CHECKPOINT_DIR``, then a ``DONE_WRITING`` file in it
(the node uploads the folder only after that), and print ``step N`` lines.
"""

from __future__ import annotations

import json
import os
import re
import signal

DONE_WRITING = "DONE_WRITING"
EXIT_RESUME = 75
"""Exit code meaning "checkpointed, resume me" (after SIGTERM)."""


def checkpoint_dir() -> str:
    """``$DTRUN_CHECKPOINT_DIR`` (``./checkpoints`` outside dtrun)."""
    return os.environ.get("DTRUN_CHECKPOINT_DIR") or os.path.abspath("checkpoints")


def resume_step() -> int | None:
    """The step dtrun restored (``$DTRUN_RESUME_STEP``), None on a fresh start."""
    raw = os.environ.get("DTRUN_RESUME_STEP", "").strip()
    return int(raw) if raw else None


def done_writing(folder: str, step: int) -> None:
    """Mark ``folder`` complete: the node uploads it and commits it as ``step``. Call it after
    every file of the checkpoint is written and closed."""
    path = os.path.join(folder, DONE_WRITING)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"step": int(step)}))
    os.replace(tmp, path)


def latest(root: str | None = None) -> tuple[int, str] | None:
    """(step, folder) of the newest marked folder under ``root`` (default: the checkpoint dir)."""
    root = root or checkpoint_dir()
    best = None
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    for name in names:
        mark = os.path.join(root, name, DONE_WRITING)
        if not os.path.exists(mark):
            continue
        try:
            step = int(json.loads(open(mark).read())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            m = re.search(r"(\d+)$", name)
            if not m:
                continue
            step = int(m.group(1))
        if best is None or step > best[0]:
            best = (step, os.path.join(root, name))
    return best


def progress(step: int, total: int | None = None, loss: float | None = None) -> None:
    """Print the progress line the node's default step pattern reads."""
    parts = [f"step {step}" + (f"/{total}" if total else "")]
    if loss is not None:
        parts.append(f"loss {loss:.6g}")
    print("dtrun: " + " ".join(parts), flush=True)


class StopFlag:
    """``flag = StopFlag()`` turns SIGTERM into ``flag.set`` being True: check it every step,
    save, exit ``EXIT_RESUME``."""

    def __init__(self) -> None:
        self.set = False
        signal.signal(signal.SIGTERM, self._on)

    def _on(self, _signum, _frame) -> None:
        self.set = True

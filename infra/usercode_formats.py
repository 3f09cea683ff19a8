"""What counts as a *finished* checkpoint of a ``command:`` job, one rule per
``command.checkpoint_format`` (``hf``, ``lightning``, ``dcp``, ``marker``): only a finished one is
uploaded and committed (``infra/usercode_sync.py``). Standard library only.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from infra.adapters.marker import DONE_WRITING  # the marker format's last file: the script's helper and the node agree

_HF_RE = re.compile(r"^checkpoint-(\d+)$")
_CKPT_STEP_RE = re.compile(r"step[=_-]?(\d+)")
_TRAILING_RE = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class Found:
    step: int
    rel: str          # path under DTRUN_CHECKPOINT_DIR: a folder, or one file (lightning)
    is_dir: bool


def _entries(root: str) -> list[os.DirEntry]:
    try:
        return sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return []


def finished(fmt: str, root: str, exited: bool, numbering: dict[str, int] | None = None) -> list[Found]:
    """The finished checkpoints under ``root`` (ascending step), by the framework's own rules:

    * ``hf`` — ``checkpoint-<N>/`` holding ``trainer_state.json``. The ``Trainer`` writes it last
      of *its own* files (``Trainer._save_checkpoint``: model, optimizer, scheduler, RNG state,
      then the state JSON), but other ranks may still be writing their ``rng_state_<rank>.pth``:
      so a folder counts once a newer ``checkpoint-*`` folder exists (the next save began) or the
      command has exited.
    * ``lightning`` — a ``*.ckpt`` file: Lightning writes it whole in one go through an fsspec
      transaction (``lightning_fabric.utilities.cloud_io._atomic_save``: a temporary file moved
      into place), so the name appears only when it is complete. The step comes from ``step=N`` in
      the name (the default ``epoch=E-step=N.ckpt``), else from the order files appeared.
      ``last*.ckpt`` (a copy or link of another) is left out.
    * ``dcp`` — a folder holding ``.metadata``: ``FileSystemWriter.finish`` writes it to
      ``.metadata.tmp`` and renames it after every rank's data files were written; step = the
      folder name's trailing digits.
    * ``marker`` — a folder holding ``DONE_WRITING`` (the script writes it last, or calls
      ``infra.adapters.marker.done_writing``); step = ``{"step": N}`` in the file, else the folder
      name's trailing digits.
    """
    out: list[Found] = []
    if fmt == "hf":
        dirs = []
        for e in _entries(root):
            m = _HF_RE.match(e.name)
            if m and e.is_dir():
                dirs.append((int(m.group(1)), e.name))
        dirs.sort()
        for i, (step, name) in enumerate(dirs):
            if not os.path.exists(os.path.join(root, name, "trainer_state.json")):
                continue
            if exited or i + 1 < len(dirs):
                out.append(Found(step, name, True))
    elif fmt == "lightning":
        numbering = {} if numbering is None else numbering
        files = [e for e in _entries(root) if e.name.endswith(".ckpt") and e.is_file(follow_symlinks=False)
                 and not e.name.startswith((".", "last"))]
        files.sort(key=lambda e: (e.stat().st_mtime, e.name))
        named = [int(m.group(1)) for e in files if (m := _CKPT_STEP_RE.search(e.name))]
        for e in files:
            m = _CKPT_STEP_RE.search(e.name)
            if m:
                step = int(m.group(1))
            else:  # numbered in the order they appeared, after every step seen so far
                if e.name not in numbering:
                    numbering[e.name] = max([*numbering.values(), *named, 0]) + 1
                step = numbering[e.name]
            out.append(Found(step, e.name, False))
    elif fmt in ("dcp", "marker"):
        mark = ".metadata" if fmt == "dcp" else DONE_WRITING
        for e in _entries(root):
            if not e.is_dir() or not os.path.exists(os.path.join(root, e.name, mark)):
                continue
            step = None
            if fmt == "marker":
                try:
                    with open(os.path.join(root, e.name, mark)) as f:
                        rec = json.loads(f.read() or "null")
                    if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                        step = rec["step"]
                except (OSError, ValueError):
                    pass
            if step is None:
                m = _TRAILING_RE.search(e.name)
                if not m:
                    continue
                step = int(m.group(1))
            out.append(Found(step, e.name, True))
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    out.sort(key=lambda f: (f.step, f.rel))
    return out


def files_of(root: str, found: Found) -> list[str]:
    """The files of ``found``, relative to ``root``."""
    if not found.is_dir:
        return [found.rel]
    base = os.path.join(root, found.rel)
    out = []
    for d, _dirs, files in os.walk(base):
        out += [os.path.relpath(os.path.join(d, f), root) for f in files]
    return sorted(out)

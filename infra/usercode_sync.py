"""A ``command:`` job's checkpoints between the node's folder and the run URI.

* :meth:`CheckpointSync.restore` (before the command): the newest COMMITTED checkpoint under
  ``<run-uri>/checkpoints/`` is downloaded into the command's checkpoint folder with the layout the
  script saved it in; a step folder without COMMITTED (an upload a node did not finish) is never
  used, and node 0 removes such folders newer than the one resumed.
* :meth:`CheckpointSync.sync` (while it runs, and once more after): every *finished* checkpoint
  (``infra/usercode_formats.py``) not yet in the store is uploaded to ``checkpoints/step-<N>/<its
  path>``, then this node writes ``step-<N>/.dtrun-node-<rank>``; node 0 writes COMMITTED once
  every node's marker is there (the whole folder is in the store) and applies the retention of the
  bundled trainer (``checkpoint.keep``).

Standard library and the run-URI contract only.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from infra.node_log import log
from infra.usercode_formats import Found, files_of, finished
from orchestrator.contract import runuri

NODE_MARK = ".dtrun-node-"
"""``step-<N>/.dtrun-node-<rank>``: that node's part of the checkpoint is in the store."""
UPLOAD_STREAMS = 8
"""Files of one checkpoint uploaded (or restored) at once."""
COMMIT_WAIT_SECONDS = 300.0
"""How long node 0 waits for the other nodes' parts of a checkpoint before leaving it uncommitted."""


class CheckpointSync:
    """One node's checkpoint traffic for a ``command:`` job. ``cfg`` needs ``run_uri``,
    ``attempt``, ``node_rank`` and ``nnodes``."""

    def __init__(self, cfg: Any, ckpt_dir: str, fmt: str, keep: int, clock: Callable[[], float] = time.time):
        self.cfg, self.ckpt_dir, self.fmt, self.keep, self.clock = cfg, ckpt_dir, fmt, keep, clock
        self.resume_step: int | None = None
        self.restored: set[str] = set()
        self.uploaded: dict[str, int] = {}   # rel → step (uploaded or skipped)
        self.last_committed: int | None = None
        self.numbering: dict[str, int] = {}
        self.stats: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def restore(self) -> None:
        uri = self.cfg.run_uri
        latest = runuri.latest_committed(uri)
        if self.cfg.node_rank == 0:
            after = latest[0] if latest else -1
            for s in runuri.checkpoint_steps(uri):
                if s > after and runuri.committed(uri, s) is None:
                    log(f"ignoring partial checkpoint step-{s} (no COMMITTED); removing it")
                    runuri.remove(runuri.checkpoint_uri(uri, s), recursive=True)
        if latest is None:
            log("no COMMITTED checkpoint: a fresh start")
            return
        step, _rec = latest
        src = runuri.checkpoint_uri(uri, step)
        t0 = time.monotonic()
        rels = [r for r in runuri.list_files(src)
                if r != runuri.COMMITTED and not os.path.basename(r).startswith(NODE_MARK)]

        def get(rel: str) -> int:
            dst = os.path.join(self.ckpt_dir, rel)
            runuri.get_file(runuri.join(src, rel), dst)
            return os.path.getsize(dst)

        with ThreadPoolExecutor(max_workers=max(1, min(UPLOAD_STREAMS, len(rels)))) as pool:
            nbytes = sum(pool.map(get, rels))
        n = len(rels)
        self.restored.update(rel.split("/", 1)[0] for rel in rels)
        for name in self.restored:
            self.uploaded[name] = step
        self.resume_step = step
        log(f"restored COMMITTED step {step} ({n} files, {nbytes / 2**20:.1f} MiB in "
            f"{time.monotonic() - t0:.1f}s) into {self.ckpt_dir}")

    def sync(self, exited: bool) -> list[int]:
        """Upload and commit every finished checkpoint not yet in the store; the steps committed."""
        done: list[int] = []
        with self.lock:
            for f in finished(self.fmt, self.ckpt_dir, exited, self.numbering):
                if f.rel in self.uploaded:
                    continue
                if self.resume_step is not None and f.step <= self.resume_step:
                    self.uploaded[f.rel] = f.step  # already in the store (or older than it)
                    continue
                if self._upload(f):
                    done.append(f.step)
        return done

    def _upload(self, f: Found) -> bool:
        uri = self.cfg.run_uri
        dst = runuri.checkpoint_uri(uri, f.step)
        if runuri.committed(uri, f.step) is not None:
            self.uploaded[f.rel] = f.step
            return False
        t0 = time.monotonic()
        files = files_of(self.ckpt_dir, f)

        def put(rel: str) -> int:
            src = os.path.join(self.ckpt_dir, rel)
            runuri.put_file(src, runuri.join(dst, rel))
            return os.path.getsize(src)

        try:  # the folder's files in parallel streams (one stream is store-bound: docs/benchmarks.md)
            with ThreadPoolExecutor(max_workers=max(1, min(UPLOAD_STREAMS, len(files)))) as pool:
                nbytes = sum(pool.map(put, files))
        except FileNotFoundError:
            # the script removed it meanwhile (its own rotation): it was never whole in the store
            log(f"checkpoint {f.rel} vanished while uploading; not committed")
            self.uploaded[f.rel] = f.step
            return False
        runuri.write_json(runuri.join(dst, f"{NODE_MARK}{self.cfg.node_rank}"),
                          {"files": len(files), "bytes": nbytes, "time": self.clock()})
        upload_s = time.monotonic() - t0
        self.uploaded[f.rel] = f.step
        stat = {"step": f.step, "files": len(files), "bytes": nbytes, "upload_seconds": round(upload_s, 3)}
        self.stats.append(stat)
        if self.cfg.node_rank != 0:
            log(f"checkpoint step {f.step}: this node's {len(files)} files uploaded ({upload_s:.2f}s)")
            return True
        if not self._all_nodes(dst):
            log(f"checkpoint step {f.step}: not every node uploaded its part; left uncommitted")
            return False
        rec = {"step": f.step, "time": self.clock(), "format": self.fmt, "path": f.rel, "source": "command",
               "attempt": self.cfg.attempt, "nodes": self.cfg.nnodes, **{k: v for k, v in stat.items() if k != "step"}}
        runuri.write_json(runuri.join(dst, runuri.COMMITTED), rec)
        self.last_committed = f.step
        log(f"checkpoint step {f.step} committed ({len(files)} files, {nbytes / 2**20:.1f} MiB, "
            f"upload {upload_s:.2f}s)")
        try:
            runuri.retain(uri, self.keep)
        except Exception as e:  # retention is best effort
            log(f"checkpoint retention: {type(e).__name__}: {e}")
        return True

    def _all_nodes(self, dst: str) -> bool:
        if self.cfg.nnodes <= 1:
            return True
        deadline = time.monotonic() + COMMIT_WAIT_SECONDS
        while time.monotonic() < deadline:
            names = set(runuri.list_dir(dst))
            if all(f"{NODE_MARK}{r}" in names for r in range(self.cfg.nnodes)):
                return True
            time.sleep(1.0)
        return False

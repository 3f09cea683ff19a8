"""The user's own command on a node: the contract dtrun keeps around it (``command:`` jobs).

``infra/node_bootstrap.py`` runs this beside the command, as it runs the watchdog beside the
bundled trainer. Standard library, PyYAML and the run-URI contract only: never torch.

Before the command starts (:meth:`UserCommand.prepare`):

1. ``<run-uri>/code.tar.gz`` (the controller packed ``command.code``) is unpacked into a fresh
   folder, the command's working directory (``DTRUN_CODE_DIR``).
2. ``command.requirements`` (pip) and ``command.setup`` run there; a failure ends the node with
   exit 1 (a failure: retried up to ``recovery.max_restarts_on_errors``).
3. The newest COMMITTED checkpoint under ``<run-uri>/checkpoints/`` is downloaded into
   ``DTRUN_CHECKPOINT_DIR`` with the layout the script saved it in, so the framework's own "resume
   from the latest checkpoint in this folder" works unchanged; ``DTRUN_RESUME_STEP`` is its step
   (empty on a fresh start). A step folder without COMMITTED (an upload the node did not finish)
   is never used, and node 0 removes such folders newer than the one resumed.

While it runs (:meth:`UserCommand.start`; the output through :meth:`UserCommand.tee`):

* **sync**: every ``DTRUN_SYNC_SECONDS`` (default 2) the checkpoint folder is scanned for
  *finished* checkpoints (:func:`finished`, one rule per ``command.checkpoint_format``); each new
  one is uploaded to ``checkpoints/step-<N>/<its path>``, then this node writes
  ``step-<N>/.dtrun-node-<rank>``; node 0 writes COMMITTED once every node's marker is there (the
  whole folder is in the store) and applies the same retention as the bundled trainer
  (``checkpoint.keep``).
* **progress**: the command's output (stdout and stderr, merged) is copied to the node's log and
  read line by line: ``command.step_pattern`` gives the step (and total), ``command.loss_pattern``
  the loss; node 0 rewrites ``progress.json`` every ``DTRUN_HEARTBEAT_SECONDS`` (default 5) and
  appends a ``metrics.jsonl`` row when the step moved, so the controller's lost/idle detection,
  ``dtrun status`` and ``dtrun report`` work on it.

After it exits (:meth:`UserCommand.finish`): a last scan (the newest ``hf`` checkpoint counts as
finished once the command has exited), uploads and commits; then ``DONE`` (node 0) when the command
exited 0 and nobody asked it to stop. Exit 0 after a forwarded SIGTERM or a watchdog stop is not a
finish: the node exits 75 ("resume me") instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import string
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from orchestrator.contract import runuri

CODE_ARCHIVE = "code.tar.gz"
DONE_WRITING = "DONE_WRITING"
NODE_MARK = ".dtrun-node-"
METRIC_ROWS_PER_BEAT = 4
"""metrics.jsonl rows written per heartbeat at most (steps with a loss, thinned evenly)."""
UPLOAD_STREAMS = 8
"""Files of one checkpoint uploaded (or restored) at once."""
COMMIT_WAIT_SECONDS = 300.0
"""How long node 0 waits for the other nodes' parts of a checkpoint before leaving it uncommitted."""

_HF_RE = re.compile(r"^checkpoint-(\d+)$")
_CKPT_STEP_RE = re.compile(r"step[=_-]?(\d+)")
_TRAILING_RE = re.compile(r"(\d+)$")


def log(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    print(f"[dtrun-node {stamp}] {msg}", file=sys.stderr, flush=True)


class SetupFailed(Exception):
    pass


# ---- what "finished" means, per format ------------------------------------------------------

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


def _files_of(root: str, found: Found) -> list[str]:
    if not found.is_dir:
        return [found.rel]
    base = os.path.join(root, found.rel)
    out = []
    for d, _dirs, files in os.walk(base):
        out += [os.path.relpath(os.path.join(d, f), root) for f in files]
    return sorted(out)


# ---- progress from the command's output ------------------------------------------------------

@dataclass
class Progress:
    step_re: re.Pattern
    loss_re: re.Pattern | None
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    lines: int = 0
    changed_at: float = 0.0
    rows: list = field(default_factory=list)  # (step, loss, time) of each new step with a loss
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take_rows(self, most: int = 4) -> list:
        """The steps seen since the last call, thinned evenly to ``most`` (the newest kept)."""
        with self.lock:
            rows, self.rows = self.rows, []
        if len(rows) > most:
            k = len(rows) / most
            rows = [rows[len(rows) - 1 - int(i * k)] for i in range(most)][::-1]
        return rows

    def feed(self, line: str) -> None:
        self.lines += 1
        m = self.step_re.search(line)
        if not m:
            return
        try:
            step = int(m.group(1))
        except (TypeError, ValueError):
            return
        total = None
        if self.step_re.groups >= 2 and m.group(2):
            try:
                total = int(m.group(2))
            except ValueError:
                total = None
        loss = None
        if self.loss_re is not None:
            lm = self.loss_re.search(line)
            if lm:
                try:
                    loss = float(lm.group(1))
                except ValueError:
                    loss = None
        with self.lock:
            if self.step is None or step >= self.step:  # ranks print the same step; keep the newest
                if step != self.step:
                    self.changed_at = time.time()
                    if loss is not None:
                        self.rows.append((step, loss, self.changed_at))
                self.step = step
                if total:
                    self.steps = total
                if loss is not None:
                    self.loss = loss


class Tee:
    """A binary sink that copies the command's output to ``dst`` and feeds each line (split on
    \n and \r: progress bars) to ``progress``."""

    def __init__(self, dst, progress: Progress) -> None:
        self.dst, self.progress, self.buf = dst, progress, b""

    def write(self, chunk: bytes) -> None:
        try:
            self.dst.write(chunk)
        except (OSError, ValueError):
            pass
        self.buf += chunk
        parts = re.split(rb"[\r\n]", self.buf)
        self.buf = parts.pop()
        for p in parts:
            if p:
                self.progress.feed(p.decode(errors="replace"))
        if len(self.buf) > 1 << 20:
            self.buf = self.buf[-4096:]

    def flush(self) -> None:
        try:
            self.dst.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self.buf:
            self.progress.feed(self.buf.decode(errors="replace"))
            self.buf = b""


# ---- the session -------------------------------------------------------------------------------

def load_command(job_file: str) -> dict[str, Any] | None:
    """The job's ``command`` section (the controller wrote it with every default), or None."""
    import yaml

    with open(job_file) as f:
        data = yaml.safe_load(f) or {}
    cmd = data.get("command") if isinstance(data, dict) else None
    if not isinstance(cmd, dict):
        return None
    cmd = dict(cmd)
    cmd["_keep"] = int((data.get("checkpoint") or {}).get("keep") or 2)
    return cmd


class UserCommand:
    def __init__(self, cfg: Any, command: dict[str, Any], torchrun_flags: list[str], launcher: str,
                 clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.c = command
        self.fmt = command.get("checkpoint_format", "marker")
        self.keep = max(2, int(command.get("_keep", 2)))
        self.torchrun_flags = torchrun_flags
        self.launcher = launcher
        self.clock = clock
        base = os.environ.get("DTRUN_NODE_DIR") or None
        if base:
            os.makedirs(base, exist_ok=True)
        self.home = tempfile.mkdtemp(prefix=f"dtrun-{cfg.job}-{cfg.attempt}-{cfg.node_rank}-", dir=base)
        self.code_dir = os.path.join(self.home, "code")
        self.ckpt_dir = os.path.join(self.home, "checkpoints")
        os.makedirs(self.ckpt_dir)
        # The command's temp files on the checkpoint folder's filesystem: Lightning's atomic save
        # (an fsspec transaction: a tempfile.mkstemp() file shutil.move'd into place) is a rename
        # only then; across filesystems the move copies into the final name, visible half-written.
        self.tmp_dir = os.path.join(self.home, "tmp")
        os.makedirs(self.tmp_dir)
        self.resume_step: int | None = None
        self.restored: set[str] = set()
        self.uploaded: dict[str, int] = {}   # rel → step (uploaded or skipped)
        self.last_committed: int | None = None
        self.numbering: dict[str, int] = {}
        self.stats: list[dict[str, Any]] = []
        self.progress = Progress(re.compile(command.get("step_pattern") or r"step\s*[=: ]\s*(\d+)"),
                                 re.compile(command["loss_pattern"]) if command.get("loss_pattern") else None)
        self.phase = "setup"
        self._stop = threading.Event()
        self._sync_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._last_metric_step: int | None = None
        self._tees: list[Tee] = []

    # -- before the command --
    def prepare(self) -> None:
        t = threading.Thread(target=self._progress_loop, name="dtrun-progress", daemon=True)
        t.start()  # heartbeats through setup and restore too (pip installs take minutes)
        self._threads.append(t)
        self._unpack_code()
        self._setup()
        self.phase = "restore"
        self._restore()
        self.phase = "running"

    def _unpack_code(self) -> None:
        uri = runuri.join(self.cfg.run_uri, CODE_ARCHIVE)
        tmp = os.path.join(self.home, CODE_ARCHIVE)
        try:
            runuri.get_file(uri, tmp)
        except (OSError, FileNotFoundError) as e:
            raise SetupFailed(f"cannot read {uri}: {e} (the controller uploads it before launch)") from None
        os.makedirs(self.code_dir)
        with tarfile.open(tmp) as tar:
            kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(self.code_dir, **kw)
        os.unlink(tmp)

    def _run_setup(self, cmd: str) -> None:
        log(f"setup: {cmd}")
        r = subprocess.run(["bash", "-c", cmd], cwd=self.code_dir, env=self.env())
        if r.returncode != 0:
            raise SetupFailed(f"setup command exited {r.returncode}: {cmd}")

    def _setup(self) -> None:
        req = self.c.get("requirements")
        if req:
            import shlex

            self._run_setup(f"{shlex.quote(sys.executable)} -m pip install -r {shlex.quote(str(req))}")
        for cmd in self.c.get("setup") or []:
            self._run_setup(cmd)

    def _restore(self) -> None:
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

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, min(UPLOAD_STREAMS, len(rels)))) as pool:
            nbytes = sum(pool.map(get, rels))
        n = len(rels)
        self.restored.update(rel.split("/", 1)[0] for rel in rels)
        for name in self.restored:
            self.uploaded[name] = step
        self.resume_step = step
        log(f"restored COMMITTED step {step} ({n} files, {nbytes / 2**20:.1f} MiB in "
            f"{time.monotonic() - t0:.1f}s) into {self.ckpt_dir}")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "DTRUN_CHECKPOINT_DIR": self.ckpt_dir,
            "DTRUN_RUN_URI": self.cfg.run_uri,
            "DTRUN_ATTEMPT": str(self.cfg.attempt),
            "DTRUN_RESUME_STEP": "" if self.resume_step is None else str(self.resume_step),
            "DTRUN_CODE_DIR": self.code_dir,
            "DTRUN_CHECKPOINT_FORMAT": self.fmt,
            "TMPDIR": self.tmp_dir,
            "PYTHONUNBUFFERED": "1",
        })
        return env

    def argv(self) -> list[str]:
        run = str(self.c["run"])
        if not self.c.get("torchrun", True):
            return ["bash", "-c", run]
        import shlex

        # Only DTRUN_ variables (as documented): the node logs this argv ("exec: …") into the run
        # URI's node log, and a $AWS_SECRET_ACCESS_KEY expanded here would land there.
        env = {k: v for k, v in self.env().items() if k.startswith("DTRUN_")}
        words = [string.Template(w).safe_substitute(env) for w in shlex.split(run)]
        return [sys.executable, self.launcher, *self.torchrun_flags, *words]

    # -- while it runs --
    def tee(self, dst) -> Tee:
        """A sink for the command's output (the node copies its pipes through it)."""
        t = Tee(dst, self.progress)
        self._tees.append(t)
        return t

    def start(self) -> None:
        t = threading.Thread(target=self._sync_loop, name="dtrun-sync", daemon=True)
        t.start()
        self._threads.append(t)

    def _sync_loop(self) -> None:
        every = float(os.environ.get("DTRUN_SYNC_SECONDS") or 2.0)
        while not self._stop.wait(every):
            try:
                self.sync(exited=False)
            except Exception as e:  # a flaky store must not kill the node: retried next scan
                log(f"checkpoint sync: {type(e).__name__}: {e}")

    def _progress_loop(self) -> None:
        every = float(os.environ.get("DTRUN_HEARTBEAT_SECONDS") or 5.0)
        while True:
            try:
                self.write_progress()
            except Exception as e:
                log(f"progress: {type(e).__name__}: {e}")
            if self._stop.wait(every):
                return

    def write_progress(self) -> None:
        if self.cfg.node_rank != 0:
            return
        p = self.progress
        with p.lock:
            step, steps, loss = p.step, p.steps, p.loss
        now = self.clock()
        rec = {"step": step if step is not None else (self.resume_step or 0), "steps": steps, "loss": loss,
               "time": now, "attempt": self.cfg.attempt, "last_committed_step": self.last_committed,
               "phase": self.phase, "source": "command", "host": socket.gethostname()}
        runuri.write_json(runuri.join(self.cfg.run_uri, runuri.PROGRESS), rec)
        # metrics.jsonl: the steps whose lines carried a loss since the last beat, at most
        # METRIC_ROWS_PER_BEAT of them (on S3 the file is rewritten per append: it must stay small)
        rows = [{"step": st, "loss": ls, "time": t, "attempt": self.cfg.attempt}
                for st, ls, t in p.take_rows(METRIC_ROWS_PER_BEAT)]
        if not rows and step is not None and step != self._last_metric_step:
            rows = [{"step": step, "time": now, "attempt": self.cfg.attempt}]
        if rows:
            self._last_metric_step = rows[-1]["step"]
            runuri.append_line(runuri.join(self.cfg.run_uri, runuri.METRICS),
                               "\n".join(json.dumps(r, sort_keys=True) for r in rows))

    def sync(self, exited: bool) -> list[int]:
        """Upload and commit every finished checkpoint not yet in the store; the steps committed."""
        done: list[int] = []
        with self._sync_lock:
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
        files = _files_of(self.ckpt_dir, f)

        def put(rel: str) -> int:
            src = os.path.join(self.ckpt_dir, rel)
            runuri.put_file(src, runuri.join(dst, rel))
            return os.path.getsize(src)

        try:  # the folder's files in parallel streams (one stream is store-bound: README benchmarks)
            from concurrent.futures import ThreadPoolExecutor

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

    # -- after it exits --
    def finish(self, rc: int, stopped: bool) -> int:
        """Last uploads; DONE when the command finished on its own. The node's exit code."""
        self._stop.set()
        for tee in self._tees:
            tee.close()
        with self._sync_lock:  # a scan in flight finishes first
            pass
        self.phase = "final-sync"
        try:
            self.sync(exited=True)
        except Exception as e:
            log(f"final checkpoint sync failed: {type(e).__name__}: {e}")
        try:
            self.write_progress()
        except Exception as e:
            log(f"progress: {type(e).__name__}: {e}")
        if rc == 0 and not stopped and self.cfg.node_rank == 0:
            p = self.progress
            runuri.write_json(runuri.join(self.cfg.run_uri, runuri.DONE),
                              {"step": p.step, "steps": p.steps, "loss": p.loss, "time": self.clock(),
                               "attempt": self.cfg.attempt, "source": "command",
                               "last_committed_step": self.last_committed, "uploads": self.stats})
        if rc == 0 and stopped:
            rc = runuri.EXIT_PREEMPTED  # stopped before its end: resume it
        if self.stats:
            total = sum(s["upload_seconds"] for s in self.stats)
            log(f"checkpoint uploads: {len(self.stats)} in {total:.2f}s "
                f"({sum(s['bytes'] for s in self.stats) / 2**20:.1f} MiB)")
        shutil.rmtree(self.home, ignore_errors=True)
        return rc

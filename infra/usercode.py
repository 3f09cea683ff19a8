"""The user's own command on a node: the contract dtrun keeps around it (``command:`` jobs).

``infra/node_bootstrap.py`` runs this beside the command, as it runs the watchdog beside the
bundled trainer. Standard library, PyYAML and the contract only: never torch. Beside it:
``infra/usercode_formats.py`` (what a *finished* checkpoint is, per format),
``infra/usercode_sync.py`` (restore, upload, COMMITTED, retention) and
``infra/usercode_progress.py`` (step and loss from the output lines).

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
from typing import Any, Callable

from infra.node_log import log
from infra.usercode_progress import Progress, Tee
from infra.usercode_sync import CheckpointSync
from orchestrator.contract import nodeenv, runuri

CODE_ARCHIVE = "code.tar.gz"
METRIC_ROWS_PER_BEAT = 4
"""metrics.jsonl rows written per heartbeat at most (steps with a loss, thinned evenly)."""


class SetupFailed(Exception):
    pass


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
    """One node's side of a ``command:`` job: :meth:`prepare`, then :meth:`argv`/:meth:`env` for
    the child, :meth:`tee` for its output and :meth:`start` for the sync; :meth:`finish` at the end."""

    def __init__(self, cfg: Any, command: dict[str, Any], torchrun_flags: list[str], launcher: str,
                 clock: Callable[[], float] = time.time):
        self.cfg = cfg
        self.c = command
        self.fmt = command.get("checkpoint_format", "marker")
        self.keep = max(2, int(command.get("_keep", 2)))
        self.torchrun_flags = torchrun_flags
        self.launcher = launcher
        self.clock = clock
        base = os.environ.get(nodeenv.NODE_DIR) or None
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
        self.ckpt = CheckpointSync(cfg, self.ckpt_dir, self.fmt, self.keep, clock)
        self.progress = Progress(re.compile(command.get("step_pattern") or r"step\s*[=: ]\s*(\d+)"),
                                 re.compile(command["loss_pattern"]) if command.get("loss_pattern") else None)
        self.phase = "setup"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_metric_step: int | None = None
        self._tees: list[Tee] = []

    @property
    def resume_step(self) -> int | None:
        """The step restored (None: a fresh start)."""
        return self.ckpt.resume_step

    @property
    def last_committed(self) -> int | None:
        return self.ckpt.last_committed

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

    def _restore(self) -> None:
        self.ckpt.restore()

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

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            nodeenv.CHECKPOINT_DIR: self.ckpt_dir,
            nodeenv.RUN_URI: self.cfg.run_uri,
            nodeenv.ATTEMPT: str(self.cfg.attempt),
            nodeenv.RESUME_STEP: "" if self.resume_step is None else str(self.resume_step),
            nodeenv.CODE_DIR: self.code_dir,
            nodeenv.CHECKPOINT_FORMAT: self.fmt,
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
        every = float(os.environ.get(nodeenv.SYNC_SECONDS) or 2.0)
        while not self._stop.wait(every):
            try:
                self.sync(exited=False)
            except Exception as e:  # a flaky store must not kill the node: retried next scan
                log(f"checkpoint sync: {type(e).__name__}: {e}")

    def _progress_loop(self) -> None:
        every = float(os.environ.get(nodeenv.HEARTBEAT_SECONDS) or 5.0)
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
        return self.ckpt.sync(exited)

    # -- after it exits --
    def finish(self, rc: int, stopped: bool) -> int:
        """Last uploads; DONE when the command finished on its own. The node's exit code."""
        self._stop.set()
        for tee in self._tees:
            tee.close()
        with self.ckpt.lock:  # a scan in flight finishes first
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
                               "last_committed_step": self.last_committed, "uploads": self.ckpt.stats})
        if rc == 0 and stopped:
            rc = runuri.EXIT_PREEMPTED  # stopped before its end: resume it
        if self.ckpt.stats:
            total = sum(s["upload_seconds"] for s in self.ckpt.stats)
            log(f"checkpoint uploads: {len(self.ckpt.stats)} in {total:.2f}s "
                f"({sum(s['bytes'] for s in self.ckpt.stats) / 2**20:.1f} MiB)")
        shutil.rmtree(self.home, ignore_errors=True)
        return rc

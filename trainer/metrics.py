"""Run-URI metrics written by rank 0: ``progress.json`` (heartbeat), ``metrics.jsonl``, a log line.

``metrics.jsonl`` rows: training rows (step, loss, grad_norm, lr, tokens_per_s, mfu, tokens, attempt,
time) every ``log_every`` steps, and validation rows (step, val_loss, tokens, attempt, time).
Optional trackers (``trainer.trackers``) receive the same values from the writer thread.

``progress.json`` keys (contract): step, steps, loss, tokens_per_s, mfu (null on CPU),
last_committed_step, time, attempt, world_size, val_loss (the newest validation loss, null before
the first evaluation) — plus ``status`` (training, done, stopped,
preempted), ``phase`` (see ``PHASES``) and, when the trainer exits, ``exit_code``.

The heartbeat is not tied to steps: from ``start_heartbeat`` on, a rank-0 thread rewrites
``progress.json`` every ``trainer.heartbeat_seconds`` with a fresh ``time``, so a long checkpoint
load or a first step that compiles for minutes is not mistaken for a dead node (the controller's
``recovery.heartbeat_timeout_seconds`` keys on ``time``). ``step`` only moves when a step
completes, and the "no progress" guards (the controller's and the node watchdog's
``teardown.idle_minutes``) key on ``step``: a phase that never ends (a load that hangs) is still
torn down after ``idle_minutes``, not kept alive by its heartbeat.

One exception keeps a hung training loop detectable: in the ``training`` phase the thread stops
refreshing ``time`` once no step has completed for ``stall_s`` (the trainer passes half of
``recovery.heartbeat_timeout_seconds``), so a loop stuck in a collective still goes stale as it did
before this thread existed. A steady-state step longer than about 1.5 × the heartbeat timeout is
therefore treated as a hang; the one-off phases (starting, loading_checkpoint, first_step,
checkpointing, evaluating, stopping) are bounded by ``idle_minutes`` instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orchestrator.contract import runuri

log = logging.getLogger("trainer")

PHASES = ("starting", "loading_checkpoint", "first_step", "training", "checkpointing", "evaluating", "stopping")
"""``progress.json["phase"]``: starting (process group, model build, parallelise), loading_checkpoint
(resume), first_step (the first step of this attempt: compilation, warm-up), training,
checkpointing (a save inside the loop), evaluating (a validation pass: ``trainer.eval_tokens`` can take
longer than a step), stopping (SIGTERM / STOP / last step: final save, DONE, exit)."""


def peak_flops(device_type: str) -> float | None:
    """Peak dense bf16 FLOP/s of this rank's GPU (orchestrator.contract.gpus), None on CPU/unknown."""
    if device_type != "cuda":
        return None
    import torch

    return peak_flops_for_name(torch.cuda.get_device_name())


H100_PCIE_PEAK_BF16 = 756e12  # the PCIe card's dense bf16 peak; the table's H100 is the SXM part


def peak_flops_for_name(device_name: str) -> float | None:
    """Peak for a CUDA device name such as 'NVIDIA GeForce RTX 4090' or 'NVIDIA H100 PCIe'."""
    from orchestrator.contract.gpus import GPUS, is_variant

    compact = device_name.upper().replace(" ", "").replace("-", "")
    for key in sorted(GPUS, key=len, reverse=True):  # longest first: A100 before A10, L40S before L4
        if key == "cpu" or is_variant(key):  # variants: the H100 PCIe test below
            continue
        if key.split("-")[0].upper() in compact:
            if key == "H100" and "PCIE" in compact:
                return H100_PCIE_PEAK_BF16
            return GPUS[key].peak_bf16_flops
    return None


class Metrics:
    def __init__(self, run_uri: str, *, rank: int, steps: int, world_size: int, tokens_per_step: int,
                 flops_per_token: float, peak_flops_per_rank: float | None, heartbeat_s: float, log_every: int,
                 stall_s: float | None = None, trackers: Any = None):
        self.run_uri, self.rank, self.steps, self.world_size = run_uri, rank, steps, world_size
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak = peak_flops_per_rank
        self.heartbeat_s, self.log_every = heartbeat_s, log_every
        self.attempt = int(os.environ.get("DTRUN_ATTEMPT", "0") or 0)
        self._last_beat = 0.0
        self._win_t, self._win_step = time.perf_counter(), None
        self.tokens_per_s = 0.0
        self.mfu: float | None = None
        self.val_loss: float | None = None  # the newest validation loss (progress.json, DONE)
        self.trackers = trackers if rank == 0 else None
        # Storage writes run on one background thread (rank 0): on S3 a metrics.jsonl "append" is a
        # GET + PUT of the whole file, which must not stall the training loop (and, through the
        # next all-reduce, every rank). Rows queued while a write is in flight go out together.
        self._lock = threading.Lock()
        self._rows: list[str] = []
        self._beat: dict[str, Any] | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrun-metrics") if rank == 0 else None
        # What the next heartbeat says; the heartbeat thread rewrites it with a fresh time.
        self.stall_s = stall_s
        self.phase = "starting"
        self._cur: dict[str, Any] = {"step": 0, "loss": None, "last_committed": None, "status": "training",
                                     "extra": {}}
        self._activity = time.monotonic()  # the last completed step or phase change
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

    def _rate(self, step: int) -> None:
        now = time.perf_counter()
        if self._win_step is None:
            self._win_t, self._win_step = now, step
            return
        dt, ds = now - self._win_t, step - self._win_step
        if ds > 0 and dt > 0:
            self.tokens_per_s = ds * self.tokens_per_step / dt
            if self.peak:
                self.mfu = self.tokens_per_s * self.flops_per_token / (self.peak * self.world_size)
            self._win_t, self._win_step = now, step

    def start(self, step: int) -> None:
        self._win_t, self._win_step = time.perf_counter(), step

    def progress(self, step: int, loss: float | None, last_committed: int | None, *, status: str = "training",
                 force: bool = False, phase: str | None = None, **extra: Any) -> None:
        """Record the state the heartbeat reports; write it if forced or one is due."""
        if self.rank != 0:
            return
        with self._lock:
            if phase is not None and phase != self.phase:
                assert phase in PHASES, phase
                self.phase = phase
                self._activity = time.monotonic()
            self._cur = {"step": step, "loss": loss, "last_committed": last_committed, "status": status,
                         "extra": extra}
        self._heartbeat(force)

    def set_phase(self, phase: str) -> None:
        """Enter ``phase`` (one of ``PHASES``) and write the heartbeat now (rank 0; else a no-op)."""
        if self.rank != 0:
            return
        assert phase in PHASES, phase
        with self._lock:
            self.phase = phase
            self._activity = time.monotonic()
        self._heartbeat(True)

    def _heartbeat(self, force: bool, *, from_thread: bool = False) -> None:
        now = time.time()
        with self._lock:
            if not force and now - self._last_beat < self.heartbeat_s:
                return
            if (from_thread and self.phase == "training" and self.stall_s is not None
                    and time.monotonic() - self._activity > self.stall_s):
                return  # no step for stall_s: let the heartbeat go stale (a hung loop)
            self._last_beat = now
            c = self._cur
            self._beat = {"step": c["step"], "steps": self.steps, "loss": c["loss"],
                          "tokens_per_s": round(self.tokens_per_s, 2), "mfu": self.mfu,
                          "last_committed_step": c["last_committed"], "time": now, "attempt": self.attempt,
                          "world_size": self.world_size, "status": c["status"], "phase": self.phase,
                          "val_loss": self.val_loss, **c["extra"]}
        try:
            self._io.submit(self._write_progress)
        except RuntimeError:  # close() already shut the writer down
            pass

    def start_heartbeat(self, step: int = 0, last_committed: int | None = None) -> None:
        """Write the heartbeat now, then every ``heartbeat_s`` from a background thread until
        ``close`` (rank 0; else a no-op)."""
        if self.rank != 0 or self._hb_thread is not None:
            return
        with self._lock:
            self._cur.update(step=step, last_committed=last_committed)
        self._heartbeat(True)

        def loop() -> None:
            while not self._hb_stop.wait(min(self.heartbeat_s / 2, 5.0)):
                self._heartbeat(False, from_thread=True)

        self._hb_thread = threading.Thread(target=loop, name="dtrun-heartbeat", daemon=True)
        self._hb_thread.start()

    def _write_progress(self) -> None:
        with self._lock:
            rec, self._beat = self._beat, None
        if rec is None:
            return
        try:
            runuri.write_json(runuri.join(self.run_uri, runuri.PROGRESS), rec)
        except Exception as e:  # noqa: BLE001 - a missed heartbeat must not kill training
            log.warning("progress.json write failed: %s: %s", type(e).__name__, e)

    def _append_rows(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return
        try:
            runuri.append_line(runuri.join(self.run_uri, runuri.METRICS), "\n".join(rows))
        except Exception as e:  # noqa: BLE001
            log.warning("metrics.jsonl append failed: %s: %s", type(e).__name__, e)

    def close(self) -> None:
        """Stop the heartbeat thread, finish the queued writes (every rank may call it)."""
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join()
        if self._io is not None:
            self._io.shutdown(wait=True)
        if self.trackers is not None:
            self.trackers.close()

    def _track(self, step: int, values: dict[str, Any]) -> None:
        if self.trackers is not None and self.trackers.items:
            self._io.submit(_track_now, self.trackers, step, values)

    def eval(self, step: int, val_loss: float) -> None:
        """A validation loss after ``step`` steps: a metrics.jsonl row, progress.json, trackers (rank 0)."""
        if self.rank != 0:
            return
        self.val_loss = val_loss
        row = {"step": step, "val_loss": round(val_loss, 6), "tokens": step * self.tokens_per_step,
               "time": time.time(), "attempt": self.attempt}
        log.info("step %d/%d val_loss %.4f", step, self.steps, val_loss)
        with self._lock:
            self._rows.append(_json(row))
        self._io.submit(self._append_rows)
        self._track(step, {"val/loss": val_loss})
        self._heartbeat(True)

    def step(self, step: int, loss: float, grad_norm: float, lr: float, last_committed: int | None) -> None:
        """Called on every rank after each step (``step`` = completed steps)."""
        if self.rank != 0:
            return
        if step % self.log_every == 0 or step == self.steps:
            self._rate(step)
            row = {"step": step, "loss": round(loss, 6), "grad_norm": round(grad_norm, 6), "lr": lr,
                   "tokens_per_s": round(self.tokens_per_s, 2), "mfu": self.mfu, "time": time.time(),
                   "tokens": step * self.tokens_per_step, "attempt": self.attempt}
            mfu = f" mfu {self.mfu:.1%}" if self.mfu is not None else ""
            log.info("step %d/%d loss %.4f grad_norm %.3f lr %.3g tok/s %.0f%s", step, self.steps, loss,
                     grad_norm, lr, self.tokens_per_s, mfu)
            with self._lock:
                self._rows.append(_json(row))
            self._io.submit(self._append_rows)
            self._track(step, {"train/loss": loss, "train/grad_norm": grad_norm, "train/lr": lr,
                               "perf/tokens_per_s": self.tokens_per_s, "perf/mfu": self.mfu})
        with self._lock:
            self._activity = time.monotonic()
        # The first completed step of this attempt ends first_step (compilation, warm-up).
        self.progress(step, loss, last_committed, phase="training" if self.phase == "first_step" else None)


def _track_now(trackers: Any, step: int, values: dict[str, Any]) -> None:
    trackers.log(step, values)


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, sort_keys=True)

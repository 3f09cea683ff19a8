"""Run-URI metrics written by rank 0: ``progress.json`` (heartbeat), ``metrics.jsonl``, a log line.

``progress.json`` keys (contract): step, steps, loss, tokens_per_s, mfu (null on CPU),
last_committed_step, time, attempt, world_size — plus ``status`` (training, done, stopped,
preempted) and, when the trainer exits, ``exit_code``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from orchestrator import runuri

log = logging.getLogger("trainer")


def peak_flops(device_type: str) -> float | None:
    """Peak dense bf16 FLOP/s of this rank's GPU (orchestrator.gpus), None on CPU/unknown."""
    if device_type != "cuda":
        return None
    import torch

    return peak_flops_for_name(torch.cuda.get_device_name())


H100_PCIE_PEAK_BF16 = 756e12  # the PCIe card's dense bf16 peak; the table's H100 is the SXM part


def peak_flops_for_name(device_name: str) -> float | None:
    """Peak for a CUDA device name such as 'NVIDIA GeForce RTX 4090' or 'NVIDIA H100 PCIe'."""
    from orchestrator.gpus import GPUS

    compact = device_name.upper().replace(" ", "").replace("-", "")
    for key in sorted(GPUS, key=len, reverse=True):  # longest first: A100 before A10, L40S before L4
        if key == "cpu":
            continue
        if key.split("-")[0].upper() in compact:
            if key == "H100" and "PCIE" in compact:
                return H100_PCIE_PEAK_BF16
            return GPUS[key].peak_bf16_flops
    return None


class Metrics:
    def __init__(self, run_uri: str, *, rank: int, steps: int, world_size: int, tokens_per_step: int,
                 flops_per_token: float, peak_flops_per_rank: float | None, heartbeat_s: float, log_every: int):
        self.run_uri, self.rank, self.steps, self.world_size = run_uri, rank, steps, world_size
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak = peak_flops_per_rank
        self.heartbeat_s, self.log_every = heartbeat_s, log_every
        self.attempt = int(os.environ.get("DTRUN_ATTEMPT", "0") or 0)
        self._last_beat = 0.0
        self._win_t, self._win_step = time.perf_counter(), None
        self.tokens_per_s = 0.0
        self.mfu: float | None = None
        # Storage writes run on one background thread (rank 0): on S3 a metrics.jsonl "append" is a
        # GET + PUT of the whole file, which must not stall the training loop (and, through the
        # next all-reduce, every rank). Rows queued while a write is in flight go out together.
        self._lock = threading.Lock()
        self._rows: list[str] = []
        self._beat: dict[str, Any] | None = None
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrun-metrics") if rank == 0 else None

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
                 force: bool = False, **extra: Any) -> None:
        if self.rank != 0:
            return
        now = time.time()
        if not force and now - self._last_beat < self.heartbeat_s:
            return
        self._last_beat = now
        rec = {"step": step, "steps": self.steps, "loss": loss, "tokens_per_s": round(self.tokens_per_s, 2),
               "mfu": self.mfu, "last_committed_step": last_committed, "time": now, "attempt": self.attempt,
               "world_size": self.world_size, "status": status, **extra}
        with self._lock:
            self._beat = rec
        self._io.submit(self._write_progress)

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
        """Finish the queued writes (every rank may call it)."""
        if self._io is not None:
            self._io.shutdown(wait=True)

    def step(self, step: int, loss: float, grad_norm: float, lr: float, last_committed: int | None) -> None:
        """Called on every rank after each step (``step`` = completed steps)."""
        if self.rank != 0:
            return
        if step % self.log_every == 0 or step == self.steps:
            self._rate(step)
            row = {"step": step, "loss": round(loss, 6), "grad_norm": round(grad_norm, 6), "lr": lr,
                   "tokens_per_s": round(self.tokens_per_s, 2), "mfu": self.mfu, "time": time.time()}
            mfu = f" mfu {self.mfu:.1%}" if self.mfu is not None else ""
            log.info("step %d/%d loss %.4f grad_norm %.3f lr %.3g tok/s %.0f%s", step, self.steps, loss,
                     grad_norm, lr, self.tokens_per_s, mfu)
            with self._lock:
                self._rows.append(_json(row))
            self._io.submit(self._append_rows)
        self.progress(step, loss, last_committed)


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, sort_keys=True)

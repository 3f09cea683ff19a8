"""Checkpoints in the run URI with torch.distributed.checkpoint (DCP).

One manager over a dict of stateful things (torchtitan's ``components/checkpoint.py``):

* ``model`` / ``optim``: ``get_state_dict`` (DTensor shards; expert weights as DTensors so every
  expert is saved), loaded with ``set_state_dict`` — DCP reshards on load (save at world 4,
  resume at 2 or 1);
* ``train``: completed steps, tokens, last loss (the LR schedule is a function of the step);
* ``data_dp<r>``: the data position of data-parallel rank ``r``; ``rng_rank<r>``: RNG state of
  global rank ``r`` (per-rank keys; a rank whose key is absent after a reshard starts from the
  step-derived position / a seeded RNG).

Saves go to ``<run-uri>/checkpoints/step-<N>/`` through fsspec (s3fs for ``s3://``, endpoint from
``AWS_ENDPOINT_URL``; credentials from the standard AWS chain, never logged), each rank writing
``UPLOAD_THREADS`` files concurrently (on S3: that many multipart uploads at once). ``async``
mode uses ``dcp.async_save`` on a dedicated gloo process group: the loop stalls only while the
state is staged (copied) into host buffers that one stager keeps across saves (pinned on GPU
nodes: no fresh allocation per save); the upload runs in a background thread. Rank 0 writes
``COMMITTED`` (JSON) once the save's future completes — DCP's final metadata write happens after
every rank's data is written, so that means every rank is done — and then applies retention
(keep the newest ``keep`` COMMITTED steps), both on a committer thread: the loop never waits for
them. The next save first waits for the previous one. A failed save (storage error after s3fs's
own retries, plus one whole-save retry for sync saves) leaves the step uncommitted, logs a warning
and training goes on; the next interval tries again.

The emergency save at a preemption notice is bounded (:func:`emergency_plan`, ``NOTICE_S``): it
waits for an in-flight upload only as long as the notice allows and abandons it otherwise, then
saves the current step on its own process group only if a whole save (as last measured) still
fits. ``MAX_FAILED_SAVES`` failed saves in a row stop the run (exit 1).

Resume takes the newest COMMITTED step; partial folders (no COMMITTED) are ignored (and removed
at start-up when newer than it). A checkpoint whose model keys or shapes differ from the model
raises ``ConfigError`` (exit 2): never a silent fresh start. Reading a checkpoint tells two
failures apart (:func:`classify`): a *storage* error (OSError — s3fs's form of a 503 SlowDown or
a dropped connection —, timeouts, botocore/aiohttp errors) is retried with backoff, and if it
persists the attempt ends (``CheckpointUnavailable``, exit 1, retried by the controller) with
nothing deleted; a checkpoint *proven corrupt* (bad pickle, missing files, a shard that does not
match its metadata) is quarantined — its COMMITTED moved to ``COMMITTED.quarantined`` with the
reason, the folder kept — and the previous COMMITTED one is tried (every rank takes the same
branch). If every COMMITTED checkpoint is corrupt: an error, never a fresh start. Before the
emergency/STOP/final save every rank adopts rank 0's last COMMITTED step (``settle``).

The read side (resume, :func:`classify`, quarantine) lives in :mod:`trainer.checkpoint_resume`.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from orchestrator.contract import runuri
from trainer.checkpoint_resume import QUARANTINED, _reader, _storage_kwargs  # noqa: F401 - imported from here
from trainer.checkpoint_resume import _ERRORS, ResumeMixin, _short
from trainer.errors import SavesFailing

log = logging.getLogger("trainer.checkpoint")

UPLOAD_THREADS = int(os.environ.get("DTRUN_CKPT_UPLOAD_THREADS", "8"))
"""Files each rank writes concurrently (DCP ``thread_count``): on S3 each file is its own
multipart upload, so a rank's state goes up as this many concurrent streams, not one."""

NOTICE_S = float(os.environ.get("DTRUN_PREEMPTION_NOTICE_S", "30"))
"""The preemption notice the emergency save must fit (GCP and Azure give 30 s, AWS 120 s). Also
the collective timeout of the emergency group: a peer that vanishes mid-save ends it then."""

MAX_FAILED_SAVES = 3
"""Checkpoint saves in a row that may fail (storage errors after s3fs's retries and the sync
save's own retry) before the run stops with exit 1 (the controller restarts it, counted against
``recovery.max_restarts_on_errors``): training on without a COMMITTED checkpoint is not training."""

HARD_EXIT_MARGIN_S = 5.0
"""At a notice the trainer exits 75 at the latest ``NOTICE_S`` + this after the SIGTERM, whatever
its collectives do (below torchrun's ``--shutdown-timeout``, the bootstrap's kill grace, 40 s)."""


def _writer(uri: str, threads: int | None = None):
    n = max(1, threads or UPLOAD_THREADS)
    lp = runuri.local_path(uri)
    if lp is not None:
        return dcp.FileSystemWriter(lp, sync_files=False, thread_count=n)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(uri, sync_files=False, thread_count=n, **_storage_kwargs(uri))


def _stager(pinned: bool):
    """One stager for the run: DCP's ``StateDictStager`` keeps a CPU copy per source storage, so
    every save after the first reuses the same (pinned, on GPU) host buffers."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))


STAGING_HOST_FRACTION = 0.8
"""Async saves keep a pinned copy of every rank's model and optimizer state in host memory for the
whole run; on a GPU node whose available memory cannot hold this many times the node's copies,
saves are made synchronously instead (no staging copy), with a warning."""


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of ``MemAvailable`` (Linux), None where unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def staging_fits(per_rank_bytes: int, local_ranks: int, available: int | None) -> tuple[bool, str]:
    """Whether the node's ranks' pinned staging copies fit its available host memory, and why."""
    need = per_rank_bytes * local_ranks
    if available is None:
        return True, "available host memory unknown"
    ok = need <= STAGING_HOST_FRACTION * available
    return ok, (f"async checkpoint staging needs {need / 2**30:.1f} GiB of pinned host memory on this node "
                f"({local_ranks} ranks × {per_rank_bytes / 2**30:.1f} GiB), {available / 2**30:.1f} GiB available")


def emergency_plan(elapsed_s: float, inflight_left_s: float | None, save_s: float | None,
                   notice_s: float = NOTICE_S, margin_s: float = 3.0) -> tuple[float, bool]:
    """At a preemption notice: (seconds to wait for the in-flight upload, whether to save the
    current step afterwards).

    ``elapsed_s``: time since the notice; ``inflight_left_s``: estimated seconds the in-flight
    upload still needs (None: none in flight); ``save_s``: how long a save of this state took
    last time (None: never measured). Wait for the in-flight upload only as long as the notice
    allows; save the current step only if a whole save fits after that (with ``margin_s`` for
    COMMITTED and exit). An upload that cannot finish in time is abandoned (its step stays
    uncommitted; the previous COMMITTED one is the fallback)."""
    left = notice_s - elapsed_s - margin_s
    wait = 0.0
    if inflight_left_s is not None:
        wait = max(0.0, min(inflight_left_s, left))
        left -= wait
    need = save_s if save_s is not None else 0.0
    return wait, need <= left



class CheckpointManager(ResumeMixin):
    def __init__(self, run_uri: str, *, keep: int, async_mode: str, rank: int, world_size: int,
                 dp_rank: int, describe: dict[str, Any], pinned: bool = False,
                 timeout: timedelta | None = None):
        self.run_uri, self.keep, self.async_mode = run_uri, keep, async_mode
        self.rank, self.world_size, self.dp_rank = rank, world_size, dp_rank
        self.describe = describe  # parallel degrees etc., recorded in COMMITTED
        # Bounded waits for a peer (``timeout``: trainer.collective_timeout_seconds; torch's gloo
        # default is 30 minutes).
        self.pg = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        # The emergency save's own group: an in-flight async upload abandoned at a notice may still
        # run collectives on self.pg in its thread. Bounded by the notice.
        self.pg_emergency = (dist.new_group(backend="gloo", timeout=timedelta(seconds=NOTICE_S))
                             if dist.is_initialized() else None)
        self._pending: tuple[int, Future, dict[str, Any], float] | None = None
        self.last_committed: int | None = None
        self.last_saved_step: int | None = None
        self.stall_s: list[float] = []  # loop stall per save (staging for async; whole save for sync)
        self.upload_s: list[float] = []  # whole save durations (start → every rank's data written)
        self.abandoned: int | None = None  # step of an upload left behind at a notice
        self.failed_saves = 0  # in a row; MAX_FAILED_SAVES stops the run
        self._stager = _stager(pinned=pinned)
        # Rank 0 writes COMMITTED and applies retention here, off the training loop.
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dtrun-commit")
        self._commit_futs: list[Future] = []
        self._lock = threading.Lock()
        self.extra: dict[str, Any] = {}  # name → object with state_dict()/load_state_dict() (register)

    def register(self, name: str, obj: Any) -> None:
        """Save ``obj.state_dict()`` under ``name``; a checkpoint without it loads without it."""
        self.extra[name] = obj

    flat_optim = False
    """Save the optimizer state flattened by parameter name (:meth:`state_dict`); a load follows the
    checkpoint's own format either way."""

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self, model, optimizer, loader, train: dict[str, Any], flat_optim: bool | None = None) -> dict[str, Any]:
        """``flat_optim`` (default: ``self.flat_optim``, set under pipeline parallelism): the optimizer's
        param groups saved per parameter name (DCP's ``flatten_optimizer_state_dict``) — pipeline
        stages hold different parameters, and one ``param_groups`` list per rank would be kept
        from one rank only (DCP deduplicates the key), losing the others' hyperparameters."""
        if flat_optim if flat_optim is not None else self.flat_optim:
            from torch.distributed.checkpoint.state_dict import StateDictOptions

            msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
        else:
            msd, osd = get_state_dict(model, optimizer)
        sd: dict[str, Any] = {"model": msd, "optim": osd, "train": dict(train)}
        sd[f"data_dp{self.dp_rank}"] = loader.state_dict()
        sd[f"rng_rank{self.rank}"] = torch.get_rng_state()
        for name, obj in self.extra.items():
            sd[name] = obj.state_dict()
        return sd

    # ---- save --------------------------------------------------------------------------------
    def save(self, step: int, sd: dict[str, Any], meta: dict[str, Any], *, sync: bool = False,
             emergency: bool = False) -> None:
        """Save step ``step``; async unless ``sync`` or the spec says sync. Waits for the previous
        (unless ``emergency``: then it runs on its own process group beside an abandoned upload)."""
        if not emergency:
            self.wait()
        uri = runuri.checkpoint_uri(self.run_uri, step)
        t0 = time.perf_counter()
        self.last_saved_step = step
        pg = self.pg_emergency if emergency else self.pg
        if sync or self.async_mode == "sync":
            ok = False
            for attempt in (1, 2):
                try:
                    dcp.save(sd, storage_writer=_writer(uri), process_group=pg)
                    ok = True
                    break
                except _ERRORS as e:  # noqa: BLE001 - storage errors of any backend
                    log.warning("checkpoint step %d: save attempt %d failed: %s", step, attempt, _short(e))
                    if emergency:
                        break  # no time for a second try inside the notice
            self.stall_s.append(time.perf_counter() - t0)
            if ok:
                self.upload_s.append(time.perf_counter() - t0)
                self._committed_here(step, meta, wait=True)
            elif not emergency:
                self._failed(step, "the save failed twice")
            return
        try:
            fut = dcp.async_save(sd, storage_writer=_writer(uri), process_group=self.pg,
                                 async_stager=self._stager)
            if hasattr(fut, "upload_completion"):  # AsyncSaveResponse (custom stagers)
                fut.staging_completion.result()
                fut = fut.upload_completion
        except _ERRORS as e:  # noqa: BLE001 - e.g. the storage refused the folder
            self.stall_s.append(time.perf_counter() - t0)
            self._failed(step, f"async save failed ({_short(e)})")
            return
        self.stall_s.append(time.perf_counter() - t0)
        self._pending = (step, fut, meta, t0)

    def poll(self) -> None:
        """Note a finished async save (non-blocking; rank 0 commits it on the committer thread)."""
        if self._pending is not None and self._pending[1].done():
            self.wait(drain=False)

    def wait(self, timeout: float | None = None, drain: bool = True) -> bool:
        """Block (at most ``timeout`` s) until the in-flight async save finishes; commit it if it
        succeeded (``drain``: and until rank 0's COMMITTED write is done). False: still running
        after ``timeout`` (it stays pending)."""
        if self._pending is None:
            if drain:
                self._drain_commits()
            return True
        step, fut, meta, t0 = self._pending
        try:
            fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            if not fut.done():
                return False
            self._pending = None
            self._failed(step, "async save timed out")
            return True
        except _ERRORS as e:  # noqa: BLE001
            self._pending = None
            self._failed(step, f"async save failed ({_short(e)})")
            return True
        self._pending = None
        self.upload_s.append(time.perf_counter() - t0)
        self._committed_here(step, meta, wait=drain)
        return True

    def _failed(self, step: int, why: str) -> None:
        """A save that left ``step`` uncommitted: training goes on, up to MAX_FAILED_SAVES in a row."""
        self.failed_saves += 1
        log.warning("checkpoint step %d: %s; NOT committed (%d in a row)", step, why, self.failed_saves)
        if self.failed_saves >= MAX_FAILED_SAVES:
            raise SavesFailing(f"{self.failed_saves} checkpoint saves in a row failed (last: step {step}, {why}); "
                               f"stopping this attempt: training on without a COMMITTED checkpoint is not "
                               f"training (check the run URI's storage)")

    def inflight_left_s(self) -> float | None:
        """Estimated seconds the in-flight upload still needs (None: nothing in flight)."""
        if self._pending is None:
            return None
        typical = max(self.upload_s) if self.upload_s else NOTICE_S
        return max(0.0, typical - (time.perf_counter() - self._pending[3]))

    def abandon(self) -> None:
        """Stop waiting for the in-flight upload (a preemption notice it cannot finish within):
        its step is never committed; its thread is left to die with the process."""
        if self._pending is not None:
            self.abandoned = self._pending[0]
            log.warning("checkpoint step %d: upload cannot finish within the notice; abandoned", self.abandoned)
            self._pending = None

    def settle(self, timeout: float | None = None) -> int | None:
        """Collective: finish the in-flight save (waiting at most ``timeout`` s, else abandon it),
        wait for rank 0's COMMITTED write, then adopt rank 0's last COMMITTED step.

        Only rank 0 writes ``COMMITTED``; if that write fails, rank 0 alone forgets the step. Every
        rank must take the same branch at the decision points (emergency/STOP/final save, DONE),
        or rank 0 would enter a collective save alone and hang."""
        if not self.wait(timeout):
            self.abandon()
            self._drain_commits()
        if dist.is_initialized():
            # At a notice (``timeout`` given) on the emergency group, bounded by the notice (an
            # abandoned upload may still use self.pg); otherwise rank 0's COMMITTED write may take
            # longer than a notice, so the others wait on self.pg's collective timeout.
            box = [self.last_committed]
            dist.broadcast_object_list(box, src=0, group=self.pg_emergency if timeout is not None else self.pg)
            self.last_committed = box[0]
        return self.last_committed

    def _drain_commits(self) -> None:
        for f in self._commit_futs:
            f.result()
        self._commit_futs = []

    def _committed_here(self, step: int, meta: dict[str, Any], wait: bool = False) -> None:
        """This rank's part of ``step`` is written (rank 0: every rank's). Rank 0 writes COMMITTED
        and runs retention on the committer thread; the loop goes on."""
        self.failed_saves = 0
        if self.rank != 0:
            self.last_committed = step
            return
        self._commit_futs = [f for f in self._commit_futs if not f.done()]
        self._commit_futs.append(self._committer.submit(self._commit, step, meta))
        if wait:
            self._drain_commits()

    def _commit(self, step: int, meta: dict[str, Any]) -> None:
        rec = {"step": step, "world_size": self.world_size, "parallel": self.describe, "time": time.time(), **meta}
        uri = runuri.checkpoint_uri(self.run_uri, step)
        for attempt in (1, 2, 3):
            try:
                runuri.write_json(runuri.join(uri, runuri.COMMITTED), rec)
                break
            except Exception as e:  # noqa: BLE001
                log.warning("checkpoint step %d: COMMITTED write attempt %d failed: %s", step, attempt, _short(e))
                time.sleep(0.5 * attempt)
        else:
            with self._lock:
                self.last_committed = None
            return
        with self._lock:
            self.last_committed = step
        log.info("checkpoint step %d committed", step)
        self._retain()

    def _retain(self) -> None:
        try:
            runuri.retain(self.run_uri, self.keep)
        except Exception as e:  # noqa: BLE001 - retention is best effort
            log.warning("checkpoint retention failed: %s", _short(e))

    def close(self) -> None:
        if self.abandoned is None:
            self.wait()
        self._drain_commits()
        self._committer.shutdown(wait=True)
        self._stager.close()


def param_digest(model) -> str | None:
    """sha256 of every parameter and buffer (full tensors, fp32, sorted by name). Collective:
    every rank must call it; rank 0 gets the hex digest, others None."""
    import hashlib

    from torch.distributed.tensor import DTensor

    from trainer.model import _canonical_name

    h = hashlib.sha256()
    items = {}
    for k, v in model.state_dict().items():
        items[_canonical_name(k)] = v
    for name in sorted(items):
        v = items[name]
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if not isinstance(v, torch.Tensor):
            continue
        if dist.is_initialized() and dist.get_rank() != 0:
            continue
        h.update(name.encode())
        h.update(v.detach().float().cpu().contiguous().numpy().tobytes())
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return h.hexdigest()


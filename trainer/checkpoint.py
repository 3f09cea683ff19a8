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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from orchestrator.contract import runuri
from trainer.errors import CheckpointUnavailable, ConfigError, SavesFailing

log = logging.getLogger("trainer.checkpoint")

# DCP's CheckpointException derives from BaseException: name it explicitly.
_ERRORS = (Exception, CheckpointException)

QUARANTINED = "COMMITTED.quarantined"
"""A proven-corrupt checkpoint's COMMITTED record is moved here (with the reason): the folder is
kept for inspection, no longer counts as committed, and is replaced only when training reaches
that step again and saves it."""

LOAD_RETRY_ENV = "DTRUN_DEBUG_LOAD_RETRY"
"""Test-only knob ``"attempts,first_backoff_s"`` for reading a checkpoint (default 6 attempts,
2 s doubling to 30 s: about a minute of a throttled or unreachable store before giving up)."""


class CorruptCheckpoint(RuntimeError):
    """A checkpoint that cannot load whatever the storage does (bad pickle, missing files, a
    shard that does not match its metadata)."""


# Deserialisation failures: the bytes were read and are wrong. Everything else that is not a
# ConfigError — OSError and its subclasses (s3fs turns a 503 SlowDown or a dropped connection into
# one), timeouts, botocore/aiohttp errors — is the storage talking, and is retried.
_CORRUPT_TYPES = ("UnpicklingError", "EOFError", "ValueError", "RuntimeError", "KeyError", "IndexError",
                  "TypeError", "AttributeError", "UnicodeDecodeError", "AssertionError", "CorruptCheckpoint")


def classify(e: BaseException) -> str:
    """``"corrupt"`` (proven: skip and quarantine) or ``"storage"`` (retry; never delete)."""
    if isinstance(e, CheckpointException):
        kinds = set()
        for exc in e.failures.values():
            inner = exc[0] if isinstance(exc, tuple) else exc
            kinds.add(classify(inner) if isinstance(inner, BaseException) else "storage")
        return "storage" if "storage" in kinds or not kinds else "corrupt"
    if isinstance(e, FileNotFoundError):
        return "corrupt"  # a file the metadata names is missing (S3 lists and reads consistently)
    if isinstance(e, (OSError, TimeoutError, ConnectionError)):
        return "storage"
    mod = (type(e).__module__ or "").split(".")[0]
    if mod in ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "urllib3", "requests", "gcsfs"):
        return "storage"
    names = {c.__name__ for c in type(e).__mro__}
    if names & set(_CORRUPT_TYPES):
        return "corrupt"
    return "storage"


def _load_retry() -> tuple[int, float]:
    raw = os.environ.get(LOAD_RETRY_ENV)
    if raw:
        a, b = raw.split(",")
        return max(1, int(a)), float(b)
    return 6, 2.0


def _storage_kwargs(uri: str) -> dict[str, Any]:
    if uri.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    return {}


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


def _reader(uri: str):
    lp = runuri.local_path(uri)
    if lp is not None:
        return dcp.FileSystemReader(lp)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(uri, **_storage_kwargs(uri))


class CheckpointManager:
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

    # ---- state -------------------------------------------------------------------------------
    def state_dict(self, model, optimizer, loader, train: dict[str, Any]) -> dict[str, Any]:
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

    # ---- resume ------------------------------------------------------------------------------
    def clean_partial(self, after: int) -> None:
        """Rank 0: remove uncommitted step folders newer than ``after`` (a previous attempt's)."""
        if self.rank != 0:
            return
        for s in runuri.checkpoint_steps(self.run_uri):
            if s > after and runuri.committed(self.run_uri, s) is None and not self._quarantined(s):
                log.warning("ignoring partial checkpoint step-%d (no COMMITTED); removing it", s)
                runuri.remove(runuri.checkpoint_uri(self.run_uri, s), recursive=True)

    def _quarantined(self, step: int) -> bool:
        return runuri.exists(runuri.join(runuri.checkpoint_uri(self.run_uri, step), QUARANTINED))

    def committed_steps(self) -> list[int]:
        steps = []
        if self.rank == 0:
            steps = [s for s in runuri.checkpoint_steps(self.run_uri) if runuri.committed(self.run_uri, s)]
        if dist.is_initialized():
            box = [steps]
            dist.broadcast_object_list(box, src=0)
            steps = box[0]
        return steps

    def load_latest(self, model, optimizer, loader) -> dict[str, Any] | None:
        """Load the newest loadable COMMITTED checkpoint; returns its ``train`` dict or None.

        A storage error while reading (throttling, a dropped connection, a timeout) is retried
        with backoff; if it persists, :class:`CheckpointUnavailable` ends the attempt (retryable)
        and nothing is deleted. Only a checkpoint proven corrupt is skipped for the previous one,
        and it is quarantined (COMMITTED moved to ``COMMITTED.quarantined``), not removed."""
        steps = self.committed_steps()
        self.clean_partial(steps[-1] if steps else -1)
        attempts, backoff = _load_retry()
        for step in reversed(steps):
            uri = runuri.checkpoint_uri(self.run_uri, step)
            for attempt in range(1, attempts + 1):
                try:
                    train = self._load(uri, model, optimizer, loader)
                    break
                except ConfigError:
                    raise
                except _ERRORS as e:  # noqa: BLE001
                    kind = self._agree(classify(e))
                    if kind == "corrupt":
                        log.warning("checkpoint step-%d is COMMITTED but corrupt (%s); quarantining it and "
                                    "trying the previous one", step, _short(e))
                        self._quarantine(step, _short(e))
                        train = None
                        break
                    if attempt == attempts:
                        raise CheckpointUnavailable(
                            f"reading checkpoint step-{step} failed {attempts} times with storage errors "
                            f"(last: {_short(e)}); nothing deleted — the next attempt retries") from None
                    wait = min(backoff * 2 ** (attempt - 1), 30.0)
                    log.warning("checkpoint step-%d: storage error while reading (%s); retry %d/%d in %.1f s",
                                step, _short(e), attempt, attempts - 1, wait)
                    time.sleep(wait)
            if train is None:
                continue
            self.last_committed = step
            self.last_saved_step = step
            return train
        if steps:
            # Never a silent fresh start over COMMITTED checkpoints.
            raise CheckpointUnavailable(f"{len(steps)} COMMITTED checkpoint(s) under {self.run_uri} (steps {steps}) "
                                        f"but every one is corrupt (quarantined); not starting from scratch "
                                        f"(use a fresh run URI, or restore a COMMITTED.quarantined marker)")
        return None

    def _agree(self, kind: str) -> str:
        """Every rank takes the same branch: "storage" (retry) if any rank saw a storage error."""
        if not dist.is_initialized():
            return kind
        kinds: list[Any] = [None] * dist.get_world_size(self.pg)
        dist.all_gather_object(kinds, kind, group=self.pg)
        return "storage" if "storage" in kinds else "corrupt"

    def _quarantine(self, step: int, reason: str) -> None:
        """Rank 0: move the step's COMMITTED marker aside (write the copy first, then remove)."""
        if self.rank != 0:
            return
        uri = runuri.checkpoint_uri(self.run_uri, step)
        try:
            rec = runuri.committed(self.run_uri, step) or {}
            runuri.write_json(runuri.join(uri, QUARANTINED), {**rec, "quarantined_at": time.time(), "reason": reason})
            runuri.remove(runuri.join(uri, runuri.COMMITTED))
        except Exception as e:  # noqa: BLE001 - then it stays COMMITTED and is tried again next time
            log.warning("could not quarantine checkpoint step-%d: %s", step, _short(e))

    def _load(self, uri: str, model, optimizer, loader) -> dict[str, Any]:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        sd = self.state_dict(model, optimizer, loader, {"step": 0, "tokens": 0, "loss": 0.0})
        # Every rank reads the metadata; a read that fails on one rank only (a transient storage
        # error) must send *every* rank to the previous checkpoint, not leave the others alone in
        # the collective dcp.load below.
        exc: BaseException | None = None
        try:
            md, err = _reader(uri).read_metadata().state_dict_metadata, None
        except _ERRORS as e:  # noqa: BLE001
            md, err, exc = None, (classify(e), _short(e)), e
        if dist.is_initialized():
            errs: list[Any] = [None] * dist.get_world_size(self.pg)
            dist.all_gather_object(errs, err, group=self.pg)
            bad = [(r, x) for r, x in enumerate(errs) if x is not None]
            if bad and exc is None:
                r, (kind, msg) = bad[0]
                msg = f"rank {r}: reading the checkpoint metadata failed ({msg})"
                exc = CorruptCheckpoint(msg) if all(k == "corrupt" for _, (k, _m) in bad) else OSError(msg)
        if exc is not None:
            raise exc
        _check_model_shapes(uri, sd["model"], md)
        for k in [k for k in sd if k.startswith(("data_dp", "rng_rank")) or k in self.extra]:
            if not any(m == k or m.startswith(k + ".") for m in md):
                sd.pop(k)  # per-rank key absent (resharded to more ranks)
        flat, _ = flatten_state_dict(sd)
        missing = [k for k in flat if k not in md]
        if missing:
            raise ConfigError(f"checkpoint {uri} does not match this run (missing {missing[:3]}"
                              f"{' …' if len(missing) > 3 else ''}); different optimizer or model? "
                              f"Use a fresh run URI")
        dcp.load(sd, storage_reader=_reader(uri), process_group=self.pg)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        key = f"data_dp{self.dp_rank}"
        if key in sd:
            loader.load_state_dict(sd[key])
        rk = f"rng_rank{self.rank}"
        if rk in sd:
            torch.set_rng_state(sd[rk])
        for name, obj in self.extra.items():
            if name in sd:
                obj.load_state_dict(sd[name])
        return sd["train"]

    def close(self) -> None:
        if self.abandoned is None:
            self.wait()
        self._drain_commits()
        self._committer.shutdown(wait=True)
        self._stager.close()


def _check_model_shapes(uri: str, msd: dict[str, Any], md: dict[str, Any]) -> None:
    problems = []
    for k, v in msd.items():
        if not isinstance(v, torch.Tensor):
            continue
        m = md.get("model." + k)
        if m is None:
            problems.append(f"{k}: not in the checkpoint")
        elif hasattr(m, "size") and tuple(m.size) != tuple(v.shape):
            problems.append(f"{k}: checkpoint {tuple(m.size)} vs model {tuple(v.shape)}")
    extra = [k[len("model."):] for k in md if k.startswith("model.") and k[len("model."):] not in msd]
    problems += [f"{k}: in the checkpoint, not in the model" for k in extra]
    if problems:
        raise ConfigError(f"checkpoint {uri} was saved from a different model shape: "
                          + "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
                          + ". Use a fresh run URI or the original trainer.model")


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) < 400 else s[:400] + "…"


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


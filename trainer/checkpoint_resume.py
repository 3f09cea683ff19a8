"""Reading checkpoints back: resume from the newest loadable COMMITTED step.

The read side of :mod:`trainer.checkpoint`, whose ``CheckpointManager`` inherits
:class:`ResumeMixin`: the storage readers, :func:`classify` (a *storage* error is retried with
backoff and deletes nothing; a checkpoint *proven corrupt* is quarantined — its COMMITTED moved to
``COMMITTED.quarantined`` — and the previous one is tried), the removal of partial step folders
newer than the newest COMMITTED one, and the model-shape check that refuses a checkpoint of
another model (``ConfigError``, exit 2). Logs as ``trainer.checkpoint``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from orchestrator.contract import runuri
from trainer.errors import CheckpointUnavailable, ConfigError

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


def _reader(uri: str):
    lp = runuri.local_path(uri)
    if lp is not None:
        return dcp.FileSystemReader(lp)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(uri, **_storage_kwargs(uri))


class ResumeMixin:
    """``CheckpointManager``'s resume methods (it provides ``run_uri``, ``rank``, ``dp_rank``,
    ``pg``, ``extra``, ``state_dict`` and the ``last_committed``/``last_saved_step`` it sets)."""

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
        _check_model_shapes(uri, sd["model"], md, getattr(self, "whole_model_keys", None))
        # A pipeline-parallel run saves the optimizer's param groups by parameter name: load the
        # format the checkpoint has (pp = 2 → pp = 1 and back).
        saved_flat = (any(k.startswith("optim.param_groups.") for k in md)
                      and not any(k.startswith("optim.param_groups.0.") for k in md))
        if saved_flat != self.flat_optim:
            sd = self.state_dict(model, optimizer, loader, {"step": 0, "tokens": 0, "loss": 0.0}, flat_optim=saved_flat)
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
        opts = StateDictOptions(flatten_optimizer_state_dict=True) if saved_flat else None
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=opts)
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


def _check_model_shapes(uri: str, msd: dict[str, Any], md: dict[str, Any], whole: set[str] | None = None) -> None:
    """``whole``: the whole model's names when this rank holds a part of them (pipeline stages)."""
    problems = []
    for k, v in msd.items():
        if not isinstance(v, torch.Tensor):
            continue
        m = md.get("model." + k)
        if m is None:
            problems.append(f"{k}: not in the checkpoint")
        elif hasattr(m, "size") and tuple(m.size) != tuple(v.shape):
            problems.append(f"{k}: checkpoint {tuple(m.size)} vs model {tuple(v.shape)}")
    extra = [k[len("model."):] for k in md if k.startswith("model.") and k[len("model."):] not in (whole or msd)]
    problems += [f"{k}: in the checkpoint, not in the model" for k in extra]
    if problems:
        raise ConfigError(f"checkpoint {uri} was saved from a different model shape: "
                          + "; ".join(problems[:4]) + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
                          + ". Use a fresh run URI or the original trainer.model")


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) < 400 else s[:400] + "…"

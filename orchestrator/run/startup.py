"""The checks before a job starts, in one place: the controller's start and ``dtrun up`` both call
:func:`check_start`, before anything is written to the state store or rented.

1. no other live controller owns the job (:class:`ControllerBusy`);
2. a new run has a usable provider: when the plan's offers are all on providers without
   credentials, ``ProviderRefused`` (exit 5) naming what to set;
3. a remote node of the chosen offer can reach the object store: ``ProviderRefused`` (exit 5)
   naming the credentials to set (``orchestrator.run.nodecreds``);
4. the run URI already has ``DONE`` (a new run only): nothing to train.

A job still active in the store (PENDING … STOPPING) is *re-attached*: its nodes must be watched
and stopped whatever the plan says now, so checks 2–4 do not apply to it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from orchestrator.contract import runuri
from orchestrator.contract.errors import DtrunError, ProviderRefused
from orchestrator.run.nodecreds import node_storage
from orchestrator.run.state import ACTIVE_STATES, StateStore


class ControllerBusy(DtrunError):
    """Another live controller process owns this job."""


@dataclass(frozen=True)
class StartCheck:
    """What :func:`check_start` found (it raised if the job must not start)."""

    job: dict | None
    """The job's row in the state store, if it has one."""
    reattach: bool
    """The job is active: a (re)started controller re-attaches to the nodes recorded for it."""
    done: bool = False
    """A new run whose run URI already has DONE: nothing to train."""
    uri_error: OSError | None = None
    """A new run whose run URI could not be read (the caller ends the job and says why, exit 6)."""


def require_usable_provider(plan: Any) -> None:
    """Check 2 alone (``dtrun up`` makes it before it prints the plan): when every offer is on a
    provider without credentials, ``ProviderRefused`` (exit 5) naming what to set; nothing rented."""
    if getattr(plan, "chosen", None) is None and getattr(plan, "unusable", None):
        raise ProviderRefused("; ".join(plan.unusable.values()) + "; nothing rented")


def check_start(spec: Any, plan: Any, store: StateStore, pid: int | None = None) -> StartCheck:
    """Run the start-up checks for ``spec`` with ``plan`` (``orchestrator.plan.estimate.Plan``)
    against ``store``; ``pid`` is the caller's process (default this one), which may own the job
    already. Raises :class:`ControllerBusy` or ``ProviderRefused``; writes and rents nothing."""
    pid = os.getpid() if pid is None else pid
    job = store.get_job(spec.name)
    if job and job["controller_pid"] not in (None, pid) and StateStore.controller_alive(job):
        raise ControllerBusy(f"job {spec.name} is already run by controller pid {job['controller_pid']} "
                             f"on {job['controller_host']}; see `dtrun status {spec.name}`, "
                             f"or `dtrun down {spec.name}`")
    reattach = job is not None and job["state"] in ACTIVE_STATES
    if reattach:
        return StartCheck(job, True)
    require_usable_provider(plan)
    chosen = getattr(plan, "chosen", None)
    if chosen is not None:
        # A remote node needs the object store's credentials: refuse (exit 5) naming what to set.
        node_storage(spec, chosen.provider)
    try:
        done = runuri.exists(runuri.join(spec.run_uri, runuri.DONE))
    except OSError as e:
        return StartCheck(job, False, uri_error=e)
    return StartCheck(job, False, done=done)

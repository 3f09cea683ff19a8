"""The orphan sweep: find and terminate provider instances that no live job owns (run at every
controller start and by ``dtrun gc``, whose command lives in ``orchestrator.cli.money``).

Orphans
    Every provider instance dtrun creates is named ``dtrun-<job>-a<attempt>`` from creation
    (``providers.base.instance_name``), so an instance billing without an owner can be found by
    its prefix even when dtrun crashed between "created" and "recorded". An instance is **owned**
    (left alone) when

    1. the state store records it as a live node (not confirmed terminated) of a job that is still
       active (PENDING … STOPPING) whose controller is alive (or is the caller): a restarted
       controller re-attaches to it — but a node whose controller died on this host (SIGKILL,
       reboot) bills with nobody to stop it, and ``dtrun gc`` ends it; or
    2. its job is active and run by a live controller in *another* process, and its attempt is
       still LAUNCHING (that controller may be between "launch returned" and "node recorded").

    Everything else carrying the prefix is an orphan: instances of finished or unknown jobs,
    unrecorded instances of the caller's own job, nodes the store thinks live for a job that
    already ended. ``sweep_orphans`` terminates them (retrying ``Transient`` and polling
    ``TerminateNotConfirmed`` until the provider confirms) and marks matching node rows
    terminated only then. The controller runs it at every start; ``dtrun gc`` runs it on demand.

Ours and not ours
    One cloud account may serve several state stores (two people, a laptop and a CI runner): every
    node carries its store's owner id (``StateStore.owner_id`` → ``LaunchRequest.owner``, kept by
    the provider: fake record, local registry, Modal tag, SkyPilot memo in this ``$DTRUN_HOME``).
    An orphan is **ours** when it carries our owner id, or carries none but this store recorded it
    (a node launched by this store with dtrun before owners). Everything else is **not ours**:
    another store's (whatever its state — its controller may be asleep, not gone) or an unowned
    instance this store never recorded (launched by an older dtrun, from here or elsewhere: we
    cannot tell, so we leave it). The automatic sweep terminates only ours; ``dtrun gc`` lists
    the others as "not ours" and terminates them only when named (``dtrun gc <name>``) or with
    ``--all``, after a confirmation (``--yes`` where there is no terminal).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from orchestrator.contract.errors import EXIT_JOB_FAILED, EXIT_OK, NotFoundError
from orchestrator.run.clock import RealClock
from orchestrator.run.state import ACTIVE_STATES, HOST, StateStore
from providers import errors as perr
from providers.base import NAME_PREFIX, Handle, OwnedInstance, Provider, job_of_instance

# How long a sweep keeps asking a provider to confirm a terminate before it reports the
# instance as "terminate sent, not confirmed" (the next sweep or `dtrun gc` tries again).
CONFIRM_TIMEOUT_S = 300.0
TRANSIENT_TRIES = 5


@dataclass
class Orphan:
    provider: str
    instance: OwnedInstance
    job: str | None
    why: str
    outcome: str = "listed"
    """listed | terminated | not_confirmed | error"""
    error: str = ""
    ours: bool = True
    """Launched by this state store (see "Ours and not ours"); only ours are swept automatically."""

    def to_dict(self) -> dict[str, Any]:
        i = self.instance
        return {"provider": self.provider, "name": i.name, "instance_id": i.instance_id, "region": i.region,
                "state": getattr(i.state, "value", str(i.state)), "created_at": i.created_at, "job": self.job,
                "why": self.why, "outcome": self.outcome, "error": self.error, "ours": self.ours,
                "owner": i.owner}


@dataclass
class SweepReport:
    orphans: list[Orphan] = field(default_factory=list)
    owned: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    """provider → why it could not be listed"""

    def to_dict(self) -> dict[str, Any]:
        return {"orphans": [o.to_dict() for o in self.orphans], "owned": self.owned, "errors": self.errors,
                "terminated": sum(o.outcome == "terminated" for o in self.orphans),
                "not_ours": sum(not o.ours for o in self.orphans),
                "not_confirmed": sum(o.outcome in ("not_confirmed", "error") for o in self.orphans)}


def _resolve(entry: str | Provider, providers: dict[str, Provider] | None) -> tuple[str, Provider]:
    if isinstance(entry, Provider):
        return entry.name, entry
    if providers and entry in providers:
        return entry, providers[entry]
    from providers import registry

    return entry, registry.get(entry)


def _owner_dead(job: dict) -> bool:
    """The job's controller ran on this host, is not this process, and is dead (SIGKILLed, the
    machine rebooted): its nodes bill with nobody to stop them."""
    pid = job.get("controller_pid")
    return (bool(pid) and pid != os.getpid() and job.get("controller_host") == HOST
            and not StateStore.controller_alive(job))


def _owner_pid_alive(job: dict) -> bool:
    return bool(job.get("controller_pid")) and job["controller_pid"] != os.getpid() and StateStore.controller_alive(job)


def classify(store: StateStore, provider: str, inst: OwnedInstance) -> tuple[bool, str | None, str]:
    """(owned, job name, why) for one listed instance."""
    job_name = job_of_instance(inst.name)
    if job_name is None:
        return False, None, "name has dtrun's prefix but no job/attempt"
    job = store.get_job(job_name)
    if job is None:
        return False, job_name, f"job {job_name!r} is unknown to this state store"
    if job["state"] not in ACTIVE_STATES:
        return False, job_name, f"job {job_name} ended ({job['state']})"
    first = job.get("session_first_attempt") or 0
    for nd in store.nodes(job_name, live_only=True):
        if nd["provider"] == provider and str(nd["instance_id"]) == str(inst.instance_id):
            if nd["attempt"] < first:
                return False, job_name, f"left over from an earlier run of {job_name} (attempt {nd['attempt']})"
            if _owner_dead(job):
                return False, job_name, (f"live node of {job_name}, whose controller (pid {job['controller_pid']}) "
                                         f"is gone: nothing watches or stops it (`dtrun up` would re-attach)")
            return True, job_name, "live node of an active job"
    if _owner_pid_alive(job):
        # Another live controller may be between "launch returned" and "node recorded" — but only
        # for an attempt still LAUNCHING; an attempt that already ended never will record it.
        n = _attempt_of(inst.name)
        att = store.get_attempt(job_name, n) if n is not None else None
        if att is None or att.get("state") == "LAUNCHING":
            return True, job_name, f"active job run by live controller pid {job['controller_pid']} (may be launching)"
        return False, job_name, (f"attempt {n} of {job_name} ended ({att.get('outcome') or att.get('state')}) "
                                 "without recording this instance")
    return False, job_name, f"job {job_name} is {job['state']} but never recorded this instance"


def is_ours(store: StateStore, provider: str, inst: OwnedInstance) -> tuple[bool, str]:
    """(ours, why not) for an instance with dtrun's prefix (see "Ours and not ours")."""
    if inst.owner is not None:
        if inst.owner == store.owner_id:
            return True, ""
        return False, f"not ours: launched by another dtrun home or server (owner {inst.owner})"
    for nd in store.nodes(job_of_instance(inst.name) or ""):
        if nd["provider"] == provider and str(nd["instance_id"]) == str(inst.instance_id):
            return True, ""
    return False, ("not ours: carries no owner id (launched by dtrun before owners, from this home or "
                   "another) and this state store never recorded it")


def _call(fn: Callable[[], Any], clock: Any, what: str) -> Any:
    """Call ``fn``, retrying Transient with backoff (1, 2, 4, 8 s)."""
    for i in range(TRANSIENT_TRIES):
        try:
            return fn()
        except perr.Transient:
            if i == TRANSIENT_TRIES - 1:
                raise
            clock.sleep(min(8.0, 2.0 ** i))
    raise AssertionError(what)


def terminate_confirmed(provider: Provider, handle: Handle, clock: Any = None,
                        timeout: float = CONFIRM_TIMEOUT_S) -> bool:
    """Terminate and poll until the provider confirms the instance gone (True) or ``timeout``
    passes (False). Transient errors are retried; other provider errors propagate."""
    clock = clock or RealClock()
    start = clock.now()
    delay = 1.0
    while True:
        try:
            provider.terminate(handle)
            return True
        except (perr.TerminateNotConfirmed, perr.Transient):
            pass
        if clock.now() - start >= timeout:
            return False
        clock.sleep(delay)
        delay = min(delay * 2, 15.0)


def find_orphans(store: StateStore, provider_names: Iterable[str | Provider], *,
                 providers: dict[str, Provider] | None = None, clock: Any = None) -> SweepReport:
    clock = clock or RealClock()
    rep = SweepReport()
    seen: set[str] = set()
    for entry in provider_names:
        try:
            name, prov = _resolve(entry, providers)
        except (KeyError, ImportError, AttributeError, perr.ProviderError) as e:
            rep.errors[str(entry)] = f"{type(e).__name__}: {e}"
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            listed = _call(lambda: prov.list_owned(NAME_PREFIX), clock, f"{name}.list_owned")
        except perr.ProviderError as e:
            rep.errors[name] = f"{type(e).__name__}: {e}"
            continue
        for inst in listed:
            owned, job, why = classify(store, name, inst)
            if owned:
                rep.owned += 1
                continue
            ours, whose = is_ours(store, name, inst)
            rep.orphans.append(Orphan(name, inst, job, why) if ours else Orphan(name, inst, job, whose, ours=False))
    return rep


def terminate_orphans(store: StateStore, rep: SweepReport, *, providers: dict[str, Provider] | None = None,
                      clock: Any = None, timeout: float = CONFIRM_TIMEOUT_S,
                      which: Callable[[Orphan], bool] | None = None) -> None:
    """Terminate the report's orphans that are ours (or those ``which`` picks: `dtrun gc <name>` /
    ``--all`` pick others too), confirmed; books and marks rows only for jobs in this store."""
    clock = clock or RealClock()
    for o in rep.orphans:
        if not (which(o) if which is not None else o.ours):
            continue
        _, prov = _resolve(o.provider, providers)
        i = o.instance
        handle = Handle(provider=o.provider, name=i.name, instance_id=i.instance_id, region=i.region,
                        launched_at=i.created_at or 0.0)
        # A recorded node carries provider specifics (local: pid/pgid) the listing lacks.
        if o.job:
            for nd in store.nodes(o.job):
                if nd["provider"] == o.provider and str(nd["instance_id"]) == str(i.instance_id):
                    handle = Handle.from_dict(nd["handle"])
        try:
            ok = terminate_confirmed(prov, handle, clock, timeout)
        except perr.ProviderError as e:
            o.outcome, o.error = "error", f"{type(e).__name__}: {e}"
            continue
        o.outcome = "terminated" if ok else "not_confirmed"
        if ok and o.job and store.get_job(o.job) is not None:
            t = clock.now()
            _book_orphan(store, o, t)
            for nd in store.nodes(o.job, live_only=True):
                if nd["provider"] == o.provider and str(nd["instance_id"]) == str(i.instance_id):
                    store.update_node(nd["id"], terminated_at=t, state="TERMINATED")
            store.add_event(o.job, "orphan", f"terminated orphan {i.name} ({i.instance_id}) on {o.provider}: {o.why}",
                            t=t)


def _attempt_of(name: str) -> int | None:
    tail = name.rpartition("-a")[2].split("-")[0]
    return int(tail) if tail.isdigit() else None


def _book_orphan(store: StateStore, o: Orphan, t: float) -> None:
    """An orphan of a known attempt was billing the job: book it (created → confirmed gone) at
    the attempt's price, so `dtrun cost` and the budget guard count it. A spend row the
    controller already opened just continues from where it was booked — also one it closed (an
    abandoned launch booked up to the end of its run, whose instance outlived it)."""
    n = _attempt_of(o.instance.name)
    att = store.get_attempt(o.job, n) if (o.job and n is not None) else None
    if not att:
        return
    offer = att.get("offer") or {}
    price = offer.get("price_per_hour")
    if price is None:
        try:
            price = float(offer["price_per_gpu_hour"]) * int(offer["gpus_per_node"]) * int(offer.get("nodes", 1))
        except (KeyError, TypeError, ValueError):
            return
    start = o.instance.created_at if o.instance.created_at is not None else t
    store.open_spend(o.job, n, float(price), min(start, t))
    store.book_spend(o.job, n, t, close=True, reopen=True)


def sweep_orphans(store: StateStore, provider_names: Iterable[str | Provider], dry_run: bool = False, *,
                  providers: dict[str, Provider] | None = None, clock: Any = None,
                  timeout: float = CONFIRM_TIMEOUT_S) -> list[OwnedInstance]:
    """Find (and unless ``dry_run`` terminate, confirmed) every instance with dtrun's prefix on
    these providers that is ours and no live job owns; returns them (never another store's). ``provider_names`` may hold names or
    Provider instances; ``providers`` maps names to instances to use instead of the registry
    (the controller passes its own, e.g. an in-memory fake cloud). A provider that cannot be
    listed is skipped (see ``find_orphans`` for the reasons)."""
    rep = find_orphans(store, provider_names, providers=providers, clock=clock)
    if not dry_run and rep.orphans:
        terminate_orphans(store, rep, providers=providers, clock=clock, timeout=timeout)
    return [o.instance for o in rep.orphans if o.ours]


# ---- dtrun gc -------------------------------------------------------------------------------------

def gc_providers(store: StateStore) -> list[str]:
    """Providers worth listing: every one a job in the store used, plus local, plus the fake
    cloud when its file exists."""
    names: list[str] = []
    for job in store.list_jobs():
        try:
            names.extend(json.loads(job.get("providers") or "[]"))
        except json.JSONDecodeError:
            pass
        for nd in store.nodes(job["name"]):
            names.append(nd["provider"])
    names.append("local")
    try:
        from providers.fake import default_path

        if default_path().exists():
            names.append("fake")
    except ImportError:
        pass
    out: list[str] = []
    for n in names:
        if n and n not in out:
            out.append(n)
    return out

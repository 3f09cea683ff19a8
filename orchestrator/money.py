"""Money and leaks: the orphan sweep (``dtrun gc``), spend reports (``dtrun cost``), and the entry
point of ``dtrun simulate`` (the simulation itself lives in ``orchestrator.simulate``).

Orphans
    Every provider instance dtrun creates is named ``dtrun-<job>-a<attempt>`` from creation
    (``providers.base.instance_name``), so an instance billing without an owner can be found by
    its prefix even when dtrun crashed between "created" and "recorded". An instance is **owned**
    (left alone) when

    1. the state store records it as a live node (not confirmed terminated) of a job that is still
       active (PENDING … STOPPING): a restarted controller re-attaches to it; or
    2. its job is active and run by a live controller in *another* process, and its attempt is
       still LAUNCHING (that controller may be between "launch returned" and "node recorded").

    Everything else carrying the prefix is an orphan: instances of finished or unknown jobs,
    unrecorded instances of the caller's own job, nodes the store thinks live for a job that
    already ended. ``sweep_orphans`` terminates them (retrying ``Transient`` and polling
    ``TerminateNotConfirmed`` until the provider confirms) and marks matching node rows
    terminated only then. The controller runs it at every start; ``dtrun gc`` runs it on demand.

    Scope: one state store (``$DTRUN_HOME``) per cloud account. Two dtrun homes sharing one
    account would see each other's instances as orphans — ``dtrun gc`` lists before it
    terminates (without ``--yes`` and without a terminal it only lists).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from orchestrator.errors import EXIT_JOB_FAILED, EXIT_OK, NotFoundError
from orchestrator.state import ACTIVE_STATES, StateStore
from providers import errors as perr
from providers.base import NAME_PREFIX, Handle, OwnedInstance, Provider, job_of_instance

# How long a sweep keeps asking a provider to confirm a terminate before it reports the
# instance as "terminate sent, not confirmed" (the next sweep or `dtrun gc` tries again).
CONFIRM_TIMEOUT_S = 300.0
TRANSIENT_TRIES = 5


class _RealClock:
    def now(self) -> float:
        return time.time()

    def sleep(self, s: float) -> None:
        if s > 0:
            time.sleep(s)


@dataclass
class Orphan:
    provider: str
    instance: OwnedInstance
    job: str | None
    why: str
    outcome: str = "listed"
    """listed | terminated | not_confirmed | error"""
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        i = self.instance
        return {"provider": self.provider, "name": i.name, "instance_id": i.instance_id, "region": i.region,
                "state": getattr(i.state, "value", str(i.state)), "created_at": i.created_at, "job": self.job,
                "why": self.why, "outcome": self.outcome, "error": self.error}


@dataclass
class SweepReport:
    orphans: list[Orphan] = field(default_factory=list)
    owned: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    """provider → why it could not be listed"""

    def to_dict(self) -> dict[str, Any]:
        return {"orphans": [o.to_dict() for o in self.orphans], "owned": self.owned, "errors": self.errors,
                "terminated": sum(o.outcome == "terminated" for o in self.orphans),
                "not_confirmed": sum(o.outcome in ("not_confirmed", "error") for o in self.orphans)}


def _resolve(entry: str | Provider, providers: dict[str, Provider] | None) -> tuple[str, Provider]:
    if isinstance(entry, Provider):
        return entry.name, entry
    if providers and entry in providers:
        return entry, providers[entry]
    from providers import registry

    return entry, registry.get(entry)


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
    clock = clock or _RealClock()
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
    clock = clock or _RealClock()
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
            else:
                rep.orphans.append(Orphan(name, inst, job, why))
    return rep


def terminate_orphans(store: StateStore, rep: SweepReport, *, providers: dict[str, Provider] | None = None,
                      clock: Any = None, timeout: float = CONFIRM_TIMEOUT_S) -> None:
    clock = clock or _RealClock()
    for o in rep.orphans:
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
    controller already opened just continues from where it was booked."""
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
    store.book_spend(o.job, n, t, close=True)


def sweep_orphans(store: StateStore, provider_names: Iterable[str | Provider], dry_run: bool = False, *,
                  providers: dict[str, Provider] | None = None, clock: Any = None,
                  timeout: float = CONFIRM_TIMEOUT_S) -> list[OwnedInstance]:
    """Find (and unless ``dry_run`` terminate, confirmed) every instance with dtrun's prefix on
    these providers that no live job owns; returns them. ``provider_names`` may hold names or
    Provider instances; ``providers`` maps names to instances to use instead of the registry
    (the controller passes its own, e.g. an in-memory fake cloud). A provider that cannot be
    listed is skipped (see ``find_orphans`` for the reasons)."""
    rep = find_orphans(store, provider_names, providers=providers, clock=clock)
    if not dry_run and rep.orphans:
        terminate_orphans(store, rep, providers=providers, clock=clock, timeout=timeout)
    return [o.instance for o in rep.orphans]


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


def _interactive() -> bool:
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def cmd_gc(yes: bool, json_out: bool) -> int:
    """``dtrun gc [--yes] [--json]``: list orphans; terminate them with --yes or after a 'y' at a
    terminal. Without a terminal and without --yes it only lists (never waits for input).
    Exit 0 when nothing is left billing that we know of (or listing only), 1 when a terminate
    was not confirmed or a provider could not be listed."""
    import typer

    store = StateStore()
    names = gc_providers(store)
    rep = find_orphans(store, names)
    act = bool(rep.orphans) and (yes or (not json_out and _interactive() and typer.confirm(
        f"Terminate {len(rep.orphans)} orphan instance(s)?", default=False)))
    if not rep.orphans and not json_out:
        typer.echo(f"no orphan instances on {', '.join(names)} ({rep.owned} owned by live jobs)")
    elif not json_out:
        typer.echo(f"{len(rep.orphans)} orphan instance(s):")
        for o in rep.orphans:
            typer.echo(f"  {o.provider:8} {o.instance.name:32} {o.instance.instance_id:24} {o.why}")
    if act:
        terminate_orphans(store, rep)
        if not json_out:
            for o in rep.orphans:
                typer.echo(f"  {o.instance.name}: {o.outcome}{(' — ' + o.error) if o.error else ''}")
    elif rep.orphans and not json_out:
        typer.echo("listed only; run `dtrun gc --yes` to terminate them")
    for prov, err in rep.errors.items():
        if not json_out:
            typer.echo(f"warning: could not list {prov}: {err}", err=True)
    failed = bool(rep.errors) or any(o.outcome in ("not_confirmed", "error") for o in rep.orphans)
    if json_out:
        d = rep.to_dict()
        d.update(providers=names, terminated_requested=act)
        typer.echo(json.dumps(d, sort_keys=True))
    return EXIT_JOB_FAILED if failed else EXIT_OK


# ---- dtrun cost -----------------------------------------------------------------------------------

def job_cost(store: StateStore, job: dict) -> dict[str, Any]:
    """Spend per attempt (booked by the controller: price actually rented × seconds, provisioning
    included) beside the plan's estimate."""
    est = json.loads(job["estimate_json"]) if job.get("estimate_json") else None
    atts = {a["n"]: a for a in store.attempts(job["name"])}
    rows = []
    for s in store.spend_by_attempt(job["name"]):
        a = atts.get(s["attempt"], {})
        offer = a.get("offer") or {}
        rows.append({
            "attempt": s["attempt"], "provider": a.get("provider"),
            "offer": (f"{offer.get('provider')}/{offer.get('region')}/{offer.get('gpu')}x{offer.get('gpus_per_node')}"
                      + ("/spot" if offer.get("spot") else "")) if offer else None,
            "price_per_hour": s["price_per_hour"], "seconds": round(s["seconds"], 3), "usd": round(s["usd"], 6),
            "billing": not s["closed"], "booked_until": s["billed_until"],
            "outcome": a.get("outcome"), "reason": a.get("reason"),
            "start_step": a.get("start_step"), "end_step": a.get("end_step"),
        })
    total = sum(r["usd"] for r in rows)
    out = {
        "name": job["name"], "state": job["state"], "reason": job.get("reason"),
        "cost_usd": round(total, 6), "budget_usd": job.get("budget_usd"),
        "estimate_usd": round(est["cost_usd"], 6) if est and est.get("cost_usd") is not None else None,
        "expected_usd": round(est["expected_usd"], 6) if est and est.get("expected_usd") is not None else None,
        "estimate_hours": est.get("hours") if est else None,
        "attempts": rows,
        "billing_now": any(r["billing"] for r in rows),
        "steps_lost": job.get("steps_lost") or 0,
    }
    if out["expected_usd"]:
        out["actual_vs_expected"] = round(total / out["expected_usd"], 4)
    return out


def cmd_cost(job: str | None, json_out: bool) -> int:
    import typer

    store = StateStore()
    if job is not None:
        row = store.get_job(job)
        if row is None:
            raise NotFoundError(f"no job named {job!r} in {store.path} (see `dtrun ls`)")
        jobs = [row]
    else:
        jobs = store.list_jobs()
    reports = [job_cost(store, j) for j in jobs]
    if json_out:
        payload: Any = reports[0] if job is not None else {
            "jobs": reports, "total_usd": round(sum(r["cost_usd"] for r in reports), 6)}
        typer.echo(json.dumps(payload, sort_keys=True))
        return EXIT_OK
    if not reports:
        typer.echo("no jobs yet")
        return EXIT_OK
    for r in reports:
        est = f"${r['estimate_usd']:.2f} (expected ${r['expected_usd']:.2f})" if r["estimate_usd"] is not None else "n/a"
        budget = f"${r['budget_usd']:.2f}" if r["budget_usd"] is not None else "none"
        live = "  [still billing]" if r["billing_now"] else ""
        typer.echo(f"{r['name']}: {r['state']}  spent ${r['cost_usd']:.4f}  estimate {est}  budget {budget}{live}")
        for a in r["attempts"]:
            steps = ""
            if a["start_step"] is not None or a["end_step"] is not None:
                steps = f"  steps {a['start_step'] if a['start_step'] is not None else 0}→{a['end_step'] if a['end_step'] is not None else '?'}"
            typer.echo(f"  attempt {a['attempt']:>3}  {a['offer'] or a['provider'] or '?':36} "
                       f"${a['price_per_hour']:.4f}/h × {a['seconds'] / 3600:.3f} h = ${a['usd']:.4f}"
                       f"  {a['outcome'] or ('billing' if a['billing'] else '')}{steps}")
    if job is None and len(reports) > 1:
        typer.echo(f"total: ${sum(r['cost_usd'] for r in reports):.4f}")
    return EXIT_OK


# ---- dtrun simulate -------------------------------------------------------------------------------

def cmd_simulate(job, preemptions_per_hour: float | None, runs: int, seed: int, json_out: bool) -> int:
    from orchestrator.simulate import cmd_simulate as _impl

    return _impl(job, preemptions_per_hour, runs, seed, json_out)

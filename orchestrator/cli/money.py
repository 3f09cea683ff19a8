"""``dtrun gc`` (the orphan sweep, on demand) and ``dtrun cost`` (spend per attempt beside the
estimate). The sweep itself lives in ``orchestrator.run.sweep``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from orchestrator.cli.options import JsonOpt
from orchestrator.contract.errors import EXIT_JOB_FAILED, EXIT_OK, NotFoundError

if TYPE_CHECKING:  # the state store and the sweep load when a command runs, not for --help or the dry run
    from orchestrator.run.state import StateStore


def _interactive() -> bool:
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def cmd_gc(yes: bool, json_out: bool, names: list[str] | None = None, all_: bool = False) -> int:
    """``dtrun gc [NAME…] [--all] [--yes] [--json]``: list orphans — ours (launched by this state
    store) and not ours (another dtrun home's, or an older dtrun's without an owner id); terminate
    ours, plus the not-ours ones named (instance name or id) or all of them with ``--all``, with
    --yes or after a 'y' at a terminal. Without a terminal and without --yes it only lists (never
    waits for input). Exit 0 when nothing is left billing that we know of (or listing only), 1 when
    a terminate was not confirmed, a provider could not be listed, or a NAME matched no orphan."""
    from orchestrator.cli import remote
    from orchestrator.run.state import StateStore
    from orchestrator.run.sweep import gc_providers

    if remote.target():  # the server's sweep, scoped to the caller's team; reported here as embedded
        provs, find, terminate = remote.gc(list(names or []), all_)
        return _gc(None, provs, yes, json_out, list(names or []), all_, find=find, terminate=terminate)
    store = StateStore()
    provs = gc_providers(store)
    try:
        return _gc(store, provs, yes, json_out, list(names or []), all_)
    finally:
        from providers import registry

        registry.close_all()  # stop SkyPilot's API server if listing started it


def _gc(store: StateStore | None, provs: list[str], yes: bool, json_out: bool, names: list[str], all_: bool,
        find: Any = None, terminate: Any = None) -> int:
    """The listing, the confirmation, the terminate and the report. ``find()`` → the sweep report
    and ``terminate(which)`` → the report after terminating what ``which`` picks: this store's
    sweep by default; ``orchestrator.cli.remote.gc`` gives the server's."""
    import typer

    from orchestrator.run.sweep import find_orphans, terminate_orphans

    def _terminate(which: Any) -> Any:
        terminate_orphans(store, rep, which=which)  # type: ignore[arg-type]
        return rep

    rep = find() if find is not None else find_orphans(store, provs)  # type: ignore[arg-type]
    named = set(names)

    def picked(o: Any) -> bool:
        if named:  # only what was asked for by name
            return o.instance.name in named or str(o.instance.instance_id) in named
        return all_ or o.ours

    unmatched = sorted(n for n in named if not any(n in (o.instance.name, str(o.instance.instance_id))
                                                    for o in rep.orphans))
    targets = [o for o in rep.orphans if picked(o)]
    others = sum(not o.ours for o in targets)
    what = f"{len(targets)} orphan instance(s)" + (f", {others} of them NOT launched by this dtrun home" if others else "")
    act = bool(targets) and (yes or (not json_out and _interactive() and typer.confirm(
        f"Terminate {what}?", default=False)))
    if not json_out:
        _print_orphans(rep, provs)
    if act:
        rep = (terminate or _terminate)(picked)
        targets = [o for o in rep.orphans if picked(o)]
        if not json_out:
            for o in targets:
                typer.echo(f"  {o.instance.name}: {o.outcome}{(' — ' + o.error) if o.error else ''}")
    elif targets and not json_out:
        typer.echo("listed only; run `dtrun gc --yes` to terminate ours"
                   + (" (and the ones named)" if named else ""))
    if not json_out and not named and not all_ and any(not o.ours for o in rep.orphans):
        typer.echo("not ours: left alone; `dtrun gc <name>` or `dtrun gc --all` terminates them (asks first; "
                   "--yes without a terminal) — make sure nobody else's run still needs them")
    for n in unmatched:
        if not json_out:
            typer.echo(f"error: no orphan instance named {n!r}", err=True)
    for prov, err in rep.errors.items():
        if not json_out:
            typer.echo(f"warning: could not list {prov}: {err}", err=True)
    failed = (bool(rep.errors) or bool(unmatched)
              or any(o.outcome in ("not_confirmed", "error") for o in rep.orphans))
    if json_out:
        d = rep.to_dict()
        d.update(providers=provs, terminated_requested=act, unmatched=unmatched)
        typer.echo(json.dumps(d, sort_keys=True))
    return EXIT_JOB_FAILED if failed else EXIT_OK


def _print_orphans(rep: Any, provs: list[str]) -> None:
    import typer

    ours = [o for o in rep.orphans if o.ours]
    theirs = [o for o in rep.orphans if not o.ours]
    if not ours:
        typer.echo(f"no orphan instances on {', '.join(provs)} ({rep.owned} owned by live jobs)")
    else:
        typer.echo(f"{len(ours)} orphan instance(s):")
        for o in ours:
            typer.echo(f"  {o.provider:8} {o.instance.name:32} {o.instance.instance_id:24} {o.why}")
    if theirs:
        typer.echo(f"{len(theirs)} instance(s) not ours:")
        for o in theirs:
            typer.echo(f"  {o.provider:8} {o.instance.name:32} {o.instance.instance_id:24} {o.why}")


# ---- dtrun cost -----------------------------------------------------------------------------------

OUTCOME_NOTES = {
    "abandoned": "launch abandoned while provisioning: booked from its request at the offer's price "
                 "(an upper bound: the provider bills an instance only from its creation)",
    "unrecorded": "the controller died while launching: what the launch created is booked by the "
                  "orphan sweep that terminated it",
}
"""What a row's booking means, for outcomes whose booking is not a recorded node's lifetime."""

def job_cost(store: StateStore, job: dict) -> dict[str, Any]:
    """Spend per attempt (booked by the controller: price actually rented × seconds, provisioning
    included) beside the plan's estimate."""
    est = json.loads(job["estimate_json"]) if job.get("estimate_json") else None
    atts = {a["n"]: a for a in store.attempts(job["name"])}
    launched: dict[int, float] = {}   # what the provider says it rented (SkyPilot's launched resources)
    teardown: dict[int, tuple[float, float]] = {}  # first terminate request → last node confirmed gone
    for node in store.nodes(job["name"]):
        p = ((node.get("handle") or {}).get("data") or {}).get("launched_price_per_hour")
        if isinstance(p, (int, float)):
            launched[node["attempt"]] = launched.get(node["attempt"], 0.0) + float(p)
        if node.get("terminate_requested") is not None and node.get("terminated_at") is not None:
            t0, t1 = teardown.get(node["attempt"], (node["terminate_requested"], node["terminated_at"]))
            teardown[node["attempt"]] = (min(t0, node["terminate_requested"]), max(t1, node["terminated_at"]))
    rows = []
    for s in store.spend_by_attempt(job["name"]):
        a = atts.get(s["attempt"], {})
        offer = a.get("offer") or {}
        quoted = None
        if offer.get("price_per_gpu_hour") is not None:
            quoted = {
                "price_per_gpu_hour": offer["price_per_gpu_hour"],
                "price_per_hour": round(offer["price_per_gpu_hour"] * (offer.get("gpus_per_node") or 1)
                                        * (offer.get("nodes") or 1), 6),
                "source": offer.get("price_source"), "fetched_at": offer.get("price_fetched_at"),
                "spot_bid": offer.get("spot_bid"), "price_known": offer.get("price_known", True),
            }
        rows.append({
            "attempt": s["attempt"], "provider": a.get("provider"),
            "offer": (f"{offer.get('provider')}/{offer.get('region')}/{offer.get('gpu')}x{offer.get('gpus_per_node')}"
                      + ("/spot" if offer.get("spot") else "")) if offer else None,
            "price_per_hour": s["price_per_hour"], "seconds": round(s["seconds"], 3), "usd": round(s["usd"], 6),
            "billing": not s["closed"], "booked_until": s["billed_until"],
            "outcome": a.get("outcome"), "reason": a.get("reason"), "note": OUTCOME_NOTES.get(a.get("outcome")),
            "start_step": a.get("start_step"), "end_step": a.get("end_step"),
            "quoted": quoted,
            "launched_price_per_hour": launched.get(s["attempt"]),
            # booked too: dtrun books a node until the provider confirms it gone
            "teardown_s": round(max(0.0, teardown[s["attempt"]][1] - teardown[s["attempt"]][0]), 3)
                          if s["attempt"] in teardown else None,
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

    from orchestrator.run.state import StateStore

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
            q = a.get("quoted")
            if q:
                bid = f", bid ${q['spot_bid']:.2f}/GPU-h" if q.get("spot_bid") else ""
                same = "" if abs(q["price_per_hour"] - a["price_per_hour"]) < 1e-6 else "  (differs from the quote)"
                rented = (f"; the provider launched it at ${a['launched_price_per_hour']:.4f}/h"
                          if a.get("launched_price_per_hour") is not None else "")
                typer.echo(f"               quoted ${q['price_per_gpu_hour']:.2f}/GPU-h = ${q['price_per_hour']:.4f}/h{bid} "
                           f"({q.get('source') or 'no source'}); booked at ${a['price_per_hour']:.4f}/h{same}{rented}")
            if a.get("note"):
                typer.echo(f"               ({a['note']})")
    if job is None and len(reports) > 1:
        typer.echo(f"total: ${sum(r['cost_usd'] for r in reports):.4f}")
    return EXIT_OK

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def gc(
    names: Annotated[Optional[list[str]], typer.Argument(
        help="Terminate only these instances (name or id), also ones not ours.")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Also terminate instances not ours.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Terminate without asking.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Find instances with dtrun's name prefix that no live job owns; terminate ours (and others named or --all)."""
    raise typer.Exit(cmd_gc(yes=yes, json_out=json_out, names=names, all_=all_))


@app.command()
def cost(
    job: Annotated[Optional[str], typer.Argument(help="Job name (default: every job).")] = None,
    json_out: JsonOpt = False,
    team: Annotated[bool, typer.Option("--team", help="The team's month on the server: budget, spent, left.")] = False,
) -> None:
    """Spend per job and per attempt, beside the estimate."""
    from orchestrator.cli import remote

    if remote.target():
        raise typer.Exit(remote.cost(job, team, json_out))
    if team:
        from orchestrator.contract.errors import UsageError

        raise UsageError("--team: needs a dtrun server (DTRUN_SERVER and DTRUN_TOKEN, or `dtrun login URL`)")
    raise typer.Exit(cmd_cost(job, json_out))

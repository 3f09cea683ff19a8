"""``dtrun simulate``: the real controller against the fake cloud on a virtual clock, N times.

Each run builds a fresh world — an in-memory state store, a fake cloud offering the plan's
offers (same price, spot or not, preempting spot nodes at the given rate with a seeded
exponential clock), a run URI in RAM (``/dev/shm`` or ``memory://``) — and drives
``orchestrator.run.controller.Controller`` to a final state. Nothing is rented; no trainer runs.
What the node would do is modelled in ``run/simnode.py`` (:class:`Simulation`), from the same
assumptions as the dry run's estimate. A node whose job exited keeps billing for one *real*
controller poll (``recovery.poll_seconds`` of the job as written): the time a controller ticking
at that rate takes to see the exit and terminate it — not the simulation's coarser tick, which
would over-bill every attempt.

Tick size: the controller ticks every ``recovery.poll_seconds`` of *virtual* time; to keep 200
runs to seconds the simulation raises it to ``max(poll_seconds, 60 s, expected hours × 3600 / 150)``
(≈ 150 ticks per run for a long job). A coarser tick delays detecting a preemption by < one tick — wall
time, not money: the fake cloud bills a preempted node only until it is taken away.

Reported per run: wall time, cost (the fake cloud's bill: instance-seconds × price, provisioning
included), attempts, preemptions, work lost, goodput (useful GPU time ÷ paid GPU time; useful =
total steps × step time), and orphan instance-seconds (anything billing after the job ended).
"""

from __future__ import annotations

import math
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.contract import runuri
from orchestrator.contract.errors import UsageError
from orchestrator.plan import hours
from orchestrator.plan.estimate import make_plan
from orchestrator.plan.spec import JobSpec
from orchestrator.run.simnode import Model, Simulation

SIM_MIN_POLL_SECONDS = 60.0
SIM_TARGET_TICKS = 150.0
SIM_MAX_OFFERS = 4
# Each run's run URI is a fresh temp directory in RAM (/dev/shm) where there is one, else
# fsspec's memory:// (a disk-backed temp directory measured 2.4x slower).
_TMP_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RunResult:
    state: str
    reason: str
    wall_s: float
    cost_usd: float
    booked_usd: float
    attempts: int
    preemptions: int
    lost_steps: int
    soft_preemptions: int
    soft_saved: int
    no_capacity: int
    offers_used: int
    paid_s: float
    useful_s: float
    trained_paid_s: float
    orphan_s: float
    steps: int

    @property
    def goodput(self) -> float:
        return self.useful_s / self.paid_s if self.paid_s > 0 else 0.0


@dataclass
class Setup:
    spec: JobSpec
    sim_spec: JobSpec
    plan: Any
    model: Model
    rate: float
    poll: float
    offer: Any
    young_daly_every: int | None
    user_every: int | str
    offers: list[Any] = field(default_factory=list)
    """The plan's offers the fake cloud sells, in the plan's order (failover as the controller does)."""
    regions: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per fake-cloud region (one per offer): provision_s, notice_s, soft_fraction."""
    no_capacity: float = 0.0
    fields: dict[str, Any] = field(default_factory=dict)


def _region(o: Any) -> str:
    """The fake-cloud region standing for one real offer (a provider sells several GPU variants:
    each is its own offer, so its own region)."""
    return f"{o.provider}/{o.region}/{o.gpu}/{'spot' if o.spot else 'on-demand'}"


def prepare(spec: JobSpec, preemptions_per_hour: float | None = None, every_override: int | None = None,
            plan: Any = None, no_capacity: float = 0.0, notice_seconds: float | None = None,
            soft_fraction: float | None = None) -> Setup:
    """The plan for the real providers, and the fake-cloud spec and node model that mirror it.

    The fake cloud sells the plan's first ``SIM_MAX_OFFERS`` offers (price, spot or not, each
    with its provider's provisioning + setup figures and preemption notice); a launch finds no
    capacity with probability ``no_capacity`` (seeded), and the controller fails over between
    them exactly as it would between real providers."""
    rate_for_plan = preemptions_per_hour
    if plan is None:
        plan = make_plan(spec, preemptions_per_hour=rate_for_plan)
    if plan.chosen is None or plan.estimate is None:
        why = "; ".join(plan.refusals) or "no offer fits"
        raise UsageError(f"{spec.name}: nothing to simulate: {why}")
    offer = plan.chosen
    if preemptions_per_hour and not offer.spot:
        # A rate on an on-demand offer would silently simulate 0 preemptions: refuse, saying why.
        why = ("resources.spot: false" if spec.resources.spot is False
               else (plan.spot_choice or {}).get("why") or "the plan ranked on-demand first")
        raise UsageError(f"{spec.name}: --preemptions-per-hour {preemptions_per_hour:g}: the simulated offer "
                         f"{offer.key()} is on-demand ({why}), and on-demand nodes are not preempted; drop "
                         "the flag, or allow spot (resources.spot: true or prefer) on a provider that sells it")
    # Per attempt: any one of the N nodes lost ends the attempt (the fake cloud's instance stands
    # for the whole cluster, so it is preempted at N × the per-node rate).
    rate = hours.attempt_preemption_rate(spec, offer.nodes, preemptions_per_hour) if offer.spot else 0.0
    gpus = offer.gpus_per_node * offer.nodes
    if spec.command is not None:
        # A command job: the given hours (or 6·N·D) in steps of command.steps, else of a minute;
        # its own saves are inside those hours.
        compute_s = hours.command_compute_hours(spec, offer.gpu, gpus) * 3600.0
        total_steps = spec.command.steps or max(1, math.ceil(compute_s / 60.0))
        step_s = compute_s / total_steps
        every = every_override or max(1, round(spec.command.checkpoint_every_minutes * 60.0 / step_s))
        save_s = 0.0
    else:
        total_steps = spec.trainer.total_steps
        step_s = hours.step_seconds(spec, offer.gpu, gpus)
        every = every_override or plan.checkpoint_every_steps or hours.checkpoint_interval_steps(spec, rate, step_s)
        save_s = hours.checkpoint_save_seconds(spec)
    su = hours.startup(spec, offer)  # the snapshot's figures for the chosen provider
    compile_s = (su["compile_minutes"] + su["first_step_minutes"]) * 60.0
    model = Model(
        total_steps=total_steps, step_s=step_s, every=max(1, int(every)),
        save_s=save_s,
        load_s=hours.checkpoint_bytes(spec) / (hours.CHECKPOINT_BANDWIDTH * offer.nodes),
        compile_s=compile_s, provision_s=(su["provisioning_minutes"] + su["setup_minutes"]) * 60.0,
    )
    yd = None
    if rate > 0:
        cost = max(model.save_s, step_s)
        yd = max(1, min(model.total_steps, round(hours.young_daly_interval_s(cost, 3600.0 / rate) / step_s)))
    est_hours = plan.estimate.hours if math.isfinite(plan.estimate.hours) else 24.0
    poll = max(spec.recovery.poll_seconds, SIM_MIN_POLL_SECONDS, est_hours * 3600.0 / SIM_TARGET_TICKS)
    r = spec.resources.model_copy(update={"providers": ["fake"], "spot": bool(offer.spot), "regions": [],
                                          "max_price_per_gpu_hour": None})
    rec = spec.recovery.model_copy(update={
        "poll_seconds": poll, "heartbeat_timeout_seconds": max(spec.recovery.heartbeat_timeout_seconds, 3 * poll)})
    ck = spec.checkpoint.model_copy(update={"uri": "file:///nonexistent/dtrun-sim", "every_steps": model.every})
    sim_spec = spec.model_copy(update={"resources": r, "recovery": rec, "checkpoint": ck})
    offers = list(plan.offers[:SIM_MAX_OFFERS]) or [offer]
    if offer not in offers:
        offers = [offer] + offers[:-1]
    regions: dict[str, dict[str, float]] = {}
    from providers.catalog import preemption_notice

    for o in offers:
        so = hours.startup(spec, o)
        pn = preemption_notice(o.provider)
        regions[_region(o)] = {
            "provision_s": (so["provisioning_minutes"] + so["setup_minutes"]) * 60.0,
            "notice_s": pn.notice_seconds if notice_seconds is None else notice_seconds,
            "soft_fraction": pn.soft_fraction if soft_fraction is None else soft_fraction,
        }
    if len({bool(o.spot) for o in offers}) > 1:
        sim_spec = sim_spec.model_copy(update={"resources": sim_spec.resources.model_copy(update={"spot": "prefer"})})
    model = Model(**{**model.__dict__, "emergency_s": hours.checkpoint_bytes(spec) / (
        hours.CHECKPOINT_BANDWIDTH * offer.nodes)})
    return Setup(spec=spec, sim_spec=sim_spec, plan=plan, model=model, rate=rate, poll=poll, offer=offer,
                 young_daly_every=yd, user_every=spec.checkpoint.every_steps, offers=offers, regions=regions,
                 no_capacity=no_capacity,
                 fields={"spot_rate": hours.attempt_preemption_rate(spec, offer.nodes, preemptions_per_hour)})


def run_once(setup: Setup, index: int, seed: int, max_ticks: int = 20000) -> RunResult:
    from orchestrator.run.clock import VirtualClock
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import StateStore
    from providers import registry
    from providers.fake import FakeOfferTemplate, FakeProvider

    from providers import errors as perr

    m, offer = setup.model, setup.offer
    clock = VirtualClock()
    regions = setup.regions
    cap_rng = random.Random(f"capacity:{seed}:{index}")
    refused = [0]

    class SimCloud(FakeProvider):
        """The fake cloud selling the plan's offers: each launch provisions for its offer's
        provider figures, and finds no capacity with probability ``setup.no_capacity``."""

        def launch(self, request: Any) -> Any:
            if setup.no_capacity > 0 and cap_rng.random() < setup.no_capacity:
                refused[0] += 1
                raise perr.NoCapacity(f"simulated: no capacity for {request.offer.key()}", provider="fake")
            prov = regions.get(request.offer.region, {}).get("provision_s", m.provision_s)
            self.configure(provision_seconds=prov)
            return super().launch(request)

    cloud = SimCloud(
        clock=clock,
        offers=[FakeOfferTemplate(_region(o), o.gpu, bool(o.spot), o.price_per_gpu_hour) for o in setup.offers],
        provision_seconds=m.provision_s, autodown_seconds=setup.spec.recovery.poll_seconds, terminate_seconds=0.0,
        preemptions_per_hour=setup.fields.get("spot_rate", setup.rate), seed=seed * 1_000_003 + index,
        max_gpus_per_node=max(8, offer.gpus_per_node),
    )
    if _TMP_DIR is not None:
        tmp: str | None = tempfile.mkdtemp(prefix="dtrun-sim-", dir=_TMP_DIR)
        uri = "file://" + tmp
    else:  # no RAM-backed directory: fsspec's in-memory filesystem
        tmp = None
        uri = f"memory://dtrun-sim/{os.getpid()}/{setup.spec.name}/{seed}-{index}"
    ck = setup.sim_spec.checkpoint.model_copy(update={"uri": uri})
    spec = setup.sim_spec.model_copy(update={"checkpoint": ck})
    sim = Simulation(m, cloud, uri, notice={k: (v["notice_s"], v["soft_fraction"]) for k, v in regions.items()},
                     seed=seed * 1_000_003 + index)
    clock.on_advance.append(sim.hook)
    store = StateStore(":memory:")
    registry.register("fake", cloud)
    ticks = [0]

    def on_tick(_c: Any) -> None:
        ticks[0] += 1
        if ticks[0] > max_ticks:
            raise RuntimeError(f"simulation run {index} did not finish in {max_ticks} ticks")

    try:
        ctl = Controller(spec, store, clock=clock, providers={"fake": cloud}, stop_grace_seconds=None)
        t0 = clock.now()
        state = ctl.run(on_tick=on_tick)
        job = store.get_job(spec.name) or {}
        end = job.get("finished_at") or clock.now()
        booked = store.spend_total(spec.name)
        atts = store.attempts(spec.name)
        attempts = len(atts)
        # Offers the controller tried (a launch refused for capacity counts: it moved on).
        tried = {str((a.get("offer") or {}).get("region")) for a in atts}
    finally:
        registry.unregister("fake")
        clock.on_advance.remove(sim.hook)
        store.close()
    # Anything still billing after the job ended is an orphan: look an hour later.
    clock.advance(3600.0)
    bill = cloud.bill()
    paid = 0.0
    orphan = 0.0
    cost = 0.0
    for row in bill["rows"]:
        gone = row["end"] if row["end"] is not None else bill["time"]
        cost += row["price_per_hour"] * max(0.0, min(gone, end) - row["start"]) / 3600.0
        orphan += max(0.0, gone - max(end, row["start"]))
        paid += max(0.0, min(gone, end) - row["start"])
    trained_paid = sum(max(0.0, min((i.gone_at or end), end) - max(i.ready_at, i.created_at))
                       for i in cloud.instances())
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        runuri.remove(uri, recursive=True)
    useful = m.total_steps * m.step_s if state == "SUCCEEDED" else sim.committed * m.step_s
    return RunResult(state=state, reason=str(job.get("reason") or ""), wall_s=end - t0, cost_usd=cost,
                     booked_usd=booked, attempts=attempts, preemptions=sim.preemptions, lost_steps=sim.lost_steps,
                     soft_preemptions=sim.soft, soft_saved=sim.soft_saved, no_capacity=refused[0],
                     offers_used=len(tried | {i.region for i in cloud.instances()}),
                     paid_s=paid, useful_s=useful, trained_paid_s=trained_paid, orphan_s=orphan,
                     steps=m.total_steps if state == "SUCCEEDED" else sim.committed)


def summarize(setup: Setup, results: list[RunResult]) -> dict[str, Any]:
    est = setup.plan.estimate
    costs = [r.cost_usd for r in results]
    walls = [r.wall_s / 3600.0 for r in results]
    budget = setup.spec.budget.max_usd
    states: dict[str, int] = {}
    for r in results:
        states[r.state] = states.get(r.state, 0) + 1
    mean_cost = statistics.fmean(costs) if costs else float("nan")
    failed: dict[str, int] = {}
    for r in results:
        if r.state == "FAILED":
            why = (r.reason.splitlines() or ["no reason recorded"])[0]
            failed[why] = failed.get(why, 0) + 1
    return {
        "runs": len(results),
        "states": states,
        "succeeded_runs": states.get("SUCCEEDED", 0),
        "wall_hours_mean": statistics.fmean(walls) if walls else None,
        "wall_hours_p50": _pct(walls, 0.5),
        "wall_hours_p95": _pct(walls, 0.95),
        "cost_usd_mean": mean_cost,
        "cost_usd_p50": _pct(costs, 0.5),
        "cost_usd_p95": _pct(costs, 0.95),
        "cost_usd_max": max(costs) if costs else None,
        "booked_usd_mean": statistics.fmean(r.booked_usd for r in results) if results else None,
        "attempts_mean": statistics.fmean(r.attempts for r in results) if results else None,
        "attempts_max": max(r.attempts for r in results) if results else None,
        "preemptions_mean": statistics.fmean(r.preemptions for r in results) if results else None,
        "soft_preemptions_mean": statistics.fmean(r.soft_preemptions for r in results) if results else None,
        "soft_preemptions_saved_mean": statistics.fmean(r.soft_saved for r in results) if results else None,
        "no_capacity_mean": statistics.fmean(r.no_capacity for r in results) if results else None,
        "failed_runs": sum(1 for r in results if r.state == "FAILED"),
        "runs_with_failover": sum(1 for r in results if r.offers_used > 1),
        "failed_reasons": sorted(failed)[:5],
        "failed_reason_runs": {k: failed[k] for k in sorted(failed)[:5]},
        "offers_sold": [o.key() for o in setup.offers],
        "no_capacity_rate": setup.no_capacity,
        "preemption_notice": {k: {"notice_seconds": v["notice_s"], "soft_fraction": v["soft_fraction"]}
                              for k, v in setup.regions.items()},
        "work_lost_steps_mean": statistics.fmean(r.lost_steps for r in results) if results else None,
        "work_lost_hours_mean": (statistics.fmean(r.lost_steps for r in results) * setup.model.step_s / 3600.0
                                 if results else None),
        "goodput_mean": statistics.fmean(r.goodput for r in results) if results else None,
        "goodput_p5": _pct([r.goodput for r in results], 0.05),
        "training_goodput_mean": statistics.fmean(
            (r.useful_s / r.trained_paid_s if r.trained_paid_s > 0 else 0.0) for r in results) if results else None,
        "budget_usd": budget,
        "budget_exceeded_runs": sum(1 for r in results if r.state == "OVER_BUDGET"
                                    or (budget is not None and r.cost_usd > budget)),
        "orphan_instance_seconds": sum(r.orphan_s for r in results),
        "expected_usd": est.expected_usd,
        "estimate_usd": est.cost_usd,
        "estimate_basis": est.breakdown.get("buffer_basis"),
        "estimate_hours": est.hours,
        "expected_vs_simulated_mean": est.expected_usd / mean_cost if mean_cost else None,
        "estimate_covers_p95": est.cost_usd >= _pct(costs, 0.95),
        "offer": setup.offer.key(),
        "spot": bool(setup.offer.spot),
        "spot_choice": setup.plan.spot_choice,
        "price_per_hour": setup.offer.price_per_hour,
        "preemptions_per_hour": setup.rate,
        "nodes": setup.offer.nodes,
        "preemptions_per_node_hour": setup.rate / max(1, setup.offer.nodes),
        "checkpoint_every_steps": setup.model.every,
        "checkpoint_every_user": setup.user_every,
        "young_daly_every_steps": setup.young_daly_every,
        "step_seconds": setup.model.step_s,
        "steps": setup.model.total_steps,
        "startup_seconds": setup.model.provision_s + setup.model.compile_s,
        "startup": hours.startup(setup.spec, setup.offer),
        "checkpoint_load_seconds": setup.model.load_s,
        "poll_seconds": setup.poll,
    }


def simulate(spec: JobSpec, preemptions_per_hour: float | None = None, runs: int = 200, seed: int = 0,
             every_override: int | None = None, plan: Any = None, **opts: Any) -> dict[str, Any]:
    """Run the controller ``runs`` times on the fake cloud; the summary dict (see ``--json``).
    ``opts``: ``no_capacity``, ``notice_seconds``, ``soft_fraction`` (see :func:`prepare`)."""
    if runs <= 0:
        raise UsageError("--runs must be a positive number of runs")
    if preemptions_per_hour is not None and preemptions_per_hour < 0:
        raise UsageError("--preemptions-per-hour must be ≥ 0")
    nc = opts.get("no_capacity") or 0.0
    if not 0.0 <= nc < 1.0:
        raise UsageError("--no-capacity must be a probability in [0, 1)")
    sf = opts.get("soft_fraction")
    if sf is not None and not 0.0 <= sf <= 1.0:
        raise UsageError("--soft-fraction must be within [0, 1]")
    if (opts.get("notice_seconds") or 0.0) < 0:
        raise UsageError("--notice-seconds must be ≥ 0")
    t = time.perf_counter()
    setup = prepare(spec, preemptions_per_hour, every_override, plan, **opts)
    results = [run_once(setup, i, seed) for i in range(runs)]
    out = summarize(setup, results)
    out["elapsed_s"] = time.perf_counter() - t
    return out


def compare_young_daly(spec: JobSpec, base: dict[str, Any], preemptions_per_hour: float | None, runs: int,
                       seed: int, **opts: Any) -> dict[str, Any] | None:
    """The same runs (same seeds) with the Young/Daly interval, when the user set another one."""
    yd = base.get("young_daly_every_steps")
    if not yd or yd == base["checkpoint_every_steps"]:
        return None
    other = simulate(spec, preemptions_per_hour, runs, seed, every_override=int(yd), **opts)
    return {k: other[k] for k in ("checkpoint_every_steps", "cost_usd_mean", "cost_usd_p95", "goodput_mean",
                                  "wall_hours_mean", "work_lost_steps_mean")}


def simulate_job(spec: JobSpec, preemptions_per_hour: float | None, runs: int, seed: int, **opts: Any
                 ) -> tuple[JobSpec, dict[str, Any]]:
    """``dtrun simulate``'s question for a spec: the runs, the Young/Daly comparison, and a note when
    the question changed the spec (``spot: prefer`` with a preemption rate simulates spot)."""
    note = None
    if spec.trainer is not None and spec.trainer.parallel == "auto":
        # What the nodes would run (auto's layout, micro-batch and checkpointing: recompute is
        # priced), as `dtrun up` does; the smallest plan even when none fits (the dry run refuses that).
        from orchestrator.contract.errors import SpecError
        from orchestrator.plan.planner import resolve_parallel

        try:
            spec = resolve_parallel(spec, force=True)
        except SpecError:
            pass
    prefer = spec.resources.spot == "prefer"
    if preemptions_per_hour is not None and prefer:
        # The user asks what spot at this rate would do: simulate the spot side of "prefer"
        # (the plan alone may rank on-demand first, where a preemption rate means nothing).
        spot_spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"spot": True})})
        spot_plan = make_plan(spot_spec, preemptions_per_hour=preemptions_per_hour)
        if spot_plan.chosen is not None:
            spec = spot_spec
            note = "resources.spot: prefer with --preemptions-per-hour: simulating the cheapest spot offer"
        elif preemptions_per_hour > 0:
            why = "; ".join(spot_plan.refusals) or "no spot offer"
            raise UsageError(f"{spec.name}: --preemptions-per-hour {preemptions_per_hour:g}: resources.spot: prefer "
                             f"finds no spot offer to simulate ({why}); on-demand nodes are not preempted: drop "
                             "the flag, or add a provider that sells spot")
    out = simulate(spec, preemptions_per_hour, runs, seed, **opts)
    out["young_daly"] = compare_young_daly(spec, out, preemptions_per_hour, runs, seed, **opts)
    if prefer and note is None:
        note = prefer_note(out)
    if note:
        out["note"] = note
    return spec, out


def prefer_note(out: dict[str, Any]) -> str:
    """What ``spot: prefer`` chose for the simulation and why (the plan's spot-or-on-demand verdict)."""
    sc = out.get("spot_choice") or {}
    side = "spot" if out.get("spot") else "on-demand"
    line = f"resources.spot: prefer: simulating {side} {out['offer']}"
    if sc.get("why"):
        line += f": {sc['why']}"
    if not out.get("spot"):
        line += " (on-demand is not preempted: 0 preemptions/h; --preemptions-per-hour R simulates the spot side)"
    return line

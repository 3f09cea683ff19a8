"""The estimate and the plan: which offers fit, what each would cost, which one dtrun picks.

Money arithmetic (shared DESIGN.md "Money")::

    cost     = price per GPU-hour × GPUs × hours × (1 + buffer)
    hours    = budget.hours, or compute + start-up (+ preemption overhead on spot)
               (compute and start-up: ``plan/hours.py``)
    spot     = N = λ·W / (1 − λ·ℓ) expected preemptions for λ per hour and W hours of work, each
               costing a restart (provision, set up, compile, load) plus half a checkpoint
               interval of lost work; ℓ = interval/2 + load + compile is a restarted node's
               exposure. The buffered estimate is at least the cost at one more than the
               95th-percentile (Poisson) count of preemptions.

Offers come from every provider the spec names; :func:`make_plan` ranks them by expected cost
(unknown spot prices last) and picks the first the user can rent.

Pure Python: no torch, no sky, no boto3 (the dry run must stay well under a second).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrator.contract.gpus import GPUS
from orchestrator.plan.hours import (
    CHECKPOINT_BANDWIDTH, attempt_preemption_rate, checkpoint_bytes, flops_device, poisson_quantile, startup,
    step_seconds, workload,
)
from orchestrator.plan.spec import JobSpec
from providers.base import Offer, Requirements

# Importable from here for callers that name this module (orchestrator/run/controller.py and
# orchestrator/cli/export.py: node_image; tests/orchestrator/test_quote_truth.py: step_floor_seconds).
# New code imports them from plan/hours.py.
from orchestrator.plan.hours import node_image, step_floor_seconds  # noqa: F401


@dataclass
class Estimate:
    """The estimate for one offer."""

    hours: float
    """Expected paid wall hours (start-up and preemption overhead included)."""
    expected_usd: float
    """Expected cost before the buffer."""
    cost_usd: float
    """The estimate with the buffer: what the budget is checked against."""
    buffer: float
    budget_usd: float | None
    within_budget: bool
    breakdown: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Plan:
    """Ranked offers (cheapest expected cost first), the chosen one and its estimate."""

    offers: list[Offer]
    estimates: list[Estimate]
    chosen: Offer | None
    estimate: Estimate | None
    refusals: list[str]
    step_seconds: float
    checkpoint_every_steps: int
    unusable: dict[str, str] = field(default_factory=dict)
    """Providers that cannot be used from here (no credentials SkyPilot or the SDK would read):
    name → the message naming what to set. Their offers are in ``locked``, never in ``offers``."""
    locked: list[Offer] = field(default_factory=list)
    """Offers of the ``unusable`` providers, ranked like ``offers``: priced and shown ("needs
    credentials"), never rented (the controller fails over across ``offers`` only)."""
    locked_estimates: list[Estimate] = field(default_factory=list)
    spot_choice: dict[str, Any] | None = None
    """For ``spot: prefer``: the best spot and the best on-demand offer with their expected cost
    and preemption overhead, and which won (:func:`spot_choice`)."""

    @property
    def within_budget(self) -> bool:
        return self.estimate is not None and self.estimate.within_budget

    @property
    def would_choose(self) -> Offer | None:
        """With no usable offer: the one dtrun would rent once its provider's credentials are set."""
        return self.locked[0] if self.chosen is None and self.locked else None

    @property
    def shown(self) -> tuple[Offer | None, Estimate | None]:
        """The offer the estimate is shown for: the chosen one, else the one it would choose."""
        if self.chosen is not None:
            return self.chosen, self.estimate
        if self.locked:
            return self.locked[0], self.locked_estimates[0]
        return None, None

    def ranked(self) -> list[tuple[Offer, Estimate, bool]]:
        """Every priced offer as (offer, estimate, usable): usable ones first, then the ones
        that need credentials, each group cheapest first."""
        return ([(o, e, True) for o, e in zip(self.offers, self.estimates)]
                + [(o, e, False) for o, e in zip(self.locked, self.locked_estimates)])

    def to_dict(self) -> dict[str, Any]:
        def offer_row(o: Offer, e: Estimate) -> dict[str, Any]:
            d = o.to_dict()
            d.update(hours=round(e.hours, 4), expected_usd=round(e.expected_usd, 4),
                     cost_usd=round(e.cost_usd, 4))
            return d

        def ranked_row(o: Offer, e: Estimate, usable: bool) -> dict[str, Any]:
            d = offer_row(o, e)
            d["usable"] = usable
            d["fix"] = None if usable else self.unusable.get(o.provider)
            return d

        shown, est = self.shown
        would = self.would_choose
        return {
            "offers": [ranked_row(o, e, u) for o, e, u in self.ranked()],
            "usable": self.chosen is not None,
            "chosen": ranked_row(self.chosen, est, True) if self.chosen and est else None,
            "would_choose": (dict(offer_row(would, est), fix=self.unusable.get(would.provider))
                             if would is not None and est else None),
            "hours": round(est.hours, 4) if est else None,
            "expected_usd": round(est.expected_usd, 4) if est else None,
            "cost_usd": round(est.cost_usd, 4) if est else None,
            "buffer": est.buffer if est else None,
            "budget_usd": est.budget_usd if est else None,
            "within_budget": est is not None and est.within_budget,
            "breakdown": est.breakdown if est else None,
            "refusals": self.refusals,
            "unusable": self.unusable,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "spot_choice": self.spot_choice,
        }


def requirements(spec: JobSpec) -> Requirements:
    r = spec.resources
    return Requirements(
        gpu=r.gpu, gpus_per_node=r.gpus_per_node, nodes=r.nodes, spot=r.spot,
        regions=tuple(r.regions), max_price_per_gpu_hour=r.max_price_per_gpu_hour,
    )


def estimate_offer(spec: JobSpec, offer: Offer, rate_override: float | None = None) -> tuple[Estimate, int]:
    b = spec.budget
    gpus = offer.gpus_per_node * offer.nodes
    rate = attempt_preemption_rate(spec, offer.nodes, rate_override) if offer.spot else 0.0
    w = workload(spec, offer, rate)
    step_s, every, steps, compute_h, ckpt_h = w["step_s"], w["every"], w["steps"], w["compute_h"], w["ckpt_h"]
    su = startup(spec, offer)
    startup_h = su["total_minutes"] / 60.0
    load_h = checkpoint_bytes(spec) / (CHECKPOINT_BANDWIDTH * offer.nodes) / 3600.0
    base_h = b.hours if b.hours is not None else compute_h + ckpt_h + startup_h

    # Preemptions (λ per hour, spot only). Work W must be done; each preemption costs a restart
    # (provision, set up, compile, load) plus, on average, half a checkpoint interval τ of lost
    # work. While a restarted node loads and compiles (ℓ = τ/2 + load + compile of exposure per
    # attempt) it can be preempted again, so the expected count is N = λ·W / (1 − λ·ℓ).
    # Checked against `dtrun simulate` (the real controller on the fake cloud): within a few
    # percent for 0.5–4 preemptions per hour.
    work_h = base_h - startup_h if b.hours is None else max(base_h - startup_h, 0.0)
    tau_h = w["tau_h"]
    compile_h = (su["compile_minutes"] + su["first_step_minutes"]) / 60.0  # after the node is up
    restart_h = startup_h + load_h
    # A soft preemption (the provider's notice, prices.yaml `preemption:`) whose emergency
    # checkpoint fits in the notice loses no work: only the hard share loses half an interval.
    from providers.catalog import preemption_notice

    pn = preemption_notice(offer.provider)
    emergency_s = checkpoint_bytes(spec) / (CHECKPOINT_BANDWIDTH * offer.nodes)  # a sync save
    saved = pn.soft_fraction if 0 < emergency_s <= pn.notice_seconds else 0.0
    lost_h = tau_h / 2.0 * (1.0 - saved)
    exposure_h = lost_h + load_h + compile_h
    preempt_h = 0.0
    expected_preemptions = 0.0
    n95 = 0
    if rate > 0:
        if rate * exposure_h >= 0.95:
            hours = math.inf  # preemptions come faster than the run makes progress between them
            expected_preemptions = math.inf
        else:
            expected_preemptions = rate * work_h / (1.0 - rate * exposure_h)
            preempt_h = expected_preemptions * (restart_h + lost_h)
            hours = base_h + preempt_h
            n95 = poisson_quantile(expected_preemptions, 0.95)
    else:
        hours = base_h

    price_h = offer.price_per_gpu_hour * gpus
    expected = price_h * hours
    cost = expected * (1.0 + b.buffer)
    buffer_basis = f"{b.buffer:.0%} buffer"
    if rate > 0 and not math.isinf(hours):
        # The buffer must cover the bad cases, not decorate: at least the cost of one preemption
        # more than the 95th-percentile (Poisson) count. The extra one covers what the count
        # misses: a preemption's lost work is up to a whole interval, not half (checked against
        # `dtrun simulate`'s p95 at 0.5–4 preemptions per hour).
        p95_hours = base_h + (n95 + 1) * (restart_h + tau_h / 2.0)
        if price_h * p95_hours > cost:
            cost = price_h * p95_hours
            buffer_basis = (f"p95-preemptions floor ({n95 + 1} preemptions; larger than the "
                            f"{b.buffer:.0%} buffer)")
    # The deadline: an estimate longer than budget.max_hours is refused unless the deadline is
    # meant to cut the run (budget.cut_at_deadline); then it is priced up to the deadline.
    deadline = None
    if b.max_hours is not None and hours > b.max_hours:
        productive_h = hours - startup_h
        frac = min(1.0, max(0.0, (b.max_hours - startup_h) / productive_h)) if productive_h > 0 else 0.0
        done = int(steps * frac)
        deadline = {"max_hours": b.max_hours, "estimate_hours": hours, "fraction_trained": frac,
                    "steps_by_deadline": done, "tokens_by_deadline": done * w["tokens_per_step"],
                    "cut": b.cut_at_deadline}
        if b.cut_at_deadline:
            hours = b.max_hours
            expected = cost = price_h * hours
            buffer_basis = f"capped by budget.max_hours ({b.max_hours:g} h): the run stops there"
    within = (b.max_usd is None or cost <= b.max_usd) and (deadline is None or b.cut_at_deadline)
    breakdown = {
        "gpus": gpus,
        "price_per_gpu_hour": offer.price_per_gpu_hour,
        "price_per_hour": round(price_h, 4),
        "hours_source": w["hours_source"],
        "params": w["params"],
        "active_params": w["active_params"],
        "tokens": w["tokens"],
        "steps": steps,
        "peak_flops_per_gpu": GPUS[flops_device(spec, offer.gpu)].peak_bf16_flops,
        "mfu": b.mfu,
        "step_seconds": step_s,
        "compute_hours": compute_h,
        "startup_hours": startup_h,
        "startup": su,
        "checkpoint_hours": ckpt_h,
        "checkpoint_every_steps": every,
        "preemptions_per_hour": rate,
        "preemptions_per_node_hour": rate / max(1, offer.nodes),
        "nodes": offer.nodes,
        "expected_preemptions": expected_preemptions,
        "preemption_overhead_hours": preempt_h,
        "preemptions_p95": n95,
        "preemption_notice_seconds": pn.notice_seconds,
        "preemption_work_saved_fraction": saved,
        "buffer_basis": buffer_basis,
        "step_floor_seconds": w["step_floor_seconds"],
        "flops_step_seconds": w["flops_step_seconds"],
        "pipeline": w.get("pipeline"),
        "deadline": deadline,
    }
    return Estimate(hours=hours, expected_usd=expected, cost_usd=cost, buffer=b.buffer,
                    budget_usd=b.max_usd, within_budget=within, breakdown=breakdown), every


def gather_offers(spec: JobSpec, usable_only: bool = False,
                  unusable: dict[str, str] | None = None, get: Any = None,
                  locked: list[Offer] | None = None) -> tuple[list[Offer], list[str]]:
    """Offers from every provider named in the spec, and why others were refused.

    ``usable_only``: a provider whose ``check_credentials`` fails (offline: no network) is
    recorded in ``unusable`` with its message (what to set) and its offers go to ``locked``
    (priced and shown, never rented), so the plan picks the cheapest offer the user can
    actually rent."""
    if get is None:
        from providers import registry

        get = registry.get
    from providers import errors as perr

    req = requirements(spec)
    offers: list[Offer] = []
    refusals: list[str] = []
    for name in spec.resources.providers:
        provider = get(name)
        reason = provider.refuse(req)
        if reason:
            refusals.append(reason)
            continue
        found = provider.offers(req)
        if not found:
            spot = {True: "spot ", False: "on-demand ", "prefer": ""}[req.spot]
            refusals.append(f"{name} has no {spot}{req.gpu}×{req.gpus_per_node} offer"
                            + (f" in {', '.join(req.regions)}" if req.regions else "")
                            + (f" under ${req.max_price_per_gpu_hour}/GPU-h" if req.max_price_per_gpu_hour else ""))
            continue
        if usable_only:
            try:
                provider.check_credentials()
            except perr.AuthError as e:
                if unusable is not None:
                    unusable[name] = str(e)
                if locked is not None:
                    locked.extend(found)
                else:
                    refusals.append(str(e))
                continue
        offers.extend(found)
    return offers, refusals


def make_plan(spec: JobSpec, preemptions_per_hour: float | None = None,
              offers: list[Offer] | None = None, usable_only: bool = False, get: Any = None) -> Plan:
    """Rank every fitting offer by expected cost (cheapest first) and pick the first.
    ``usable_only``: only providers whose credentials are in place (``dtrun up`` and its dry
    run); the others are refused with what to set (``Plan.unusable``)."""
    refusals: list[str] = []
    unusable: dict[str, str] = {}
    locked: list[Offer] = []
    if offers is None:
        offers, refusals = gather_offers(spec, usable_only=usable_only, unusable=unusable, get=get, locked=locked)

    def rank(offers: list[Offer]) -> list[tuple]:
        scored = []
        for o in offers:
            est, every = estimate_offer(spec, o, preemptions_per_hour)
            # An offer whose price is unknown (spot without a spot figure, priced at on-demand as
            # an upper bound) ranks after every offer whose price is known.
            scored.append((not o.price_known, est.expected_usd, o.price_per_gpu_hour, o.key(), o, est, every))
        return [s[1:] for s in sorted(scored, key=lambda s: s[:4])]

    scored, scored_locked = rank(offers), rank(locked)
    ranked = [s[3] for s in scored]
    ests = [s[4] for s in scored]
    chosen = ranked[0] if ranked else None
    est = ests[0] if ests else None
    first = scored[0] if scored else scored_locked[0] if scored_locked else None
    every = first[5] if first else (spec.checkpoint.every_steps if spec.checkpoint.every_steps != "auto" else 0)
    step_s = first[4].breakdown["step_seconds"] if first else (0.0 if spec.is_command else step_seconds(spec))
    choice = None
    if spec.resources.spot == "prefer":
        pool = [(s[3], s[4]) for s in scored] or [(s[3], s[4]) for s in scored_locked]
        choice = spot_choice(pool)
    return Plan(offers=ranked, estimates=ests, chosen=chosen, estimate=est, refusals=refusals,
                step_seconds=step_s, checkpoint_every_steps=int(every), unusable=unusable,
                locked=[s[3] for s in scored_locked], locked_estimates=[s[4] for s in scored_locked],
                spot_choice=choice)


def spot_choice(ranked: list[tuple[Offer, Estimate]]) -> dict[str, Any]:
    """Why spot, why not: the best (first-ranked) spot offer with a known price and the best
    on-demand offer, each with its expected cost and the preemption overhead it carries, and
    which one the ranking put first."""

    def side(o: Offer | None, e: Estimate | None) -> dict[str, Any] | None:
        if o is None or e is None:
            return None
        b = e.breakdown
        return {"offer": o.key(), "price_per_gpu_hour": o.price_per_gpu_hour, "spot_bid": o.spot_bid,
                "expected_usd": round(e.expected_usd, 4), "hours": round(e.hours, 4),
                "expected_preemptions": b.get("expected_preemptions"),
                "preemption_overhead_hours": round(b.get("preemption_overhead_hours") or 0.0, 4),
                "preemptions_per_hour": b.get("preemptions_per_hour"), "price_source": o.price_source}

    spot = next(((o, e) for o, e in ranked if o.spot and o.price_known), (None, None))
    unknown = [o.key() for o, _e in ranked if o.spot and not o.price_known]
    od = next(((o, e) for o, e in ranked if not o.spot), (None, None))
    s, d = side(*spot), side(*od)
    if s and d:
        won = "spot" if s["expected_usd"] < d["expected_usd"] else "on-demand"
        diff = abs(s["expected_usd"] - d["expected_usd"])
        why = (f"{won} is cheaper in expected cost by ${diff:,.2f} (spot ${s['expected_usd']:,.2f} with "
               f"{s['preemption_overhead_hours']:.2f} h of preemption overhead vs on-demand ${d['expected_usd']:,.2f})")
    elif d:
        won = "on-demand"
        why = ("no spot offer has a known spot price" + (f" ({', '.join(unknown)}: spot price unknown)" if unknown else "")
               + ": on-demand, priced for real, wins")
    elif s:
        won, why = "spot", "no on-demand offer: spot"
    else:
        won, why = None, "no offer"
    return {"spot": s, "on_demand": d, "won": won, "why": why, "spot_unknown": unknown}

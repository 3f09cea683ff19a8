"""The billing guard: what the controller checks every tick before it lets money flow.

Spend is booked per attempt in the state store (``spend`` table) from the price actually rented
× nodes × GPUs × elapsed time, from the launch request (provisioning is paid) until the provider
confirms the node gone. The guard projects one tick ahead and reserves the graceful-stop window:

* budget   — spent + burn × (poll + stop grace) ≥ ``budget.max_usd`` → STOP → OVER_BUDGET. While
             stopping, if even one more tick would cross it, terminate at once (no checkpoint).
* deadline — now + poll + stop grace ≥ start + ``budget.max_hours`` → STOP → OVER_BUDGET.
* idle     — no new training step for ``teardown.idle_minutes`` while running → STOP → FAILED.
* launch   — a new attempt is not launched if its first tick (+ the stop window) would cross.

Pure arithmetic over numbers the controller passes in: no I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.plan.spec import JobSpec
from providers.base import Offer


def attempt_price_per_hour(spec: JobSpec, offer: Offer) -> float:
    """USD per hour of one attempt: price per GPU-hour × GPUs per node × nodes."""
    return offer.price_per_gpu_hour * offer.gpus_per_node * spec.resources.nodes


@dataclass(frozen=True)
class Verdict:
    stop: bool
    target: str = ""       # final state when the stop completes
    reason: str = ""
    hard: bool = False     # terminate now, no graceful checkpoint


OK = Verdict(False)


class Guard:
    def __init__(self, spec: JobSpec, poll_seconds: float, stop_grace_seconds: float) -> None:
        self.spec = spec
        self.poll = poll_seconds
        self.grace = stop_grace_seconds

    # ---- while nodes run -------------------------------------------------------------------
    def check(self, *, now: float, spent: float, burn_per_hour: float, deadline: float | None,
              last_progress_at: float | None, running: bool) -> Verdict:
        b = self.spec.budget
        window = self.poll + self.grace
        if b.max_usd is not None and burn_per_hour > 0:
            if spent + burn_per_hour * window / 3600.0 >= b.max_usd:
                return Verdict(True, "OVER_BUDGET",
                               f"budget: ${spent:.2f} spent at ${burn_per_hour:.2f}/h would cross "
                               f"budget.max_usd ${b.max_usd:.2f} within the next tick and a graceful stop")
        if b.max_usd is not None and spent >= b.max_usd:
            return Verdict(True, "OVER_BUDGET", f"budget: ${spent:.2f} spent ≥ budget.max_usd ${b.max_usd:.2f}",
                           hard=True)
        if deadline is not None and now + window >= deadline:
            return Verdict(True, "OVER_BUDGET", f"deadline: budget.max_hours ({b.max_hours:g} h) reached")
        idle_s = self.spec.teardown.idle_minutes * 60.0
        if running and last_progress_at is not None and now - last_progress_at >= idle_s:
            return Verdict(True, "FAILED", f"idle: no training progress for "
                                           f"{(now - last_progress_at) / 60:.1f} min (teardown.idle_minutes)")
        return OK

    # ---- while stopping ----------------------------------------------------------------------
    def must_terminate_now(self, *, now: float, spent: float, burn_per_hour: float,
                           deadline: float | None) -> str | None:
        """While a graceful stop runs: the reason to skip the checkpoint and terminate, or None."""
        b = self.spec.budget
        if b.max_usd is not None and burn_per_hour > 0 and spent + burn_per_hour * self.poll / 3600.0 >= b.max_usd:
            return "the next tick would cross budget.max_usd"
        if deadline is not None and now + self.poll >= deadline:
            return "the next tick would pass the deadline"
        return None

    # ---- before a launch ---------------------------------------------------------------------
    def may_launch(self, *, now: float, spent: float, price_per_hour: float,
                   deadline: float | None) -> Verdict:
        b = self.spec.budget
        window = self.poll + self.grace
        if b.max_usd is not None and spent + price_per_hour * window / 3600.0 >= b.max_usd:
            return Verdict(True, "OVER_BUDGET",
                           f"budget: ${spent:.2f} spent; another attempt at ${price_per_hour:.2f}/h "
                           f"would cross budget.max_usd ${b.max_usd:.2f}")
        if deadline is not None and now + window >= deadline:
            return Verdict(True, "OVER_BUDGET", f"deadline: budget.max_hours ({b.max_hours:g} h) reached")
        return OK

"""Recovery strategies: which offer the next attempt uses, and how long to wait first.

Modelled on SkyPilot's ``recovery_strategy.py``: a named class with the event sequences it
produces written down.

:class:`FailoverStrategy` (the default)::

    offer 1 running → preempted            → relaunch on offer 1 (after backoff)
    offer 1 → NoCapacity / QuotaExceeded    → offer 2 at once (next in the plan's ranking)
    offer 2 → NoCapacity … last offer too  → back to offer 1 after backoff (a new round)
    offer 1 → Transient launch error        → offer 1 again after backoff
    trainer crash (FAILED)                  → offer 1 again after backoff (counts as a restart)
    offer 1 → AuthError (or no S3 credentials for its remote nodes)
                                            → every offer of that provider dropped, the next
                                              offer at once; none left → the job FAILs

Backoff: ``recovery.backoff_seconds`` × 2^(consecutive failures − 1), capped at 5 minutes; an
attempt that makes training progress resets the count.

What bounds a job (like SkyPilot's managed jobs, which recover from preemptions without limit and
count only user-code failures):

* ``recovery.max_attempts`` counts failed launches (no capacity, API errors, refusals) and
  crashes (trainer failures, lost nodes) — :func:`counted_attempts`. A preemption (or a planned
  restart) is not a failure and uses up nothing; neither is an attempt whose *controller* died
  while its launch was in flight (``unrecorded``: a controller crash is not the job's failure, and
  what that launch created is found by its name, terminated and booked by the orphan sweep of the
  next start). A controller that keeps dying is bounded by whoever restarts it (``dtrun up``);
  nothing restarts it automatically;
* preemptions are bounded by money and time (the guard: ``budget.max_usd``, ``budget.max_hours``)
  and by a rate limit: more than ``recovery.max_preemptions_per_hour`` preemptions within the
  last hour stops the job with a reason that says so (:func:`preemption_storm`).

:class:`Recovery` holds one job's recovery state — the strategy, when the next launch may start,
since when no node has run — and applies the limits: ``max_attempts`` and the storm before a
launch (:meth:`Recovery.launch_refusal`), ``max_recovery_minutes`` while no node runs
(:meth:`Recovery.overdue`), ``max_restarts_on_errors`` after a trainer failure
(:meth:`Recovery.restart_refusal`). Like SkyPilot's ``StrategyExecutor`` it owns the counting of
launches and restarts; unlike it, it never launches: ``orchestrator.run.launching`` does.
"""

from __future__ import annotations

from typing import Any

from orchestrator.run.outcome import NOT_COUNTED, Outcome
from providers.base import Offer

MAX_BACKOFF_SECONDS = 300.0
STORM_WINDOW_SECONDS = 3600.0


def counted_attempts(attempts: list[dict]) -> int:
    """Attempts that count toward ``recovery.max_attempts``: every ended attempt whose outcome is
    not a preemption nor a controller crash mid-launch (failed launches, crashes, lost nodes,
    refusals)."""
    return sum(1 for a in attempts if a.get("outcome") and a["outcome"] not in NOT_COUNTED)


def preemption_storm(attempts: list[dict], now: float, limit: float | None,
                     window_s: float = STORM_WINDOW_SECONDS) -> str | None:
    """Why the job must stop for a preemption storm (more than ``limit`` preemptions ended within
    ``window_s`` before ``now``), else None. ``limit`` None: no rate limit."""
    if limit is None:
        return None
    recent = [a for a in attempts if a.get("outcome") == Outcome.PREEMPTED
              and a.get("ended_at") is not None and a["ended_at"] >= now - window_s]
    if len(recent) > limit:
        return (f"preemption storm: {len(recent)} preemptions within the last {window_s / 60:.0f} min "
                f"(recovery.max_preemptions_per_hour = {limit:g}); stopped rather than keep paying for "
                "start-ups that never reach a checkpoint — retry later, raise the limit, or use on-demand")
    return None


class FailoverStrategy:
    def __init__(self, offers: list[Offer], backoff_seconds: float, start_index: int = 0) -> None:
        if not offers:
            raise ValueError("no offers to launch on")
        self.offers = list(offers)
        self.index = start_index % len(self.offers)
        self.base = backoff_seconds
        self.failures = 0          # consecutive attempts that ended without progress
        self._blocked: set[int] = set()

    @property
    def current(self) -> Offer:
        return self.offers[self.index]

    def backoff(self) -> float:
        if self.failures <= 0:
            return 0.0
        return min(MAX_BACKOFF_SECONDS, self.base * 2 ** (self.failures - 1))

    def launched(self) -> None:
        self._blocked.clear()

    def progressed(self) -> None:
        self.failures = 0

    def ended(self) -> float:
        """The attempt ended (preempted, lost, crashed): same offer; returns the delay."""
        self.failures += 1
        return self.backoff()

    def transient(self) -> float:
        self.failures += 1
        return self.backoff()

    def drop_provider(self, provider: str) -> bool:
        """Forget every offer of ``provider`` (it refused: credentials); the current offer moves to
        the next remaining one in the ranking. False (nothing changed) when no other offer is left."""
        keep = [o for o in self.offers if o.provider != provider]
        if not keep:
            return False
        before = sum(1 for o in self.offers[:self.index] if o.provider != provider)
        self.offers = keep
        self.index = before % len(keep)
        self._blocked.clear()
        return True

    def no_capacity(self) -> float:
        """The current offer refused: move to the next; delay only once every offer refused."""
        self._blocked.add(self.index)
        self.index = (self.index + 1) % len(self.offers)
        if len(self._blocked) >= len(self.offers):
            self._blocked.clear()
            self.failures += 1
            return self.backoff() or self.base
        return 0.0


class Recovery:
    """One job's recovery limits and backoff (``spec.recovery``: max_attempts, backoff_seconds,
    max_preemptions_per_hour, max_recovery_minutes, max_restarts_on_errors)."""

    def __init__(self, recovery: Any) -> None:
        self.limits = recovery
        self.strategy: FailoverStrategy | None = None
        self.next_launch_at = 0.0
        """The next launch may start then (the backoff after a failure)."""
        self.started: float | None = None
        """Since when no node has run (a launch, or a relaunch, in progress): bounded by
        ``recovery.max_recovery_minutes``; None while an attempt makes progress."""

    def make_strategy(self, offers: list[Offer], prefer: dict | None = None) -> None:
        """The failover strategy over the plan's ``offers``, starting at ``prefer`` (an offer's
        dict: the attempt a restarted controller re-attaches to) when it is among them."""
        if not offers:
            return
        idx = 0
        if prefer:
            want = Offer.from_dict(prefer).key()
            idx = next((i for i, o in enumerate(offers) if o.key() == want), 0)
        self.strategy = FailoverStrategy(list(offers), self.limits.backoff_seconds, idx)

    def begin(self, now: float) -> None:
        """A launch (or relaunch) is under way: the recovery clock runs from now unless it already does."""
        if self.started is None:
            self.started = now

    def progressed(self) -> None:
        """The attempt trained past its start: failures in a row reset, the recovery clock stops."""
        if self.strategy:
            self.strategy.progressed()
        self.started = None

    def ended(self, now: float, planned: bool = False) -> float:
        """An attempt ended (preempted, lost, crashed): the next launch waits for the backoff (none
        for a planned restart). Returns the delay."""
        if planned:
            delay = 0.0
        else:
            delay = self.strategy.ended() if self.strategy else self.limits.backoff_seconds
        self.next_launch_at = now + delay
        self.begin(now)
        return delay

    def retry_in(self, now: float, delay: float) -> None:
        """A launch failed (no capacity, an API error): the next one waits ``delay`` seconds."""
        self.next_launch_at = now + delay
        self.begin(now)

    def launch_refusal(self, session: list[dict], now: float) -> str | None:
        """Why no further attempt may be launched (``max_attempts`` used up by failures, or a
        preemption storm), else None."""
        used = counted_attempts(session)
        if used >= self.limits.max_attempts:
            return (f"gave up after {used} failed launches or crashes, preemptions not counted "
                    f"(recovery.max_attempts = {self.limits.max_attempts})")
        return preemption_storm(session, now, self.limits.max_preemptions_per_hour)

    def overdue(self, now: float) -> str | None:
        """Why recovery has taken too long (no node running for ``max_recovery_minutes``), else None."""
        lim = self.limits.max_recovery_minutes
        if self.started is not None and now - self.started > lim * 60:
            return (f"no node running for {(now - self.started) / 60:.1f} min "
                    f"(recovery.max_recovery_minutes = {lim:g})")
        return None

    def restart_refusal(self, used: int) -> str | None:
        """After the ``used``-th trainer failure: why no restart is left, else None."""
        limit = self.limits.max_restarts_on_errors
        if used > limit:
            return f"{used} failures, recovery.max_restarts_on_errors = {limit}"
        return None

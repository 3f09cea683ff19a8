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
"""

from __future__ import annotations

from providers.base import Offer

MAX_BACKOFF_SECONDS = 300.0


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

"""The ledger: what one job has spent and is spending, booked in the state store.

Spend is booked per attempt (``spend`` rows) from the price actually rented × nodes × GPUs ×
elapsed time, from the launch request (provisioning is paid) until the provider confirms the
node gone. A launch still in flight bills from its request before any row exists (its instance
may already exist); a launch the loop abandoned is booked from its request to when it settled
(:meth:`Ledger.book_abandoned`). The billing guard (``orchestrator.run.guard``) reads
:meth:`Ledger.spent` and :meth:`Ledger.burn_per_hour`.
"""

from __future__ import annotations

from orchestrator.run.context import JobContext, describe_error
from orchestrator.run.launchthread import Launches


class Ledger:
    def __init__(self, ctx: JobContext, launches: Launches) -> None:
        self.ctx = ctx
        self.launches = launches

    def book(self, now: float) -> None:
        """Book every open spend row (and settled abandoned launches) up to ``now``."""
        self.book_abandoned()
        for row in self.ctx.store.open_spend_rows(self.ctx.name):
            self.ctx.store.book_spend(self.ctx.name, row["attempt"], now)

    def burn_per_hour(self) -> float:
        """USD/h billing now: open spend rows, plus a launch in flight or abandoned and still at
        work (billed from its request)."""
        burn = sum(r["price_per_hour"] for r in self.ctx.store.open_spend_rows(self.ctx.name))
        for inf in self.launches.unbooked():
            if inf is self.launches.inflight or inf.pending():
                burn += inf.price_per_hour
        return burn

    def spent(self, now: float | None = None) -> float:
        """USD booked, plus what a launch still in flight (or abandoned, not booked yet) has cost
        since its request (its instance may already exist and bill; its spend row opens only once
        it is recorded or settled)."""
        total = self.ctx.store.spend_total(self.ctx.name)
        t = self.ctx.now() if now is None else now
        for inf in self.launches.unbooked():
            end = inf.ended_at if inf.ended_at is not None and inf is not self.launches.inflight else t
            total += inf.price_per_hour * max(0.0, min(end, t) - inf.t0) / 3600.0
        return total

    def book_abandoned(self, final: bool = False) -> None:
        """Book each abandoned launch that created nothing the controller recorded: from its
        request to when it settled (it raised, or what it returned late was terminated), at the
        offer's price — the providers bill an instance from its creation (PROVIDERS.md: RunPod,
        Vast and Modal per second, Lambda per minute), and dtrun cannot tell whether, or when, a
        launch it stopped waiting for created one, so it books the whole launch: an upper bound,
        like the guard's view of a launch in flight. ``final`` (the run ends) books one still in
        the provider's SDK up to now; should it settle later (the teardown's ``close_providers``
        waits for a late terminate), the booking is extended to then. What it created and nobody
        terminated is found, terminated and booked by the orphan sweep."""
        store, name = self.ctx.store, self.ctx.name
        for inf in self.launches.abandoned:
            if inf.adopted:
                continue
            settled = inf.settled.is_set()
            if inf.booked:
                if settled and inf.ended_at is not None and inf.ended_at > (inf.booked_until or 0.0):
                    store.book_spend(name, inf.n, inf.ended_at, close=True, reopen=True)
                    inf.booked_until = inf.ended_at
                continue
            if not settled and not final:
                continue
            until = inf.ended_at if settled and inf.ended_at is not None else self.ctx.now()
            until = max(until, inf.t0)
            if any(r["attempt"] == inf.n and r["closed"] for r in store.spend_by_attempt(name)):
                # The orphan sweep found what the launch created and booked it (created → gone).
                inf.booked, inf.booked_until = True, until
                continue
            store.open_spend(name, inf.n, inf.price_per_hour, inf.t0)
            usd = store.book_spend(name, inf.n, until, close=True)
            inf.booked, inf.booked_until = True, until
            if not settled:
                what = "its launch has still not returned: booked up to the end of the run"
            elif inf.terminated:
                what = "what it returned late was terminated (confirmed)"
            elif inf.handle is not None:
                what = f"the late terminate was not confirmed ({inf.cleanup_error}); the orphan sweep takes over"
            else:
                what = "its launch raised" + (f" ({describe_error(inf.error)})" if inf.error else "")
            self.ctx.event("spend", f"attempt {inf.n}: abandoned launch booked from its request: "
                                    f"{until - inf.t0:.0f} s × ${inf.price_per_hour:.4f}/h = ${usd:.4f} "
                                    f"(provisioning, an upper bound: the provider bills an instance from its "
                                    f"creation, and dtrun cannot tell whether the launch created one); {what}",
                           {"attempt": inf.n, "seconds": until - inf.t0, "usd": usd})

"""Teardown: stopping a job and ending every node it rented, confirmed.

The public API (what the controller's loop and ``dtrun down`` use):

* :meth:`Teardown.terminate_nodes` — terminate every live node of the job (a launch in flight is
  cancelled first); True once all are confirmed gone. A node is recorded terminated only when
  ``provider.terminate`` returns; ``TerminateNotConfirmed`` and ``Transient`` are retried on the
  next call. :meth:`Teardown.terminate_all` repeats it until done, then closes the providers.
* :meth:`Teardown.cancel_in_flight` / :meth:`Teardown.adopt` — a launch in flight is cancelled:
  what it created so far (found by its deterministic name through ``provider.list_owned``) is
  recorded as the attempt's nodes and terminated like any node; one that does not return within
  the stop grace is abandoned (its worker terminates what it returns later, off the loop).
* :meth:`Teardown.close_providers` — the loop is over: each provider releases what this process
  started (SkyPilot's API server), once no call is left inside a provider's SDK.
* the graceful stop: :meth:`begin_stop` (STOP in the run URI, or ``hard``: terminate at once),
  :meth:`stopping` (each tick while STOPPING: wait for the nodes to exit, at most the stop grace,
  or less when the guard says the next tick would cross the budget or deadline), :meth:`finish`
  (the final state, once every node is confirmed gone), :meth:`cancel` (``dtrun down``).
* the orphan sweep (``orchestrator.run.sweep``) at start, after a launch that may have created
  an instance, and at the end.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from orchestrator.contract import runuri
from orchestrator.run.context import JobContext, describe_error
from orchestrator.run.guard import Guard
from orchestrator.run.launchthread import LaunchInFlight, Launches
from orchestrator.run.ledger import Ledger
from orchestrator.run.observe import Observer
from orchestrator.run.outcome import FINAL, Outcome
from orchestrator.run.state import TERMINAL_STATES
from providers import errors as perr
from providers.base import Handle, NodeState

ABANDON_CLOSE_WAIT_S = 60.0
"""How long the end of a run waits (real seconds) for an abandoned launch's late terminate."""


class Teardown:
    def __init__(self, ctx: JobContext, launches: Launches, ledger: Ledger, observer: Observer, guard: Guard,
                 stop_grace: float) -> None:
        self.ctx = ctx
        self.launches = launches
        self.ledger = ledger
        self.observer = observer
        self.guard = guard
        self.stop_grace = stop_grace

    # ---- ending nodes ----------------------------------------------------------------------------
    def terminate_nodes(self) -> bool:
        """Terminate every live node of the job; True once all are confirmed gone (a launch still
        in flight is cancelled first: see :meth:`cancel_in_flight`)."""
        ctx, store = self.ctx, self.ctx.store
        all_gone = self.cancel_in_flight() and not self.launches.late_terminates_pending()
        for nd in store.nodes(ctx.name, live_only=True):
            now = ctx.now()
            if nd["terminate_requested"] is None:
                store.update_node(nd["id"], terminate_requested=now)
            try:
                ctx.provider(nd["provider"]).terminate(Handle.from_dict(nd["handle"]))
            except perr.ProviderError as e:
                # TerminateNotConfirmed, Transient, or anything else: never record it gone
                # before the provider says so; try again next tick.
                ctx.event("terminate", f"{nd['name']}: not confirmed gone yet ({type(e).__name__}: {e}); retrying")
                all_gone = False
                continue
            t = ctx.now()
            store.update_node(nd["id"], terminated_at=t, state=NodeState.TERMINATED.value)
            if not [x for x in store.nodes(ctx.name, live_only=True) if x["attempt"] == nd["attempt"]]:
                store.book_spend(ctx.name, nd["attempt"], t, close=True)
            ctx.event("terminate", f"{nd['name']} ({nd['instance_id']}) terminated (confirmed)")
        return all_gone

    def terminate_all(self, sleep: Callable[[float], None] = time.sleep, every: float = 1.0) -> None:
        """Terminate every node the job still has (``dtrun down`` of a finished job whose node is
        recorded alive), retrying every ``every`` seconds until each is confirmed gone; then close
        the providers (SkyPilot: stop the API server if terminating started it)."""
        try:
            while not self.terminate_nodes():
                sleep(every)
        finally:
            self.close_providers()

    def cancel_in_flight(self) -> bool:
        """Cancel the launch in flight, if any; True once nothing of it is left to wait for.

        Whatever it has created so far (found by its deterministic name through
        ``provider.list_owned``) is recorded as the attempt's nodes, billed from the launch
        request, and terminated by the ordinary path (confirmed). A launch that returns is
        recorded the same way. One that has not returned ``stop_grace`` seconds after the cancel
        is abandoned: its worker terminates what it returns later, and the orphan sweep runs."""
        ctx = self.ctx
        inf = self.launches.inflight
        if inf is None:
            return True
        now = ctx.now()
        prov = ctx.provider(inf.offer.provider)
        if inf.cancelled_at is None:
            inf.cancelled_at = now
            ctx.event("cancel", f"attempt {inf.n}: launch in flight on {inf.offer.key()} cancelled; "
                                f"terminating what it created ({inf.request.instance_name})")
            try:
                prov.cancel_launch(inf.request.instance_name)  # create nothing more (Modal: after the build)
            except perr.ProviderError as e:
                ctx.event("warning", f"attempt {inf.n}: could not cancel the launch in flight "
                                     f"({type(e).__name__}: {e}); terminating what it creates")
        if inf.done.is_set():
            self.launches.inflight = None
            if inf.handle is not None and inf.handle.instance_id not in inf.adopted:
                self.adopt(inf, inf.handle)
            else:
                ctx.end_attempt(inf.n, Outcome.CANCELLED, "cancelled while launching"
                                + (f" ({describe_error(inf.error)})" if inf.error else ""))
            return True
        try:
            owned = [o for o in prov.list_owned(inf.request.instance_name) if inf.matches(o)]
        except perr.ProviderError as e:
            ctx.event("warning", f"attempt {inf.n}: could not list what the launch created "
                                 f"({type(e).__name__}: {e}); retrying")
            owned = []
        for o in owned:
            if o.instance_id not in inf.adopted:
                self.adopt(inf, Handle(provider=inf.offer.provider, name=o.name, instance_id=o.instance_id,
                                       region=o.region, launched_at=inf.t0))
        if now - inf.cancelled_at >= self.stop_grace:
            self.launches.inflight = None
            self.launches.abandoned.append(inf)
            inf.abandon(now)  # a late terminate runs on the launch's worker or a cleanup thread
            self.launches.sweep_due = True
            ctx.event("warning", f"attempt {inf.n}: the cancelled launch has not returned after "
                                 f"{now - inf.cancelled_at:.0f} s; no longer waiting (what it returns is "
                                 f"terminated off the loop; the orphan sweep runs)")
            if not inf.adopted:
                ctx.end_attempt(inf.n, Outcome.ABANDONED, "cancelled while launching; the launch was abandoned "
                                "(its provisioning is booked from the request: an upper bound)")
            return True
        return False

    def adopt(self, inf: LaunchInFlight, handle: Handle) -> None:
        """Record an instance of the launch in flight as its attempt's node (billed from the
        launch request) so the ordinary terminate path ends it and books its spend."""
        ctx = self.ctx
        inf.adopted.add(handle.instance_id)
        ctx.store.add_node(ctx.name, inf.n, handle.to_dict(), ctx.now())
        ctx.store.open_spend(ctx.name, inf.n, inf.price_per_hour, inf.t0)
        ctx.store.update_attempt(ctx.name, inf.n, state="PENDING", launched_at=inf.t0)
        ctx.event("launch", f"attempt {inf.n}: {handle.name} ({handle.instance_id}) found while cancelling "
                            f"its launch", {"attempt": inf.n, "instance_id": handle.instance_id,
                                           "provider": inf.offer.provider})

    # ---- orphans and providers -------------------------------------------------------------------
    def sweep_orphans(self) -> None:
        """The orphan sweep (instances with dtrun's prefix that no live job owns)."""
        from orchestrator.run.sweep import sweep_orphans

        ctx = self.ctx
        try:
            names = list(ctx.spec.resources.providers)
            swept = sweep_orphans(ctx.store, names, dry_run=False,
                                  providers={n: ctx.provider(n) for n in names}, clock=ctx.clock)
        except (perr.ProviderError, OSError) as e:
            ctx.event("warning", f"orphan sweep failed: {e}")
            return
        for inst in swept or []:
            ctx.event("orphan", f"terminated orphan instance {inst.name} ({inst.instance_id})")

    def sweep_if_due(self) -> None:
        if self.launches.sweep_due:
            self.launches.sweep_due = False
            self.sweep_orphans()

    def close_providers(self) -> None:
        """The loop is over: each provider releases what it started in this process (SkyPilot
        stops the local API server dtrun started). First it waits for the late terminate of an
        abandoned launch that has returned (bounded by its retries), and books it. A launch still
        in flight keeps the providers open, and so does one that was cancelled and abandoned but
        has not returned yet."""
        ctx, abandoned = self.ctx, self.launches.abandoned
        for inf in abandoned:
            if inf.done.is_set():
                inf.settled.wait(ABANDON_CLOSE_WAIT_S)
        if abandoned:
            try:
                # books one still in the SDK up to now (the process is about to end: INTERRUPTED,
                # given up), or extends a booking made at the end of the run to its late terminate
                self.ledger.book_abandoned(final=True)
            except Exception as e:  # noqa: BLE001 - the state store itself may be failing
                ctx.safe_event("warning", f"could not book an abandoned launch: {describe_error(e)}")
        # What an abandoned launch returned and nobody terminated: the late terminate gave up, or
        # is still being retried after the wait above.
        loose = [i for i in abandoned if i.handle is not None and not i.terminated
                 and i.handle.instance_id not in i.adopted]
        if any(i.settled.is_set() for i in loose) and ctx.state in TERMINAL_STATES:
            try:  # the job is over: its leftovers are orphans now; the sweep terminates and books them
                self.sweep_orphans()
            except Exception as e:  # noqa: BLE001 - the state store itself may be failing
                ctx.safe_event("warning", f"orphan sweep failed: {describe_error(e)}; run `dtrun gc`")
        for inf in loose:
            if not inf.settled.is_set():
                ctx.safe_event("warning", f"{inf.handle.name}: its terminate is still being retried as the "
                               "controller exits; it may still be billing: run `dtrun gc`")
        if self.launches.in_sdk():
            return  # a call still inside a provider's SDK keeps its provider (e.g. SkyPilot's API server) up
        for p in list(ctx.providers.values()):
            try:
                p.close()
            except Exception as e:  # noqa: BLE001 - closing must not hide the run's outcome
                ctx.safe_event("warning", f"{getattr(p, 'name', p)}: close failed: {describe_error(e)}")

    # ---- the money guard -------------------------------------------------------------------------
    def apply_guard(self, now: float, running: bool) -> bool:
        """Apply the billing guard while nodes bill; True if it started a stop."""
        job = self.ctx.job()
        v = self.guard.check(now=now, spent=self.ledger.spent(now), burn_per_hour=self.ledger.burn_per_hour(),
                             deadline=job["deadline"], last_progress_at=self.observer.last_progress_at,
                             running=running)
        if v.stop:
            self.ctx.event("guard", v.reason)
            self.begin_stop(v.target, v.reason, hard=v.hard)
            return True
        return False

    def deadline_while_recovering(self, now: float) -> bool:
        """No node runs: end the job (OVER_BUDGET) if the deadline leaves no room for another tick
        and a graceful stop. True if it did."""
        job = self.ctx.job()
        if job["deadline"] is not None and now + self.guard.poll + self.stop_grace >= job["deadline"]:
            self.finish("OVER_BUDGET", f"deadline: budget.max_hours ({self.ctx.spec.budget.max_hours:g} h) reached")
            return True
        return False

    # ---- stopping --------------------------------------------------------------------------------
    def cancel(self, now_: bool) -> None:
        """``dtrun down`` (``now_``: ``--now``, no final checkpoint)."""
        ctx = self.ctx
        if ctx.state == "STOPPING":
            if now_:
                ctx.store.update_job(ctx.name, stop_now=1)
                ctx.event("cancel", "down --now: terminating without waiting for the checkpoint")
            return
        ctx.event("cancel", "down requested" + (" (--now)" if now_ else ""))
        self.begin_stop("CANCELLED", "cancelled by `dtrun down`" + (" --now" if now_ else ""), hard=now_)

    def give_up(self, reason: str) -> None:
        """A recovery limit is reached: stop, FAILED."""
        self.ctx.event("give_up", reason)
        self.begin_stop("FAILED", reason, write_stop=False)

    def fail_now(self, n: int, reason: str, tail: str) -> None:
        """Attempt ``n`` failed for good: FAILED with the nodes' last log lines, no relaunch."""
        self.ctx.end_attempt(n, Outcome.FAILED, reason)
        tail = tail.strip("\n")
        full = reason + (f"; last trainer log lines:\n{tail}" if tail.strip()
                         else "; the node left no trainer log lines (nothing was read from its log)")
        self.begin_stop("FAILED", full, write_stop=False)

    def begin_stop(self, target: str, reason: str, hard: bool = False, write_stop: bool = True) -> None:
        ctx = self.ctx
        now = ctx.now()
        live = ctx.store.nodes(ctx.name, live_only=True)
        ctx.transition("STOPPING", reason, stop_target=target, stop_reason=reason, stop_started=now,
                       stop_now=int(hard))
        if write_stop and not hard and live:
            try:
                runuri.write_text(runuri.join(ctx.run_uri, runuri.STOP), f"{reason}\n")
            except OSError as e:
                ctx.event("warning", f"could not write STOP ({e}); terminating without a checkpoint")
                ctx.store.update_job(ctx.name, stop_now=1)

    def stopping(self, now: float) -> None:
        """A tick while STOPPING: wait for the nodes to exit after STOP (at most the stop grace),
        then terminate them and finish."""
        ctx = self.ctx
        job = ctx.job()
        live = ctx.store.nodes(ctx.name, live_only=True)
        if live and not job["stop_now"]:
            states = self.observer.poll_nodes(live)
            exited = states is not None and all(s.is_terminal for s in states.values())
            waited = now - (job["stop_started"] or now)
            why = self.guard.must_terminate_now(now=now, spent=self.ledger.spent(now),
                                                burn_per_hour=self.ledger.burn_per_hour(), deadline=job["deadline"])
            if not exited and waited < self.stop_grace and why is None:
                return
            if why:
                ctx.event("guard", f"terminating now: {why}")
            elif not exited:
                ctx.event("stop", f"no exit within {self.stop_grace:.0f} s of STOP: terminating")
        if not self.terminate_nodes():
            return
        target, reason = job["stop_target"] or "CANCELLED", job["stop_reason"]
        if target != "SUCCEEDED" and self.observer.done() is not None:
            target, reason = "SUCCEEDED", f"training finished (DONE) while stopping for: {reason}"
        self.finish(target, reason)

    def finish(self, target: str, reason: str | None) -> None:
        """End the job in ``target`` once every node is confirmed gone (else keep STOPPING)."""
        ctx = self.ctx
        if not self.terminate_nodes():
            ctx.transition("STOPPING", reason, stop_target=target, stop_reason=reason,
                           stop_started=ctx.now(), stop_now=1)
            return
        self.sweep_if_due()
        self.ledger.book_abandoned(final=True)
        now = ctx.now()
        att = ctx.current_attempt()
        if att and att["state"] != "ENDED":
            ctx.end_attempt(att["n"], FINAL.get(target, Outcome.FAILED), reason or target)
        self.ledger.book(now)
        if target == "SUCCEEDED":
            done = self.observer.done() or {}
            cols: dict[str, Any] = {}
            if isinstance(done.get("step"), int):
                cols["step"] = done["step"]
            if done.get("loss") is not None:
                cols["loss"] = done["loss"]
            if cols:
                ctx.store.update_job(ctx.name, **cols)
        ctx.transition(target, reason)
        s = ctx.summary()
        ctx.event("summary", f"{target}: wall {s['wall_s']:.0f} s, cost ${s['cost_usd']:.4f}, "
                             f"{s['attempts']} attempt(s), {s['steps_lost']} steps lost to preemptions", s)

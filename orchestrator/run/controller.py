"""The controller: one job's state machine, driven tick by tick — the front door over its parts.

States::

    PENDING ─► PROVISIONING ─► RUNNING ─► STOPPING ─► SUCCEEDED | FAILED | CANCELLED | OVER_BUDGET
                   ▲   │           │          ▲
                   │   ▼           ▼          │
                   └─ RECOVERING ◄─┘──────────┘  (preempted / lost / crashed → new attempt)

Every tick: book spend (the ledger), renew ``lease.json`` in the run URI, read a pending ``dtrun
down`` request from the state store, poll the provider, read ``progress.json`` and ``DONE``, then
decide. Every transition is committed to the state store *before* the controller acts on it
(launch, terminate), so a controller killed at any point can be restarted (``dtrun up`` of the
same job) and re-attaches to the nodes it finds recorded there.

The parts, one concern each (they share one ``context.JobContext``):

* ``startup``      — the checks before a job starts (shared with ``dtrun up``);
* ``launching``    — the next attempt's checks, request and result (``launchthread``: the
  launch runs in a worker thread; the loop keeps ticking meanwhile);
* ``ledger``       — spend booked, burn rate, abandoned launches;
* ``observe``      — polls and run-URI reads → the typed view of an attempt;
* ``outcome``      — how an attempt ended, from that view (pure);
* ``watching``     — a live attempt each tick: observe, judge, act;
* ``teardown``     — terminate (confirmed), cancel a launch in flight, adopt, stop, finish;
* ``recovery``     — the failover strategy, recovery limits and backoff;
* ``loop``         — ticking until a final state, surviving bad ticks.

``Controller(spec, store, clock=..., providers=...)``: ``.run() -> final state``, ``.tick()``.
``providers`` maps a provider name to an instance (default: ``providers.registry.get``).
"""

from __future__ import annotations

import os
from typing import Any, Callable

from orchestrator.contract import runuri
from orchestrator.plan.spec import JobSpec, spec_to_yaml
from orchestrator.run import loop
from orchestrator.run.clock import Clock, RealClock
from orchestrator.run.context import JobContext, describe_error, resolved_spec
from orchestrator.run.guard import Guard
from orchestrator.run.launching import LAUNCH_WAIT_CAP_SECONDS, EndJob, Launcher
from orchestrator.run.launchthread import LaunchInFlight, Launches
from orchestrator.run.ledger import Ledger
from orchestrator.run.observe import Observer
from orchestrator.run.outcome import Outcome
from orchestrator.run.recovery import Recovery
from orchestrator.run.startup import ControllerBusy, check_start
from orchestrator.run.state import HOST, TERMINAL_STATES, StateStore
from orchestrator.run.teardown import Teardown
from orchestrator.run.watching import Watching
from providers.base import Provider


def _total_steps(spec: JobSpec) -> int | None:
    return spec.command.steps if spec.command is not None else spec.trainer.total_steps


class Controller:
    def __init__(self, spec: JobSpec, store: StateStore, clock: Clock | None = None,
                 providers: dict[str, Provider] | None = None, *, plan: Any = None,
                 spec_path: str | None = None, on_event: Callable[[str, str], None] | None = None,
                 stop_grace_seconds: float | None = None, write_lease: bool = True,
                 launch_wait_seconds: float | None = None) -> None:
        self.ctx = JobContext(resolved_spec(spec), store, clock or RealClock(), providers, on_event)
        self.store = store
        self.clock: Clock = self.ctx.clock
        self.plan = plan
        self.spec_path = spec_path
        self.on_event = on_event
        self.name = spec.name
        self.run_uri = self.ctx.run_uri
        r = self.spec.recovery
        self.poll = r.poll_seconds
        self.stop_grace = stop_grace_seconds if stop_grace_seconds is not None else max(60.0, 4 * self.poll)
        self.guard = Guard(self.spec, self.poll, self.stop_grace)
        self.write_lease = write_lease
        self.started = False
        self.pid = os.getpid()
        self.launch_wait = (launch_wait_seconds if launch_wait_seconds is not None
                            else min(self.poll, LAUNCH_WAIT_CAP_SECONDS))
        # the parts
        self.launches = Launches()
        self.recovery = Recovery(r)
        self.observer = Observer(self.ctx)
        self.ledger = Ledger(self.ctx, self.launches)
        self.teardown = Teardown(self.ctx, self.launches, self.ledger, self.observer, self.guard, self.stop_grace)
        self.launcher = Launcher(self.ctx, self.launches, self.recovery, self.guard, self.observer, self.launch_wait)
        self.watching = Watching(self.ctx, self.observer, self.recovery, self.teardown)

    # ---- what the parts share, seen from the front door -------------------------------------------
    @property
    def spec(self) -> JobSpec:
        return self.ctx.spec

    @spec.setter
    def spec(self, value: JobSpec) -> None:
        self.ctx.spec = value

    @property
    def inflight(self) -> LaunchInFlight | None:
        """The launch in flight (its worker thread inside ``provider.launch``), if any."""
        return self.launches.inflight

    @property
    def progress(self) -> dict | None:
        """The newest ``progress.json`` read."""
        return self.observer.progress

    def provider(self, name: str) -> Provider:
        return self.ctx.provider(name)

    def now(self) -> float:
        return self.ctx.now()

    def job(self) -> dict:
        return self.ctx.job()

    @property
    def state(self) -> str:
        return self.ctx.state

    def event(self, type_: str, message: str, data: dict | None = None) -> None:
        self.ctx.event(type_, message, data)

    def transition(self, state: str, reason: str | None = None, **cols: Any) -> None:
        self.ctx.transition(state, reason, **cols)

    def session_attempts(self) -> list[dict]:
        return self.ctx.session_attempts()

    def current_attempt(self) -> dict | None:
        return self.ctx.current_attempt()

    def job_attempt_running_at(self, n: int) -> float | None:
        return self.ctx.attempt_running_at(n)

    def summary(self) -> dict:
        return self.ctx.summary()

    def spent(self, now: float | None = None) -> float:
        return self.ledger.spent(now)

    def burn_per_hour(self) -> float:
        return self.ledger.burn_per_hour()

    # ---- start / re-attach -----------------------------------------------------------------------
    def start(self) -> str:
        """Claim the job, create or re-attach its row, sweep orphans, make the plan."""
        if self.started:
            return self.state
        self._ensure_plan()
        self.spec = self._resolve_auto(self.spec)
        chk = check_start(self.spec, self.plan, self.store, self.pid)
        if not chk.reattach:
            est = self.plan.estimate.to_dict() if getattr(self.plan, "estimate", None) is not None else None
            self.store.create_job(self.name, spec_to_yaml(self.spec), self.run_uri, spec_path=self.spec_path,
                                  providers=list(self.spec.resources.providers), budget_usd=self.spec.budget.max_usd,
                                  steps=_total_steps(self.spec), estimate=est, t=self.now())
        else:
            self.store.update_job(self.name, spec_yaml=spec_to_yaml(self.spec), updated=self.now())
        log = os.environ.get("DTRUN_CONTROLLER_LOG")
        if not self.store.claim_controller(self.name, self.pid, HOST, log):
            raise ControllerBusy(f"job {self.name} is already run by another controller")
        self.started = True
        self.teardown.sweep_orphans()
        if chk.reattach:
            self._reattach()
        else:
            try:
                if chk.uri_error is not None:
                    raise chk.uri_error
                if not chk.done:
                    runuri.write_text(runuri.join(self.run_uri, runuri.JOB_FILE), spec_to_yaml(self.spec))
            except OSError as e:
                # Nothing rented yet: end the job (never leave it PENDING) and say why, exit 6.
                from orchestrator.run.uricheck import UriRefused

                why = f"the run URI {self.run_uri} cannot be used: {describe_error(e)}"
                self.transition("FAILED", why)
                raise UriRefused(f"{why}; nothing rented") from None
            if chk.done:
                self.event("done", f"{self.run_uri} already has DONE: nothing to train "
                                   f"(remove the run URI to train again)")
                self.transition("SUCCEEDED", "already finished (DONE in the run URI)")
                return "SUCCEEDED"
            self.event("start", f"controller pid {self.pid} on {HOST}; run URI {self.run_uri}")
            if self.spec.command is not None:
                from orchestrator.run.codeship import ship_event

                self.event("code", ship_event(self.spec))
        if self.plan.chosen is None and self.state in ("PENDING",):
            why = "; ".join(self.plan.refusals) or "no provider offers this GPU"
            self.transition("FAILED", f"no offer fits: {why}")
        return self.state

    def _resolve_auto(self, spec: JobSpec) -> JobSpec:
        """What the nodes get: ``trainer.parallel: auto`` → the memory planner's degrees;
        ``checkpoint.every_steps: auto`` → the plan's interval (Young/Daly)."""
        if spec.trainer is not None and spec.trainer.parallel == "auto":
            from orchestrator.plan.planner import resolve_parallel

            spec = resolve_parallel(spec)
        every = getattr(self.plan, "checkpoint_every_steps", 0)
        if spec.checkpoint.every_steps == "auto" and isinstance(every, int) and every > 0:
            spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"every_steps": every})})
        return spec

    def _ensure_plan(self) -> None:
        if self.plan is not None:
            return
        # No plan handed in (`dtrun up` always hands one in): the prepare step `dtrun up` uses,
        # on the layout the nodes run — auto's degrees first (DoesNotFit, exit 4, when nothing
        # fits), then the offers and the interval — and an event saying so.
        from orchestrator.run.prepare import prepare, summary

        p = prepare(self._resolve_auto(self.spec), spec_path=self.spec_path, get=self.provider)
        self.spec, self.plan = p.spec, p.plan
        self.event("plan", f"no plan handed in: planned on the resolved spec: {summary(p)}")

    def _reattach(self) -> None:
        att = self.current_attempt()
        self.recovery.make_strategy(list(self.plan.offers) if self.plan is not None else [],
                                    att["offer"] if att else None)
        live = self.store.nodes(self.name, live_only=True)
        self.event("reattach", f"controller pid {self.pid} re-attached in state {self.state} "
                               f"({len(live)} live node(s))")
        now = self.now()
        self.observer.last_progress_at = now
        if att and att["state"] == "LAUNCHING" and not [n for n in live if n["attempt"] == att["n"]]:
            # Killed between "launch requested" and "node recorded": the instance, if it exists,
            # carries the attempt's name and the orphan sweep owns it.
            self.store.update_attempt(self.name, att["n"], state="ENDED", outcome=Outcome.UNRECORDED.value, ended_at=now,
                                      reason="controller died while launching")
            if self.state in ("PROVISIONING", "RUNNING"):
                self.recovery.started = now
                self.transition("RECOVERING", "re-attached after a launch that was never recorded")
        if self.state == "RECOVERING":
            self.recovery.begin(now)

    # ---- the loop --------------------------------------------------------------------------------
    def run(self, should_pause: Callable[[], bool] | None = None,
            on_tick: Callable[["Controller"], None] | None = None) -> str:
        """Tick until a final state (returned). ``should_pause`` returning True makes ``run``
        return "INTERRUPTED" at the next tick boundary with everything committed. Bad ticks are
        retried with backoff (``orchestrator.run.loop``)."""
        return loop.run(self, should_pause, on_tick)

    def tick(self) -> str:
        if not self.started:
            self.start()
        now = self.now()
        self.ledger.book(now)
        state = self.state
        if state in TERMINAL_STATES:
            return state
        self._renew_lease(now)
        self.store.touch_controller(self.name)
        action = self.store.pop_action(self.name)
        if action:
            self.teardown.cancel(action == "stop_now")
            state = self.state
            if state in TERMINAL_STATES:
                return state
        if state == "PENDING":
            self._launch(now)
        elif state in ("PROVISIONING", "RUNNING"):
            if self.launches.inflight is not None:
                self._launch_in_flight(now)
            else:
                self.watching.watch(now)
        elif state == "RECOVERING":
            self._recover(now)
        if self.state == "STOPPING":
            self.teardown.stopping(self.now())
        return self.state

    def _renew_lease(self, now: float) -> None:
        if not self.write_lease:
            return
        try:
            runuri.write_json(runuri.join(self.run_uri, runuri.LEASE),
                              {"expires": now + 3 * self.poll, "renewed": now, "controller": f"{self.pid}@{HOST}"})
        except OSError as e:
            self.event("warning", f"could not renew the lease in {self.run_uri}: {e}")

    def guard_recovering(self, now: float) -> bool:
        """While no node runs: end the job at the deadline. True if it did."""
        return self.teardown.deadline_while_recovering(now)

    def _recovery_overdue(self, now: float) -> bool:
        why = self.recovery.overdue(now)
        if why:
            self.teardown.give_up(why)
        return why is not None

    # ---- launching -------------------------------------------------------------------------------
    def _end_job(self, end: EndJob | None) -> None:
        if end is None:
            return
        if end.how == "give_up":
            self.teardown.give_up(end.reason)
        elif end.how == "finish":
            self.teardown.finish(end.target, end.reason)
        else:
            self.transition(end.target, end.reason)

    def _launch(self, now: float) -> None:
        self._end_job(self.launcher.start(now, self.plan))

    def _launch_in_flight(self, now: float) -> None:
        """A tick while the launch runs: record it once it returned, else guard the money."""
        inf = self.launches.inflight
        assert inf is not None
        if inf.done.is_set():
            self._end_job(self.launcher.record())
            return
        self.launcher.show_build(inf)
        if self._recovery_overdue(now):
            return
        self.teardown.apply_guard(now, running=False)

    def _recover(self, now: float) -> None:
        if not self.teardown.terminate_nodes():
            return  # remnants not confirmed gone yet: retry next tick
        self.teardown.sweep_if_due()
        if self._recovery_overdue(now):
            return
        if self.guard_recovering(now):
            return
        if now < self.recovery.next_launch_at:
            return
        self._launch(now)

"""The controller: one job's state machine, driven tick by tick.

States::

    PENDING ─► PROVISIONING ─► RUNNING ─► STOPPING ─► SUCCEEDED | FAILED | CANCELLED | OVER_BUDGET
                   ▲   │           │          ▲
                   │   ▼           ▼          │
                   └─ RECOVERING ◄─┘──────────┘  (preempted / lost / crashed → new attempt)

Every tick: book spend (``orchestrator.run.guard``), renew ``lease.json`` in the run URI, read a
pending ``dtrun down`` request from the state store, poll the provider, read ``progress.json`` and
``DONE``, then decide. Every transition is committed to the state store *before* the controller
acts on it (launch, terminate), so a controller killed at any point can be restarted
(``dtrun up`` of the same job) and re-attaches to the nodes it finds recorded there.

``provider.launch`` runs in a worker thread (:class:`LaunchInFlight`): provisioning takes
minutes on a real cloud and the loop keeps ticking meanwhile — the budget guard (the attempt is
billed from its launch request on), the deadline, ``recovery.max_recovery_minutes``, STOP and
``dtrun down`` all act. Cancelling an in-flight launch terminates what it created (found by the
attempt's deterministic instance name through ``provider.list_owned``), confirmed like any node.
A launch that does not return within the stop grace is abandoned: what it returns later is
terminated off the loop (the job is recorded finished, and the providers closed, only once that
is confirmed or given up to the orphan sweep), and, if nothing of it was recorded as a node, its
time from the request is booked at the offer's price (an upper bound: see ``_book_abandoned``).

A node is recorded terminated only when ``provider.terminate`` returns (the provider confirmed
it gone); ``TerminateNotConfirmed`` and ``Transient`` are retried every tick until it does.

``Controller(spec, store, clock=..., providers=...)``: ``.run() -> final state``, ``.tick()``.
``providers`` maps a provider name to an instance (default: ``providers.registry.get``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from orchestrator.contract import runuri
from orchestrator.run.clock import Clock, RealClock
from orchestrator.contract.errors import DtrunError, ProviderRefused
from orchestrator.run.guard import Guard, attempt_price_per_hour
from orchestrator.run.nodecreds import node_storage
from orchestrator.run.recovery import FailoverStrategy, counted_attempts, preemption_storm
from orchestrator.plan.spec import JobSpec, spec_to_yaml
from orchestrator.run.state import ACTIVE_STATES, HOST, TERMINAL_STATES, StateStore, dtrun_home
from providers import errors as perr
from providers.base import PREEMPT_EXIT_CODES, Handle, LaunchRequest, NodeState, Offer, OwnedInstance, Provider

REPO_ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP = REPO_ROOT / "infra" / "node_bootstrap.py"
# Providers whose nodes run on this machine (this interpreter, this checkout). Every other
# provider runs the bootstrap on a remote node, inside the project copy it received as the
# launch's workdir (SkyPilot workdir sync, the Modal image), with that node's own python.
ON_THIS_MACHINE = ("local", "fake")
REMOTE_COMMAND = ["python", "infra/node_bootstrap.py"]
JOB_YAML = "job.yaml"
WATCHDOG = "watchdog.json"
EXIT_BAD_CONFIG = runuri.EXIT_BAD_CONFIG


class ControllerBusy(DtrunError):
    """Another live controller process owns this job."""


MAX_TICK_FAILURES = 20
"""Consecutive ticks that raised an unexpected exception after which the controller gives up."""
TICK_BACKOFF_CAP_SECONDS = 60.0


class ControllerGaveUp(DtrunError):
    """``MAX_TICK_FAILURES`` ticks in a row raised: the controller exits (exit 1) and leaves the
    nodes to their own watchdogs (budget, deadline, lease, idle); nothing is recorded terminated.
    ``dtrun up`` of the job re-attaches; ``dtrun down`` stops it."""


_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.I)


def describe_error(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters) with the values of
    secret-looking environment variables (``*KEY*``, ``*SECRET*``, ``*TOKEN*``, …) masked."""
    lines = str(e).strip().splitlines()
    msg = lines[0][:limit] if lines else ""
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_NAME.search(name) and value in msg:
            msg = msg.replace(value, f"<{name}>")
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _total_steps(spec: JobSpec) -> int | None:
    return spec.command.steps if spec.command is not None else spec.trainer.total_steps


def resolved_spec(spec: JobSpec) -> JobSpec:
    """The spec with its run URI made absolute (a detached controller or a node may run
    elsewhere than the directory the user typed ``dtrun up`` in)."""
    ck = spec.checkpoint.model_copy(update={"uri": spec.run_uri})
    return spec.model_copy(update={"checkpoint": ck})


LAUNCH_WAIT_CAP_SECONDS = 30.0
"""The tick that starts a launch waits for it up to one poll interval (at most this many real
seconds), so a quick launch is recorded in the same tick; a slower one keeps running in its
thread while the loop goes on ticking (the guard acts within one tick either way)."""
ABANDON_TERMINATE_TRIES = 10
"""Tries of the late terminate of what an abandoned launch returned (backoff 0.1 s doubling, capped
at ``ABANDON_RETRY_CAP_S``: about 26 s in all), after which the orphan sweep takes over."""
ABANDON_RETRY_CAP_S = 5.0
ABANDON_CLOSE_WAIT_S = 60.0
"""How long the end of a run waits (real seconds) for an abandoned launch's late terminate."""


class LaunchInFlight:
    """One ``provider.launch(request)`` running in a worker thread, off the controller's loop.

    While it runs, the controller keeps ticking: the budget guard (with the attempt's price
    billed from the launch request on), the deadline, ``recovery.max_recovery_minutes``, STOP
    and ``dtrun down`` all act. Cancelling it does not interrupt the SDK call (no SDK offers
    that for every provider); instead the controller finds what the launch has created so far
    by its deterministic name (``request.instance_name``, via ``provider.list_owned``) and
    terminates it through the ordinary node path. A launch the controller stops waiting for
    (:meth:`abandon`) is ended off the loop thread: whatever it returns later is terminated
    (retried, confirmed) by its worker, or by a cleanup thread when it had already returned;
    ``settled`` is set once nothing of it is left to end, ``ended_at`` is when (what the job is
    booked to). Nothing here is provider-specific.
    """

    def __init__(self, provider: Provider, request: LaunchRequest, price_per_hour: float, t0: float,
                 clock: Callable[[], float] | None = None) -> None:
        self.provider = provider
        self.request = dataclasses.replace(request, on_progress=self._report)
        self.n = request.attempt
        self.offer = request.offer
        self.price_per_hour = price_per_hour
        self.t0 = t0
        self._clock = clock
        self.handle: Handle | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.cancelled_at: float | None = None
        self.adopted: set[str] = set()
        """Instance ids the controller found (list_owned) and recorded as this attempt's nodes."""
        self.abandoned = False
        self.abandoned_at: float | None = None
        self.cleanup_error: str | None = None
        self.settled = threading.Event()
        """Set once an abandoned launch has nothing left to end: it raised (created nothing it
        returned), or what it returned was terminated (``terminated`` True) or the late terminate
        gave up (``cleanup_error``; the orphan sweep takes over)."""
        self.terminating = False
        self.terminated = False
        self.ended_at: float | None = None
        self.booked = False
        self.booked_until: float | None = None
        self._progress: dict[str, Any] | None = None
        self.shown_layer: tuple[int, int] | None = None
        """The image layer last shown as a ``build`` event (the controller's loop only)."""
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"dtrun-launch-{request.instance_name}",
                                       daemon=True)
        self.cleanup_thread: threading.Thread | None = None

    def start(self) -> "LaunchInFlight":
        self.thread.start()
        return self

    def _report(self, where: dict[str, Any]) -> None:
        with self._lock:
            self._progress = dict(where)

    def progress(self) -> dict[str, Any] | None:
        """Where the launch says it is (``LaunchRequest.on_progress``), newest first; None if silent."""
        with self._lock:
            return dict(self._progress) if self._progress is not None else None

    def _now(self) -> float:
        import time as _time

        return self._clock() if self._clock is not None else _time.time()

    def _run(self) -> None:
        try:
            handle = self.provider.launch(self.request)
        except BaseException as e:  # noqa: BLE001 - handed to the controller's thread
            with self._lock:
                self.error = e
                self.ended_at = self._now()
                self.done.set()
                self.settled.set()
            return
        with self._lock:
            self.handle = handle
            self.done.set()
            late = self.abandoned
            self.terminating = late
        if late:
            self._terminate_late(handle)

    def abandon(self, now: float | None = None) -> None:
        """The controller stops waiting: whatever the launch still returns is ended off the loop
        thread (never on it: the late terminate retries for up to ~26 s)."""
        with self._lock:
            self.abandoned = True
            self.abandoned_at = self._now() if now is None else now
            if not self.done.is_set():
                return  # the worker terminates what the launch returns
            handle = self.handle
            late = handle is not None and handle.instance_id not in self.adopted
            self.terminating = late
            if handle is not None and not late:
                self.ended_at = self.abandoned_at  # adopted: the controller's node path ends it
                self.settled.set()
        if late:
            assert handle is not None
            self.cleanup_thread = threading.Thread(target=self._terminate_late, args=(handle,), daemon=True,
                                                   name=f"dtrun-cleanup-{self.request.instance_name}")
            self.cleanup_thread.start()

    def _terminate_late(self, handle: Handle) -> None:
        import time as _time

        try:
            for i in range(ABANDON_TERMINATE_TRIES):
                try:
                    self.provider.terminate(handle)
                    self.terminated = True
                    self.cleanup_error = None
                    return
                except perr.ProviderError as e:  # TerminateNotConfirmed, Transient, …: retried
                    self.cleanup_error = f"{type(e).__name__}: {e}"
                    _time.sleep(min(ABANDON_RETRY_CAP_S, 0.1 * 2 ** i))
                except Exception as e:  # noqa: BLE001 - a provider bug: not retried, the sweep takes over
                    self.cleanup_error = describe_error(e)
                    return
        finally:
            with self._lock:
                self.ended_at = self._now()
                self.terminating = False
                self.settled.set()

    def pending(self) -> bool:
        """An abandoned launch whose worker (or cleanup thread) is still at work."""
        return self.abandoned and not self.settled.is_set()

    def matches(self, inst: OwnedInstance) -> bool:
        """``inst`` was created by this launch (its name, or its name plus a per-node suffix)."""
        name = self.request.instance_name
        return inst.name == name or inst.name.startswith(name + "-")


class Controller:
    def __init__(self, spec: JobSpec, store: StateStore, clock: Clock | None = None,
                 providers: dict[str, Provider] | None = None, *, plan: Any = None,
                 spec_path: str | None = None, on_event: Callable[[str, str], None] | None = None,
                 stop_grace_seconds: float | None = None, write_lease: bool = True,
                 launch_wait_seconds: float | None = None) -> None:
        self.spec = resolved_spec(spec)
        self.store = store
        self.clock: Clock = clock or RealClock()
        self._providers: dict[str, Provider] = dict(providers or {})
        self.plan = plan
        self.spec_path = spec_path
        self.on_event = on_event
        self.name = spec.name
        self.run_uri = self.spec.run_uri
        r = self.spec.recovery
        self.poll = r.poll_seconds
        self.stop_grace = stop_grace_seconds if stop_grace_seconds is not None else max(60.0, 4 * self.poll)
        self.guard = Guard(self.spec, self.poll, self.stop_grace)
        self.write_lease = write_lease
        self.strategy: FailoverStrategy | None = None
        self.next_launch_at = 0.0
        self.recovery_started: float | None = None
        self.last_step: int | None = None
        self.last_progress_at: float | None = None
        self.progress: dict | None = None
        self.started = False
        self.pid = os.getpid()
        self._first_attempt_progress: dict[int, bool] = {}
        self._cluster_seen: dict[int, list[dict]] = {}
        # A launch that raised may still have created (and be billing for) its instance: the
        # orphan sweep runs again before the next launch and before the job ends.
        self._sweep_due = False
        self.launch_wait = (launch_wait_seconds if launch_wait_seconds is not None
                            else min(self.poll, LAUNCH_WAIT_CAP_SECONDS))
        self.inflight: LaunchInFlight | None = None
        self._abandoned: list[LaunchInFlight] = []
        """Cancelled launches the loop stopped waiting for (their workers may still be in the SDK)."""

    # ---- helpers -------------------------------------------------------------------------------
    def provider(self, name: str) -> Provider:
        if name not in self._providers:
            from providers import registry

            self._providers[name] = registry.get(name)
        return self._providers[name]

    def now(self) -> float:
        return self.clock.now()

    def job(self) -> dict:
        j = self.store.get_job(self.name)
        assert j is not None
        return j

    @property
    def state(self) -> str:
        return self.job()["state"]

    def event(self, type_: str, message: str, data: dict | None = None) -> None:
        self.store.add_event(self.name, type_, message, data, t=self.now())
        if self.on_event:
            self.on_event(type_, message)

    def transition(self, state: str, reason: str | None = None, **cols: Any) -> None:
        self.store.set_state(self.name, state, reason, t=self.now(), **cols)
        if self.on_event:
            self.on_event("state", state + (f": {reason}" if reason else ""))

    def session_attempts(self) -> list[dict]:
        first = self.job()["session_first_attempt"]
        return [a for a in self.store.attempts(self.name) if a["n"] >= first]

    def current_attempt(self) -> dict | None:
        atts = self.store.attempts(self.name)
        return atts[-1] if atts else None

    # ---- start / re-attach -----------------------------------------------------------------------
    def start(self) -> str:
        """Claim the job, create or re-attach its row, sweep orphans, make the plan."""
        if self.started:
            return self.state
        job = self.store.get_job(self.name)
        if job and job["controller_pid"] not in (None, self.pid) and StateStore.controller_alive(job):
            raise ControllerBusy(f"job {self.name} is already run by controller pid {job['controller_pid']} "
                                 f"on {job['controller_host']}; see `dtrun status {self.name}`, "
                                 f"or `dtrun down {self.name}`")
        self._ensure_plan()
        self.spec = self._resolve_auto(self.spec)
        reattach = job is not None and job["state"] in ACTIVE_STATES
        if not reattach and self.plan.chosen is None and getattr(self.plan, "unusable", None):
            # Offers exist only on providers without credentials: exit 5, nothing rented. (A
            # re-attach goes on: its nodes must still be watched and stopped.)
            raise ProviderRefused("; ".join(self.plan.unusable.values()) + "; nothing rented")
        if not reattach and self.plan.chosen is not None:
            # A remote node needs the object store's credentials: refuse (exit 5) before the job
            # row exists and before anything is rented, naming what to set.
            node_storage(self.spec, self.plan.chosen.provider)
        if not reattach:
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
        self._sweep_orphans()
        if reattach:
            self._reattach()
        else:
            try:
                done = runuri.exists(runuri.join(self.run_uri, runuri.DONE))
                if not done:
                    runuri.write_text(runuri.join(self.run_uri, JOB_YAML), spec_to_yaml(self.spec))
            except OSError as e:
                # Nothing rented yet: end the job (never leave it PENDING) and say why, exit 6.
                from orchestrator.run.uricheck import UriRefused

                why = f"the run URI {self.run_uri} cannot be used: {describe_error(e)}"
                self.transition("FAILED", why)
                raise UriRefused(f"{why}; nothing rented") from None
            if done:
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
        from orchestrator.plan.estimate import make_plan

        # Only providers whose credentials are in place (the others are refused with what to
        # set); with none left, start() refuses the job before anything is rented.
        self.plan = make_plan(self.spec, usable_only=True, get=self.provider)

    def _make_strategy(self, prefer: dict | None = None) -> None:
        offers = list(self.plan.offers) if self.plan is not None else []
        if not offers:
            return
        idx = 0
        if prefer:
            want = Offer.from_dict(prefer).key()
            idx = next((i for i, o in enumerate(offers) if o.key() == want), 0)
        self.strategy = FailoverStrategy(offers, self.spec.recovery.backoff_seconds, idx)

    def _sweep_orphans(self) -> None:
        """The money helper's orphan sweep (instances with dtrun's prefix that no live job owns)."""
        try:
            from orchestrator.run.sweep import sweep_orphans
        except ImportError:
            return
        try:
            names = list(self.spec.resources.providers)
            swept = sweep_orphans(self.store, names, dry_run=False,
                                  providers={n: self.provider(n) for n in names}, clock=self.clock)
        except (perr.ProviderError, OSError) as e:
            self.event("warning", f"orphan sweep failed: {e}")
            return
        for inst in swept or []:
            self.event("orphan", f"terminated orphan instance {inst.name} ({inst.instance_id})")

    def _reattach(self) -> None:
        att = self.current_attempt()
        self._make_strategy(att["offer"] if att else None)
        live = self.store.nodes(self.name, live_only=True)
        self.event("reattach", f"controller pid {self.pid} re-attached in state {self.state} "
                               f"({len(live)} live node(s))")
        now = self.now()
        self.last_progress_at = now
        if att and att["state"] == "LAUNCHING" and not [n for n in live if n["attempt"] == att["n"]]:
            # Killed between "launch requested" and "node recorded": the instance, if it exists,
            # carries the attempt's name and the orphan sweep owns it.
            self.store.update_attempt(self.name, att["n"], state="ENDED", outcome="unrecorded", ended_at=now,
                                      reason="controller died while launching")
            if self.state in ("PROVISIONING", "RUNNING"):
                self.recovery_started = now
                self.transition("RECOVERING", "re-attached after a launch that was never recorded")
        if self.state == "RECOVERING":
            self.recovery_started = self.recovery_started or now

    # ---- the loop --------------------------------------------------------------------------------
    def run(self, should_pause: Callable[[], bool] | None = None,
            on_tick: Callable[["Controller"], None] | None = None) -> str:
        """Tick until a final state (returned). ``should_pause`` returning True makes ``run``
        return "INTERRUPTED" at the next tick boundary with everything committed.

        A tick that raises an unexpected exception (a provider SDK bug, a full disk) is recorded
        as a ``controller_error`` event (type and first line of the message, secrets masked) and
        retried after a backoff: one poll interval, doubling, capped at 60 s (or the poll interval
        if longer). Every transition is committed before it is acted on, so a retried tick picks
        up where the failed one stopped. ``MAX_TICK_FAILURES`` failures in a row → a
        ``controller_exit`` event and :class:`ControllerGaveUp`; the nodes are left running
        under their own watchdogs, none is recorded terminated."""
        try:
            self.start()
        except BaseException:
            self._close_providers()  # the orphan sweep may have used (and started) them
            raise
        failures = 0
        try:
            while True:
                started = self.now()
                try:
                    state = self.tick()
                    if on_tick:
                        on_tick(self)
                except ControllerBusy:
                    raise
                except Exception as e:  # noqa: BLE001 - one bad tick must not end recovery
                    failures += 1
                    delay = self._tick_failed(e, failures)
                else:
                    failures = 0
                    if state in TERMINAL_STATES:
                        return state
                    delay = self._next_delay(state)
                # Ticks start every poll seconds (not poll seconds after the last one ended), so
                # an event is seen at most one poll interval after it happened.
                wake = started + delay
                while True:
                    if should_pause and should_pause():
                        return "INTERRUPTED"
                    left = wake - self.now()
                    if left <= 0:
                        break
                    self.clock.sleep(min(0.2, left) if isinstance(self.clock, RealClock) else left)
        finally:
            if self.state in TERMINAL_STATES or (should_pause and should_pause()):
                self.store.release_controller(self.name, self.pid)
            self._close_providers()

    def _close_providers(self) -> None:
        """The loop is over: each provider releases what it started in this process (SkyPilot
        stops the local API server dtrun started). First it waits for the late terminate of an
        abandoned launch that has returned (bounded by its retries), and books it. A launch still
        in flight keeps the providers open, and so does one that was cancelled and abandoned but
        has not returned yet."""
        for inf in self._abandoned:
            if inf.done.is_set():
                inf.settled.wait(ABANDON_CLOSE_WAIT_S)
        if self._abandoned:
            try:
                # books one still in the SDK up to now (the process is about to end: INTERRUPTED,
                # given up), or extends a booking made at the end of the run to its late terminate
                self._book_abandoned(final=True)
            except Exception as e:  # noqa: BLE001 - the state store itself may be failing
                self._safe_event("warning", f"could not book an abandoned launch: {describe_error(e)}", {})
        # What an abandoned launch returned and nobody terminated: the late terminate gave up, or
        # is still being retried after the wait above.
        loose = [i for i in self._abandoned if i.handle is not None and not i.terminated
                 and i.handle.instance_id not in i.adopted]
        if any(i.settled.is_set() for i in loose) and self.state in TERMINAL_STATES:
            try:  # the job is over: its leftovers are orphans now; the sweep terminates and books them
                self._sweep_orphans()
            except Exception as e:  # noqa: BLE001 - the state store itself may be failing
                self._safe_event("warning", f"orphan sweep failed: {describe_error(e)}; run `dtrun gc`", {})
        for inf in loose:
            if not inf.settled.is_set():
                self._safe_event("warning", f"{inf.handle.name}: its terminate is still being retried as the "
                                 "controller exits; it may still be billing: run `dtrun gc`", {})
        if any(i is not None and (not i.done.is_set() or i.pending()) for i in [self.inflight, *self._abandoned]):
            return  # a call still inside a provider's SDK keeps its provider (e.g. SkyPilot's API server) up
        for p in list(self._providers.values()):
            try:
                p.close()
            except Exception as e:  # noqa: BLE001 - closing must not hide the run's outcome
                self._safe_event("warning", f"{getattr(p, 'name', p)}: close failed: {describe_error(e)}", {})

    def _tick_failed(self, e: Exception, failures: int) -> float:
        """Record a failed tick; the delay before the next one, or raise ControllerGaveUp."""
        what = describe_error(e)
        tb = e.__traceback__
        frames = []
        while tb is not None:
            co = tb.tb_frame.f_code
            frames.append(f"{Path(co.co_filename).name}:{tb.tb_lineno} in {co.co_name}")
            tb = tb.tb_next
        data = {"type": type(e).__name__, "failures": failures, "where": frames[-4:]}
        if failures >= MAX_TICK_FAILURES:
            reason = (f"controller exiting after {failures} consecutive failed ticks (last: {what}); the nodes "
                      f"keep running under their own watchdogs (budget, deadline, lease, idle): "
                      f"`dtrun up` of the job re-attaches, `dtrun down {self.name}` stops it")
            self._safe_event("controller_exit", reason, data)
            try:
                self.store.release_controller(self.name, self.pid)
            except Exception:  # noqa: BLE001 - the store may be what is broken
                pass
            raise ControllerGaveUp(reason) from e
        delay = min(self.poll * 2 ** (failures - 1), max(TICK_BACKOFF_CAP_SECONDS, self.poll))
        self._safe_event("controller_error", f"tick failed ({failures} in a row, giving up at "
                                             f"{MAX_TICK_FAILURES}): {what}; retrying in {delay:.0f} s", data)
        return delay

    def _safe_event(self, type_: str, message: str, data: dict) -> None:
        try:
            self.event(type_, message, data)
        except Exception as e:  # noqa: BLE001 - the state store itself may be failing
            print(f"dtrun controller: {type_}: {message} (not recorded: {describe_error(e)})",
                  file=sys.stderr, flush=True)

    def _next_delay(self, state: str) -> float:
        """Seconds until the next tick: one poll, except that a pending launch (PENDING, or
        RECOVERING with every remnant confirmed gone) waits only for its backoff."""
        if state == "PENDING":
            return 0.0
        if state == "RECOVERING" and not self.store.nodes(self.name, live_only=True):
            return min(self.poll, max(0.0, self.next_launch_at - self.now()))
        return self.poll

    def tick(self) -> str:
        if not self.started:
            self.start()
        now = self.now()
        self._book_spend(now)
        state = self.state
        if state in TERMINAL_STATES:
            return state
        self._renew_lease(now)
        self.store.touch_controller(self.name)
        action = self.store.pop_action(self.name)
        if action:
            self._cancel(action == "stop_now")
            state = self.state
            if state in TERMINAL_STATES:
                return state
        if state == "PENDING":
            self._launch(now)
        elif state in ("PROVISIONING", "RUNNING"):
            if self.inflight is not None:
                self._launch_in_flight(now)
            else:
                self._watch(now)
        elif state == "RECOVERING":
            self._recover(now)
        if self.state == "STOPPING":
            self._stopping(self.now())
        return self.state

    # ---- money -----------------------------------------------------------------------------------
    def _book_spend(self, now: float) -> None:
        self._book_abandoned()
        for row in self.store.open_spend_rows(self.name):
            self.store.book_spend(self.name, row["attempt"], now)

    def _unbooked_launches(self) -> list[LaunchInFlight]:
        """The launch in flight and abandoned ones not booked yet, none of whose instances was
        recorded as a node (those bill through their spend row)."""
        return [i for i in [self.inflight, *self._abandoned] if i is not None and not i.adopted and not i.booked]

    def burn_per_hour(self) -> float:
        """USD/h billing now: open spend rows, plus a launch in flight or abandoned and still at
        work (billed from its request)."""
        burn = sum(r["price_per_hour"] for r in self.store.open_spend_rows(self.name))
        for inf in self._unbooked_launches():
            if inf is self.inflight or inf.pending():
                burn += inf.price_per_hour
        return burn

    def spent(self, now: float | None = None) -> float:
        """USD booked, plus what a launch still in flight (or abandoned, not booked yet) has cost
        since its request (its instance may already exist and bill; its spend row opens only once
        it is recorded or settled)."""
        total = self.store.spend_total(self.name)
        t = self.now() if now is None else now
        for inf in self._unbooked_launches():
            end = inf.ended_at if inf.ended_at is not None and inf is not self.inflight else t
            total += inf.price_per_hour * max(0.0, min(end, t) - inf.t0) / 3600.0
        return total

    def _book_abandoned(self, final: bool = False) -> None:
        """Book each abandoned launch that created nothing the controller recorded: from its
        request to when it settled (it raised, or what it returned late was terminated), at the
        offer's price — the providers bill an instance from its creation (PROVIDERS.md: RunPod,
        Vast and Modal per second, Lambda per minute), and dtrun cannot tell whether, or when, a
        launch it stopped waiting for created one, so it books the whole launch: an upper bound,
        like the guard's view of a launch in flight. ``final`` (the run ends) books one still in
        the provider's SDK up to now; should it settle later (``_close_providers`` waits for a
        late terminate), the booking is extended to then. What it created and nobody terminated
        is found, terminated and booked by the orphan sweep."""
        for inf in self._abandoned:
            if inf.adopted:
                continue
            settled = inf.settled.is_set()
            if inf.booked:
                if settled and inf.ended_at is not None and inf.ended_at > (inf.booked_until or 0.0):
                    self.store.book_spend(self.name, inf.n, inf.ended_at, close=True, reopen=True)
                    inf.booked_until = inf.ended_at
                continue
            if not settled and not final:
                continue
            until = inf.ended_at if settled and inf.ended_at is not None else self.now()
            until = max(until, inf.t0)
            if any(r["attempt"] == inf.n and r["closed"] for r in self.store.spend_by_attempt(self.name)):
                # The orphan sweep found what the launch created and booked it (created → gone).
                inf.booked, inf.booked_until = True, until
                continue
            self.store.open_spend(self.name, inf.n, inf.price_per_hour, inf.t0)
            usd = self.store.book_spend(self.name, inf.n, until, close=True)
            inf.booked, inf.booked_until = True, until
            if not settled:
                what = "its launch has still not returned: booked up to the end of the run"
            elif inf.terminated:
                what = "what it returned late was terminated (confirmed)"
            elif inf.handle is not None:
                what = f"the late terminate was not confirmed ({inf.cleanup_error}); the orphan sweep takes over"
            else:
                what = "its launch raised" + (f" ({describe_error(inf.error)})" if inf.error else "")
            self.event("spend", f"attempt {inf.n}: abandoned launch booked from its request: "
                                f"{until - inf.t0:.0f} s × ${inf.price_per_hour:.4f}/h = ${usd:.4f} "
                                f"(provisioning, an upper bound: the provider bills an instance from its "
                                f"creation, and dtrun cannot tell whether the launch created one); {what}",
                       {"attempt": inf.n, "seconds": until - inf.t0, "usd": usd})

    def _renew_lease(self, now: float) -> None:
        if not self.write_lease:
            return
        try:
            runuri.write_json(runuri.join(self.run_uri, runuri.LEASE),
                              {"expires": now + 3 * self.poll, "renewed": now, "controller": f"{self.pid}@{HOST}"})
        except OSError as e:
            self.event("warning", f"could not renew the lease in {self.run_uri}: {e}")

    def _guard(self, now: float, running: bool) -> bool:
        """Apply the billing guard; True if it started a stop."""
        job = self.job()
        v = self.guard.check(now=now, spent=self.spent(now), burn_per_hour=self.burn_per_hour(),
                             deadline=job["deadline"], last_progress_at=self.last_progress_at, running=running)
        if v.stop:
            self.event("guard", v.reason)
            self._begin_stop(v.target, v.reason, hard=v.hard)
            return True
        return False

    # ---- launching -------------------------------------------------------------------------------
    def _launch(self, now: float) -> None:
        if self.plan is None or not self.plan.offers:
            self.transition("FAILED", "no offer fits: " + ("; ".join(getattr(self.plan, "refusals", [])) or "none"))
            return
        if self.strategy is None:
            self._make_strategy()
        assert self.strategy is not None
        job = self.job()
        r = self.spec.recovery
        # Preemptions and planned restarts (the provider's lifetime cap, e.g. Modal's 24 h) do not
        # use up the job: max_attempts counts failed launches and crashes (recovery.py).
        session = self.session_attempts()
        used = counted_attempts(session)
        if used >= r.max_attempts:
            self._give_up(f"gave up after {used} failed launches or crashes, preemptions not counted "
                          f"(recovery.max_attempts = {r.max_attempts})")
            return
        storm = preemption_storm(session, now, r.max_preemptions_per_hour)
        if storm:
            self._give_up(storm)
            return
        if job["deadline"] is None and self.spec.budget.max_hours:
            self.store.update_job(self.name, deadline=now + self.spec.budget.max_hours * 3600.0, started_at=now)
            job = self.job()
        elif job["started_at"] is None:
            self.store.update_job(self.name, started_at=now)
        if self.recovery_started is None:
            self.recovery_started = now  # provisioning is bounded by max_recovery_minutes too
        offer = self.strategy.current
        try:
            node_env, node_secrets = node_storage(self.spec, offer.provider)
        except ProviderRefused as e:
            self._provider_refused(offer.provider, str(e))
            return
        price = attempt_price_per_hour(self.spec, offer)
        spent = self.store.spend_total(self.name)
        v = self.guard.may_launch(now=now, spent=spent, price_per_hour=price, deadline=job["deadline"])
        if v.stop:
            self.event("guard", v.reason)
            self._finish(v.target, v.reason)
            return
        n = self.store.last_attempt_number(self.name) + 1
        log_path = str(dtrun_home() / "logs" / self.name / f"attempt-{n}.log")
        start_step = self._latest_committed_step()
        # Commit first, act second.
        self.store.new_attempt(self.name, n, offer.to_dict(), offer.provider, now, start_step=start_step,
                               log_path=log_path)
        self.transition("PROVISIONING", f"attempt {n} on {offer.key()} (${price:.2f}/h)")
        for stale in (runuri.STOP, WATCHDOG):
            runuri.remove(runuri.join(self.run_uri, stale))
        req = self._launch_request(n, offer, log_path, spent, job["deadline"], node_env, node_secrets)
        # The launch runs in a worker thread (provisioning takes minutes on a real cloud): the
        # loop keeps ticking meanwhile (guard, deadline, STOP, `dtrun down`).
        self.inflight = LaunchInFlight(self.provider(offer.provider), req, price, now,
                                       clock=self.clock.now).start()
        self.inflight.done.wait(self.launch_wait)
        if self.inflight.done.is_set():
            self._launch_finished()

    def _launch_in_flight(self, now: float) -> None:
        """A tick while the launch runs: record it once it returned, else guard the money."""
        inf = self.inflight
        assert inf is not None
        if inf.done.is_set():
            self._launch_finished()
            return
        self._show_build(inf)
        if self._check_recovery_time(now):
            return
        self._guard(now, running=False)

    def _show_build(self, inf: LaunchInFlight) -> None:
        """A ``build`` event when the launch's image build reaches a new layer (the live view
        shows "building image: layer k of n, elapsed" from the newest one)."""
        p = inf.progress()
        if not p or p.get("phase") != "image":
            return
        at = (int(p.get("layer") or 0), int(p.get("layers") or 0))
        if at == inf.shown_layer:
            return
        inf.shown_layer = at
        self.event("build", f"attempt {inf.n}: building image: layer {at[0]} of {at[1]} ({p.get('label')})",
                   {"attempt": inf.n, "layer": at[0], "layers": at[1], "label": p.get("label"),
                    "since": p.get("since")})

    def _launch_finished(self) -> None:
        """Record the result of the launch that just returned (a node, or why it failed)."""
        inf = self.inflight
        assert inf is not None and inf.done.is_set() and self.strategy is not None
        self.inflight = None
        n, offer, price, now = inf.n, inf.offer, inf.price_per_hour, inf.t0
        try:
            if inf.error is not None:
                raise inf.error
            handle = inf.handle
            assert handle is not None
        except (perr.NoCapacity, perr.QuotaExceeded) as e:
            delay = self.strategy.no_capacity()
            self._launch_failed(n, "no_capacity", f"{type(e).__name__}: {e}", delay)
            return
        except perr.Transient as e:
            self._sweep_due = True
            delay = self.strategy.transient()
            self._launch_failed(n, "launch_error", f"transient: {e}", delay)
            return
        except perr.AuthError as e:
            self.store.update_attempt(self.name, n, state="ENDED", outcome="refused", reason=str(e), ended_at=self.now())
            self._provider_refused(offer.provider, f"{offer.provider} refused: {e}")
            return
        except perr.NotSupported as e:
            self.store.update_attempt(self.name, n, state="ENDED", outcome="refused", reason=str(e), ended_at=self.now())
            self._finish("FAILED", f"{offer.provider} refused: {e}")
            return
        except perr.ProviderError as e:  # an API error the provider did not classify: retry, bounded
            self._sweep_due = True
            delay = self.strategy.transient()
            self._launch_failed(n, "launch_error", f"{type(e).__name__}: {e}", delay)
            return
        except Exception as e:  # noqa: BLE001 - a provider bug: like an unclassified API error
            self._sweep_due = True
            delay = self.strategy.transient()
            self._launch_failed(n, "launch_error", describe_error(e), delay)
            return
        t = self.now()
        self.store.add_node(self.name, n, handle.to_dict(), t)
        self.store.open_spend(self.name, n, price, now)  # billed from the launch request on
        self.store.update_attempt(self.name, n, state="PENDING", launched_at=now)
        self.strategy.launched()
        self.last_progress_at = t
        self.event("launch", f"attempt {n}: {handle.name} ({handle.instance_id}) on {offer.key()}",
                   {"attempt": n, "instance_id": handle.instance_id, "provider": offer.provider,
                    "data": {k: v for k, v in handle.data.items() if k in ("pid", "pgid", "log_path")}})

    def _provider_refused(self, provider: str, reason: str) -> None:
        """``provider`` cannot be used (credentials): drop its offers and launch the next one at
        once; the job FAILs only when no offer is left."""
        assert self.strategy is not None
        if not self.strategy.drop_provider(provider):
            self._finish("FAILED", reason)
            return
        now = self.now()
        self.next_launch_at = now
        if self.recovery_started is None:
            self.recovery_started = now
        nxt = self.strategy.current.key()
        self.event("refused", f"{reason}; skipping {provider}, next offer {nxt}", {"provider": provider})
        self.transition("RECOVERING", f"{reason}; next offer {nxt}")

    def _launch_request(self, n: int, offer: Offer, log_path: str, spent: float,
                        deadline: float | None, node_env: dict[str, str] | None = None,
                        node_secrets: dict[str, str] | None = None) -> LaunchRequest:
        s = self.spec
        env = {
            "DTRUN_RUN_URI": self.run_uri,
            "DTRUN_JOB": self.name,
            "DTRUN_ATTEMPT": str(n),
            "DTRUN_NPROC_PER_NODE": str(s.resources.gpus_per_node),
            "DTRUN_NNODES": str(s.resources.nodes),
            "DTRUN_PRICE_PER_HOUR": f"{offer.price_per_gpu_hour * offer.gpus_per_node:.6f}",
            "DTRUN_IDLE_MINUTES": f"{s.teardown.idle_minutes:g}",
            "DTRUN_LAUNCHED_AT": f"{self.now():.3f}",
        }
        if s.budget.max_usd is not None:
            env["DTRUN_BUDGET_LEFT_USD"] = f"{max(0.0, s.budget.max_usd - spent) / s.resources.nodes:.6f}"
        if deadline is not None:
            env["DTRUN_DEADLINE"] = f"{deadline:.3f}"
        if s.teardown.controller_lost_minutes is not None:
            env["DTRUN_CONTROLLER_LOST_MINUTES"] = f"{s.teardown.controller_lost_minutes:g}"
        # S3 access (orchestrator.run.nodecreds): nodes on this machine inherit the process
        # environment; a remote node gets the endpoint/region here and the AWS keys in
        # ``secrets`` (never logged, never stored) — nothing for a file:// run URI.
        env.update(node_env or {})
        if os.environ.get("DTRUN_PIP_CACHE_DIR"):  # wheels kept on a volume across nodes (infra/node_setup.py)
            env["DTRUN_PIP_CACHE_DIR"] = os.environ["DTRUN_PIP_CACHE_DIR"]
        command = [sys.executable, str(BOOTSTRAP)] if offer.provider in ON_THIS_MACHINE else list(REMOTE_COMMAND)
        from orchestrator.plan.estimate import node_image

        return LaunchRequest(job=self.name, attempt=n, offer=offer, nodes=s.resources.nodes,
                             command=command, env=env, deadline=deadline,
                             workdir=str(REPO_ROOT), log_path=log_path, secrets=dict(node_secrets or {}),
                             cpu_per_gpu=s.resources.cpu_per_gpu, memory_gb_per_gpu=s.resources.memory_gb_per_gpu,
                             image=node_image(s, offer.provider))

    def _launch_failed(self, n: int, outcome: str, reason: str, delay: float) -> None:
        now = self.now()
        self.store.update_attempt(self.name, n, state="ENDED", outcome=outcome, reason=reason, ended_at=now)
        self.next_launch_at = now + delay
        if self.recovery_started is None:
            self.recovery_started = now
        self.transition("RECOVERING", f"attempt {n}: {reason}" + (f"; retry in {delay:.0f} s" if delay else ""))

    # ---- watching a live attempt ---------------------------------------------------------------
    def _latest_committed_step(self) -> int | None:
        try:
            lc = runuri.latest_committed(self.run_uri)
        except OSError:
            return None
        return lc[0] if lc else None

    def _read_progress(self, attempt: int) -> dict | None:
        try:
            p = runuri.read_json(runuri.join(self.run_uri, runuri.PROGRESS))
        except OSError as e:
            self.event("warning", f"could not read progress.json: {e}")
            return None
        if not isinstance(p, dict):
            return None
        self.progress = p
        return p

    def _done(self) -> dict | None:
        try:
            d = runuri.read_text(runuri.join(self.run_uri, runuri.DONE))
        except OSError:
            return None
        if d is None:
            return None
        try:
            rec = json.loads(d)
        except json.JSONDecodeError:
            rec = {}
        return rec if isinstance(rec, dict) else {}

    def _poll_nodes(self, nodes: list[dict]) -> dict[int, NodeState] | None:
        out: dict[int, NodeState] = {}
        for nd in nodes:
            try:
                st = self.provider(nd["provider"]).poll(Handle.from_dict(nd["handle"]))
            except perr.ProviderError as e:
                self.event("warning", f"poll {nd['name']}: {type(e).__name__}: {e}; retrying next tick")
                return None
            out[nd["id"]] = st
            if nd["state"] != st.value:
                self.store.update_node(nd["id"], state=st.value)
        return out

    def _watch(self, now: float) -> None:
        att = self.current_attempt()
        nodes = [n for n in self.store.nodes(self.name, live_only=True) if att and n["attempt"] == att["n"]]
        if att is None or not nodes:
            self.recovery_started = self.recovery_started or now
            self.transition("RECOVERING", "no live node for the current attempt")
            return
        n = att["n"]
        states = self._poll_nodes(nodes)
        self._sync_cluster(n)
        prog = self._read_progress(n)
        mine = prog is not None and str(prog.get("attempt", n)) == str(n)
        if prog is not None:
            step = prog.get("step")
            cols: dict[str, Any] = dict(step=step, loss=prog.get("loss"), tokens_per_s=prog.get("tokens_per_s"),
                                        val_loss=prog.get("val_loss"),
                                        last_committed_step=prog.get("last_committed_step"),
                                        progress_time=prog.get("time"))
            if prog.get("steps"):
                cols["steps"] = prog.get("steps")
            self.store.update_job(self.name, updated=now, **cols)
            if isinstance(step, int) and step != self.last_step:
                if self.last_step is not None or mine:
                    self.last_progress_at = now
                self.last_step = step
                if mine and (att["start_step"] is None or step > (att["start_step"] or 0)):
                    if self.strategy:
                        self.strategy.progressed()
                    self.recovery_started = None
        done = self._done()
        if done is not None:
            self.event("done", "DONE written by the trainer: tearing down")
            self._begin_stop("SUCCEEDED", "training finished (DONE)", write_stop=False)
            return
        if states is None:
            # The provider cannot say what the node is doing, but it is billing all the same:
            # the budget and deadline guard must not wait for the status API to come back.
            self._guard(now, running=False)
            return
        values = list(states.values())
        if all(s == NodeState.RUNNING for s in values):
            if self.state == "PROVISIONING":
                self.store.update_attempt(self.name, n, state="RUNNING", running_at=now)
                self.last_progress_at = now
                self.transition("RUNNING", f"attempt {n} running")
            # heartbeat: a running node whose trainer stopped writing progress.json is lost
            hb = self.spec.recovery.heartbeat_timeout_seconds
            running_at = self.job_attempt_running_at(n) or now
            last_beat = float(prog["time"]) if mine and prog and isinstance(prog.get("time"), (int, float)) else running_at
            last_beat = max(last_beat, running_at)
            # Keyed on the heartbeat's time only: the trainer beats from a thread through long
            # phases (checkpoint load, first-step compile) without a step; "no step" is the
            # idle guard's business (teardown.idle_minutes, below).
            if now - last_beat > hb:
                phase = f", trainer phase {prog.get('phase')}" if mine and prog and prog.get("phase") else ""
                self._begin_recovery("lost", f"attempt {n}: no heartbeat for {now - last_beat:.0f} s "
                                             f"(recovery.heartbeat_timeout_seconds = {hb:g}{phase})")
                return
            self._guard(now, running=True)
            return
        ended = [s for s in values if s.is_terminal]
        if not ended:  # PENDING (provisioning) or a mix with RUNNING
            if self.recovery_started is not None:
                self._check_recovery_time(now)
                if self.state != "PROVISIONING" and self.state != "RUNNING":
                    return
            self._guard(now, running=False)
            return
        self._attempt_ended(n, att, nodes, ended)

    def job_attempt_running_at(self, n: int) -> float | None:
        a = self.store.get_attempt(self.name, n)
        return a["running_at"] if a else None

    def _attempt_ended(self, n: int, att: dict, nodes: list[dict], ended: list[NodeState]) -> None:
        wd = self._watchdog_reason(att)
        lost = self._node_lost(n) if NodeState.FAILED in ended and wd is None else None
        if lost:
            self._begin_recovery("preempted", f"attempt {n}: preempted: {lost}")
            return
        if NodeState.FAILED in ended:
            code = self._exit_code(att)
            tail = self._log_tail(nodes)
            if code == EXIT_BAD_CONFIG:
                self._fail_now(n, f"attempt {n}: the trainer rejected its configuration (exit 2); not retried", tail)
                return
            used = self.job()["restarts_used"] + 1
            self.store.update_job(self.name, restarts_used=used)
            limit = self.spec.recovery.max_restarts_on_errors
            if used > limit:
                self._fail_now(n, f"attempt {n}: the trainer failed ({used} failures, "
                                  f"recovery.max_restarts_on_errors = {limit})", tail)
                return
            self.event("failed", f"attempt {n}: the trainer failed; restart {used} of {limit}"
                                 + (f"\n{tail}" if tail else ""))
            self._begin_recovery("failed", f"attempt {n}: trainer failed (restart {used}/{limit})")
            return
        if wd in ("budget", "deadline"):
            self._end_attempt(n, "watchdog", f"the node's watchdog stopped it: {wd}")
            self._begin_stop("OVER_BUDGET", f"{wd}: the node's watchdog stopped the run", write_stop=False)
            return
        if wd == "restart":
            # The node checkpointed before the provider's own timeout (Modal's 24 h cap) and asked
            # to be resumed: relaunch at once, not a preemption, no backoff.
            self._begin_recovery("planned_restart", f"attempt {n}: planned restart before the provider's "
                                                    f"timeout (the node checkpointed)", planned=True)
            return
        if wd == "idle":
            self._end_attempt(n, "watchdog", "the node's watchdog stopped it: idle")
            self._begin_stop("FAILED", "idle: the node's watchdog saw no progress", write_stop=False)
            return
        if NodeState.SUCCEEDED in ended and all(s == NodeState.SUCCEEDED for s in ended):
            # Exit 0 without DONE: a STOP was honoured (not ours: we are not stopping) → resume.
            self._begin_recovery("stopped", f"attempt {n}: the trainer stopped without DONE"
                                 + (f" (watchdog: {wd})" if wd else ""))
            return
        if NodeState.TERMINATED in ended:
            self._begin_recovery("lost", f"attempt {n}: the node was terminated outside this controller")
            return
        why = self._end_reasons(nodes)
        self._begin_recovery("preempted", f"attempt {n}: preempted" + (f" (watchdog: {wd})" if wd else "")
                             + (f": {why}" if why else ""))

    def _node_lost(self, n: int) -> str | None:
        """Several nodes: did the cluster's job fail because one of its nodes was lost rather than
        because the trainer failed? Yes when a node's own record says it exited 75 ("resume me":
        its peer was gone), none says another non-zero exit (76, a watchdog stop, has its own
        path), and a node never reported its exit (it vanished with its machine). SkyPilot reports
        such a job FAILED, without the exit marker, when its job driver sees a node's task die
        before the survivors' exit reaches the log (seen on the emulated Lambda cloud): counted as
        a trainer failure, preemptions would use up ``recovery.max_restarts_on_errors``. Returns
        what happened, or None."""
        if self.spec.resources.nodes < 2:
            return None
        try:
            recs = runuri.node_records(self.run_uri, n)
        except OSError:
            return None
        exited = {r.get("rank"): r.get("exit_code") for r in recs if r.get("state") == "EXITED"}
        if any(c not in PREEMPT_EXIT_CODES and c != 0 for c in exited.values()):
            return None  # a node's own failure: the trainer failed
        resumers = sorted(r for r, c in exited.items() if c == runuri.EXIT_PREEMPTED)
        silent = [r for r in range(self.spec.resources.nodes) if r not in exited]
        if not resumers or not silent:
            return None
        return (f"node {', '.join(map(str, silent))} of {self.spec.resources.nodes} stopped reporting (lost); "
                f"node {', '.join(map(str, resumers))} exited {exited[resumers[0]]} (resume me)")

    def _end_reasons(self, nodes: list[dict]) -> str:
        """What the providers say ended these nodes (Modal: an eviction), joined; '' if nothing."""
        out: list[str] = []
        for nd in nodes:
            try:
                why = self.provider(nd["provider"]).end_reason(Handle.from_dict(nd["handle"]))
            except perr.ProviderError:
                why = None
            if why and why not in out:
                out.append(why)
        return "; ".join(out)

    def _watchdog_reason(self, att: dict) -> str | None:
        try:
            wd = runuri.read_json(runuri.join(self.run_uri, WATCHDOG))
        except OSError:
            return None
        if not isinstance(wd, dict):
            return None
        t = wd.get("time")
        if isinstance(t, (int, float)) and att.get("launched_at") and t < att["launched_at"] - 1:
            return None  # from an earlier attempt
        r = wd.get("reason")
        return r if isinstance(r, str) else None

    def _exit_code(self, att: dict) -> int | None:
        lp = att.get("log_path")
        if not lp:
            return None
        try:
            return int(Path(lp + ".exit").read_text().strip())
        except (OSError, ValueError):
            return None

    def _log_tail(self, nodes: list[dict], lines: int = 15) -> str:
        out = []
        for nd in nodes:
            try:
                text = self.provider(nd["provider"]).logs(Handle.from_dict(nd["handle"]), tail=lines)
            except perr.ProviderError:
                text = ""
            if not text and nd["handle"].get("data", {}).get("log_path"):
                try:
                    text = "\n".join(Path(nd["handle"]["data"]["log_path"]).read_text(errors="replace")
                                     .splitlines()[-lines:])
                except OSError:
                    text = ""
            if text:
                out.append(text.rstrip())
        return "\n".join(out)

    def _sync_cluster(self, n: int) -> None:
        """Several nodes: copy each node's record (``nodes/a<n>/node-<r>.json``) into the attempt."""
        if self.spec.resources.nodes < 2:
            return
        try:
            recs = runuri.node_records(self.run_uri, n)
        except OSError:
            return
        if recs and recs != self._cluster_seen.get(n):
            self._cluster_seen[n] = recs
            self.store.update_attempt(self.name, n, nodes_json=json.dumps(recs))

    def _end_attempt(self, n: int, outcome: str, reason: str) -> None:
        a = self.store.get_attempt(self.name, n)
        if a and a["state"] == "ENDED":
            return
        self._sync_cluster(n)
        self.store.update_attempt(self.name, n, state="ENDED", outcome=outcome, reason=reason, ended_at=self.now(),
                                  end_step=self.job()["step"])

    def _fail_now(self, n: int, reason: str, tail: str) -> None:
        self._end_attempt(n, "failed", reason)
        tail = tail.strip("\n")
        full = reason + (f"; last trainer log lines:\n{tail}" if tail.strip()
                         else "; the node left no trainer log lines (nothing was read from its log)")
        self._begin_stop("FAILED", full, write_stop=False)

    def _begin_recovery(self, outcome: str, reason: str, planned: bool = False) -> None:
        now = self.now()
        att = self.current_attempt()
        if att:
            self._end_attempt(att["n"], outcome, reason)
        # Work lost: steps trained past the newest committed checkpoint.
        job = self.job()
        committed = self._latest_committed_step() or 0
        lost = max(0, (job["step"] or 0) - committed)
        if lost:
            self.store.update_job(self.name, steps_lost=(job["steps_lost"] or 0) + lost)
        if self.strategy is None:
            self._make_strategy()
        if planned:
            delay = 0.0
        else:
            delay = self.strategy.ended() if self.strategy else self.spec.recovery.backoff_seconds
        self.next_launch_at = now + delay
        self.recovery_started = self.recovery_started or now
        self.event(outcome, reason + (f"; {lost} steps lost" if lost else ""))
        self.transition("RECOVERING", reason)
        self._terminate_nodes()

    # ---- recovering ----------------------------------------------------------------------------
    def _check_recovery_time(self, now: float) -> bool:
        lim = self.spec.recovery.max_recovery_minutes
        if self.recovery_started is not None and now - self.recovery_started > lim * 60:
            self._give_up(f"no node running for {(now - self.recovery_started) / 60:.1f} min "
                          f"(recovery.max_recovery_minutes = {lim:g})")
            return True
        return False

    def _give_up(self, reason: str) -> None:
        self.event("give_up", reason)
        self._begin_stop("FAILED", reason, write_stop=False)

    def _recover(self, now: float) -> None:
        if not self._terminate_nodes():
            return  # remnants not confirmed gone yet: retry next tick
        self._sweep_if_due()
        if self._check_recovery_time(now):
            return
        if self.guard_recovering(now):
            return
        if now < self.next_launch_at:
            return
        self._launch(now)

    def guard_recovering(self, now: float) -> bool:
        job = self.job()
        if job["deadline"] is not None and now + self.poll + self.stop_grace >= job["deadline"]:
            self._finish("OVER_BUDGET", f"deadline: budget.max_hours ({self.spec.budget.max_hours:g} h) reached")
            return True
        return False

    # ---- terminating ---------------------------------------------------------------------------
    def _terminate_nodes(self) -> bool:
        """Terminate every live node of the job; True once all are confirmed gone (a launch still
        in flight is cancelled first: see :meth:`_cancel_in_flight`)."""
        all_gone = self._cancel_in_flight() and not self._late_terminates_pending()
        for nd in self.store.nodes(self.name, live_only=True):
            now = self.now()
            if nd["terminate_requested"] is None:
                self.store.update_node(nd["id"], terminate_requested=now)
            try:
                self.provider(nd["provider"]).terminate(Handle.from_dict(nd["handle"]))
            except perr.ProviderError as e:
                # TerminateNotConfirmed, Transient, or anything else: never record it gone
                # before the provider says so; try again next tick.
                self.event("terminate", f"{nd['name']}: not confirmed gone yet ({type(e).__name__}: {e}); retrying")
                all_gone = False
                continue
            t = self.now()
            self.store.update_node(nd["id"], terminated_at=t, state=NodeState.TERMINATED.value)
            if not [x for x in self.store.nodes(self.name, live_only=True) if x["attempt"] == nd["attempt"]]:
                self.store.book_spend(self.name, nd["attempt"], t, close=True)
            self.event("terminate", f"{nd['name']} ({nd['instance_id']}) terminated (confirmed)")
        return all_gone

    def _cancel_in_flight(self) -> bool:
        """Cancel the launch in flight, if any; True once nothing of it is left to wait for.

        Whatever it has created so far (found by its deterministic name through
        ``provider.list_owned``) is recorded as the attempt's nodes, billed from the launch
        request, and terminated by the ordinary path (confirmed). A launch that returns is
        recorded the same way. One that has not returned ``stop_grace`` seconds after the cancel
        is abandoned: its worker terminates what it returns later, and the orphan sweep runs."""
        inf = self.inflight
        if inf is None:
            return True
        now = self.now()
        prov = self.provider(inf.offer.provider)
        if inf.cancelled_at is None:
            inf.cancelled_at = now
            self.event("cancel", f"attempt {inf.n}: launch in flight on {inf.offer.key()} cancelled; "
                                 f"terminating what it created ({inf.request.instance_name})")
            try:
                prov.cancel_launch(inf.request.instance_name)  # create nothing more (Modal: after the build)
            except perr.ProviderError as e:
                self.event("warning", f"attempt {inf.n}: could not cancel the launch in flight "
                                      f"({type(e).__name__}: {e}); terminating what it creates")
        if inf.done.is_set():
            self.inflight = None
            if inf.handle is not None and inf.handle.instance_id not in inf.adopted:
                self._adopt(inf, inf.handle)
            else:
                self._end_attempt(inf.n, "cancelled", "cancelled while launching"
                                  + (f" ({describe_error(inf.error)})" if inf.error else ""))
            return True
        try:
            owned = [o for o in prov.list_owned(inf.request.instance_name) if inf.matches(o)]
        except perr.ProviderError as e:
            self.event("warning", f"attempt {inf.n}: could not list what the launch created "
                                  f"({type(e).__name__}: {e}); retrying")
            owned = []
        for o in owned:
            if o.instance_id not in inf.adopted:
                self._adopt(inf, Handle(provider=inf.offer.provider, name=o.name, instance_id=o.instance_id,
                                        region=o.region, launched_at=inf.t0))
        if now - inf.cancelled_at >= self.stop_grace:
            self.inflight = None
            self._abandoned.append(inf)
            inf.abandon(now)  # a late terminate runs on the launch's worker or a cleanup thread
            self._sweep_due = True
            self.event("warning", f"attempt {inf.n}: the cancelled launch has not returned after "
                                  f"{now - inf.cancelled_at:.0f} s; no longer waiting (what it returns is "
                                  f"terminated off the loop; the orphan sweep runs)")
            if not inf.adopted:
                self._end_attempt(inf.n, "abandoned", "cancelled while launching; the launch was abandoned "
                                  "(its provisioning is booked from the request: an upper bound)")
            return True
        return False

    def _late_terminates_pending(self) -> bool:
        """An abandoned launch returned an instance whose terminate (off the loop) is still being
        retried: the job is not recorded finished before it is confirmed or given up on."""
        return any(i.terminating for i in self._abandoned)

    def _adopt(self, inf: LaunchInFlight, handle: Handle) -> None:
        """Record an instance of the launch in flight as its attempt's node (billed from the
        launch request) so the ordinary terminate path ends it and books its spend."""
        inf.adopted.add(handle.instance_id)
        self.store.add_node(self.name, inf.n, handle.to_dict(), self.now())
        self.store.open_spend(self.name, inf.n, inf.price_per_hour, inf.t0)
        self.store.update_attempt(self.name, inf.n, state="PENDING", launched_at=inf.t0)
        self.event("launch", f"attempt {inf.n}: {handle.name} ({handle.instance_id}) found while cancelling "
                             f"its launch", {"attempt": inf.n, "instance_id": handle.instance_id,
                                            "provider": inf.offer.provider})

    # ---- stopping ------------------------------------------------------------------------------
    def _cancel(self, now_: bool) -> None:
        state = self.state
        if state == "STOPPING":
            if now_:
                self.store.update_job(self.name, stop_now=1)
                self.event("cancel", "down --now: terminating without waiting for the checkpoint")
            return
        self.event("cancel", "down requested" + (" (--now)" if now_ else ""))
        self._begin_stop("CANCELLED", "cancelled by `dtrun down`" + (" --now" if now_ else ""), hard=now_)

    def _begin_stop(self, target: str, reason: str, hard: bool = False, write_stop: bool = True) -> None:
        now = self.now()
        live = self.store.nodes(self.name, live_only=True)
        self.transition("STOPPING", reason, stop_target=target, stop_reason=reason, stop_started=now,
                        stop_now=int(hard))
        if write_stop and not hard and live:
            try:
                runuri.write_text(runuri.join(self.run_uri, runuri.STOP), f"{reason}\n")
            except OSError as e:
                self.event("warning", f"could not write STOP ({e}); terminating without a checkpoint")
                self.store.update_job(self.name, stop_now=1)

    def _stopping(self, now: float) -> None:
        job = self.job()
        live = self.store.nodes(self.name, live_only=True)
        if live and not job["stop_now"]:
            states = self._poll_nodes(live)
            exited = states is not None and all(s.is_terminal for s in states.values())
            waited = now - (job["stop_started"] or now)
            why = self.guard.must_terminate_now(now=now, spent=self.spent(now),
                                                burn_per_hour=self.burn_per_hour(), deadline=job["deadline"])
            if not exited and waited < self.stop_grace and why is None:
                return
            if why:
                self.event("guard", f"terminating now: {why}")
            elif not exited:
                self.event("stop", f"no exit within {self.stop_grace:.0f} s of STOP: terminating")
        if not self._terminate_nodes():
            return
        target, reason = job["stop_target"] or "CANCELLED", job["stop_reason"]
        if target != "SUCCEEDED" and self._done() is not None:
            target, reason = "SUCCEEDED", f"training finished (DONE) while stopping for: {reason}"
        self._finish(target, reason)

    def _sweep_if_due(self) -> None:
        if self._sweep_due:
            self._sweep_due = False
            self._sweep_orphans()

    def _finish(self, target: str, reason: str | None) -> None:
        if not self._terminate_nodes():
            self.transition("STOPPING", reason, stop_target=target, stop_reason=reason,
                            stop_started=self.now(), stop_now=1)
            return
        self._sweep_if_due()
        self._book_abandoned(final=True)
        now = self.now()
        att = self.current_attempt()
        if att and att["state"] != "ENDED":
            self._end_attempt(att["n"], {"SUCCEEDED": "succeeded", "CANCELLED": "cancelled",
                                         "OVER_BUDGET": "over_budget"}.get(target, "failed"), reason or target)
        self._book_spend(now)
        if target == "SUCCEEDED":
            done = self._done() or {}
            cols: dict[str, Any] = {}
            if isinstance(done.get("step"), int):
                cols["step"] = done["step"]
            if done.get("loss") is not None:
                cols["loss"] = done["loss"]
            if cols:
                self.store.update_job(self.name, **cols)
        self.transition(target, reason)
        s = self.summary()
        self.event("summary", f"{target}: wall {s['wall_s']:.0f} s, cost ${s['cost_usd']:.4f}, "
                              f"{s['attempts']} attempt(s), {s['steps_lost']} steps lost to preemptions", s)

    # ---- reporting -----------------------------------------------------------------------------
    def summary(self) -> dict:
        job = self.job()
        atts = self.session_attempts()
        start = job["started_at"] or job["created"]
        end = job["finished_at"] or self.now()
        return {"name": self.name, "state": job["state"], "reason": job["reason"],
                "wall_s": max(0.0, end - start), "cost_usd": self.store.spend_total(self.name),
                "attempts": len(atts), "steps_lost": job["steps_lost"] or 0, "step": job["step"],
                "steps": job["steps"]}


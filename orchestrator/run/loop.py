"""The loop: tick a controller until its job reaches a final state, surviving bad ticks.

Ticks start every poll interval (not a poll interval after the last one ended), so an event is
seen at most one poll interval after it happened. A tick that raises an unexpected exception (a
provider SDK bug, a full disk) is recorded as a ``controller_error`` event (type and first line of
the message, secrets masked) and retried after a backoff: one poll interval, doubling, capped at
60 s (or the poll interval if longer). Every transition is committed before it is acted on, so a
retried tick picks up where the failed one stopped. ``MAX_TICK_FAILURES`` failures in a row → a
``controller_exit`` event and :class:`ControllerGaveUp`; the nodes are left running under their
own watchdogs, none is recorded terminated.

Every end of a controller that owned its job is an event: ``controller_done`` when the job reached
a final state; ``controller_exit`` when the job goes on without this controller — an exception
ended the loop (``crashed``), it gave up (above), or its caller says so through :func:`record_exit`
after a pause (``should_pause`` is not an exit by itself): detached after SIGHUP or Ctrl-C,
exited on a signal (``orchestrator.cli.foreground`` / ``orchestrator.cli.detached``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from orchestrator.contract.errors import DtrunError
from orchestrator.run.clock import RealClock
from orchestrator.run.context import describe_error
from orchestrator.run.startup import ControllerBusy
from orchestrator.run.state import TERMINAL_STATES

Controller = Any
"""``orchestrator.run.controller.Controller`` (not imported: it imports this module)."""

MAX_TICK_FAILURES = 20
"""Consecutive ticks that raised an unexpected exception after which the controller gives up."""
TICK_BACKOFF_CAP_SECONDS = 60.0


class ControllerGaveUp(DtrunError):
    """``MAX_TICK_FAILURES`` ticks in a row raised: the controller exits (exit 1) and leaves the
    nodes to their own watchdogs (budget, deadline, lease, idle); nothing is recorded terminated.
    ``dtrun up`` of the job re-attaches; ``dtrun down`` stops it."""


def run(ctl: Controller, should_pause: Callable[[], bool] | None = None,
        on_tick: Callable[[Controller], None] | None = None) -> str:
    """Start ``ctl`` and tick it until a final state (returned); ``should_pause`` returning True
    makes it return "INTERRUPTED" at the next tick boundary with everything committed."""
    try:
        ctl.start()
    except BaseException:
        ctl.teardown.close_providers()  # the orphan sweep may have used (and started) them
        raise
    failures = 0
    state = None
    try:
        while True:
            started = ctl.now()
            try:
                state = ctl.tick()
                if on_tick:
                    on_tick(ctl)
            except (ControllerBusy, ControllerGaveUp):
                raise
            except Exception as e:  # noqa: BLE001 - one bad tick must not end recovery
                failures += 1
                delay = tick_failed(ctl, e, failures)
            else:
                failures = 0
                if state in TERMINAL_STATES:
                    return state
                delay = next_delay(ctl, state)
            wake = started + delay
            while True:
                if should_pause and should_pause():
                    return "INTERRUPTED"
                left = wake - ctl.now()
                if left <= 0:
                    break
                ctl.clock.sleep(min(0.2, left) if isinstance(ctl.clock, RealClock) else left)
    except (ControllerBusy, ControllerGaveUp):
        raise  # not this controller's run / already recorded (tick_failed)
    except BaseException as e:
        record_exit(ctl, "crashed", f"controller (pid {ctl.pid}) crashed: {describe_error(e)}; the nodes keep "
                    f"running under their own watchdogs: `dtrun up` of the job re-attaches, "
                    f"`dtrun down {ctl.name}` stops it", type=type(e).__name__)
        raise
    finally:
        if ctl.state in TERMINAL_STATES or (should_pause and should_pause()):
            ctl.store.release_controller(ctl.name, ctl.pid)
        ctl.teardown.close_providers()
        if state in TERMINAL_STATES:
            ctl.ctx.safe_event("controller_done", f"controller (pid {ctl.pid}) finished: {state}",
                               {"how": "finished", "pid": ctl.pid, "state": state})


def record_exit(ctl: Controller, how: str, message: str, **data: Any) -> None:
    """The ``controller_exit`` event of ``ctl``: the job goes on without it (``how``: crashed,
    gave_up, detached, signalled, unwatched); never raises."""
    ctl.ctx.safe_event("controller_exit", message, {"how": how, "pid": ctl.pid, **data})


def tick_failed(ctl: Controller, e: Exception, failures: int) -> float:
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
                  f"`dtrun up` of the job re-attaches, `dtrun down {ctl.name}` stops it")
        record_exit(ctl, "gave_up", reason, **data)
        try:
            ctl.store.release_controller(ctl.name, ctl.pid)
        except Exception:  # noqa: BLE001 - the store may be what is broken
            pass
        raise ControllerGaveUp(reason) from e
    delay = min(ctl.poll * 2 ** (failures - 1), max(TICK_BACKOFF_CAP_SECONDS, ctl.poll))
    ctl.ctx.safe_event("controller_error", f"tick failed ({failures} in a row, giving up at "
                                           f"{MAX_TICK_FAILURES}): {what}; retrying in {delay:.0f} s", data)
    return delay


def next_delay(ctl: Controller, state: str) -> float:
    """Seconds until the next tick: one poll, except that a pending launch (PENDING, or
    RECOVERING with every remnant confirmed gone) waits only for its backoff."""
    if state == "PENDING":
        return 0.0
    if state == "RECOVERING" and not ctl.store.nodes(ctl.name, live_only=True):
        return min(ctl.poll, max(0.0, ctl.recovery.next_launch_at - ctl.now()))
    return ctl.poll

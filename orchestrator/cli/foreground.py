"""``dtrun up`` in the foreground: the controller in this process under a live view (rich on a
terminal, plain lines otherwise); the summary line at the end.

Signals, each one ``controller_exit`` or ``cancel`` event that names it:

* Ctrl-C (SIGINT) asks whether to detach, tear down (checkpoint, then terminate), terminate now
  or continue; without a terminal it tears down gracefully, a second one terminates at once.
* SIGHUP (the terminal was closed) hands the run to a detached controller
  (``orchestrator.cli.detached``), as "detach" does: the run stays watched.
* SIGTERM tears down gracefully (the reason says SIGTERM, not ``dtrun down``); a second signal
  terminates at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.run.state import StateStore

SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


def stop(ctl, who: str, now: bool) -> None:
    """Tear ``ctl``'s job down (``now``: without the final checkpoint) because of ``who`` (a signal):
    what ``dtrun down`` asks for, said as what happened."""
    from orchestrator.run.state import TERMINAL_STATES

    ctx = ctl.ctx
    if ctl.state in TERMINAL_STATES:
        return
    if ctl.state == "STOPPING":
        if now:
            ctx.store.update_job(ctx.name, stop_now=1)
            ctx.event("cancel", f"{who} again: terminating without waiting for the checkpoint")
        return
    how = "terminating at once, no final checkpoint" if now else "checkpoint, then terminate"
    ctx.event("cancel", f"{who} to `dtrun up` (pid {os.getpid()}): tearing down ({how})")
    ctl.teardown.begin_stop("CANCELLED", f"cancelled by {who} to `dtrun up`" + (" (at once)" if now else ""),
                            hard=now)


def _off_the_terminal(name: str) -> None:
    """The terminal is gone: stdout/stderr go to the job's controller log from now on, so nothing
    written later fails (EIO) and what is said can still be read."""
    from orchestrator.run.state import dtrun_home

    try:
        logdir = dtrun_home() / "logs" / name
        logdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(logdir / "controller.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
    for std in (1, 2):  # a hung-up terminal may no longer even answer isatty(): move both
        try:
            os.dup2(fd, std)
        except OSError:
            pass
    os.close(fd)


def hand_over(ctl, store: StateStore, name: str, why: str) -> int:
    """Start a detached controller for the job (this one has released it); the exit code. The
    ``controller_exit`` event says which controller watches the run now, or that none does."""
    from orchestrator.cli.detached import spawn
    from orchestrator.contract.errors import EXIT_OK, DtrunError
    from orchestrator.run.loop import record_exit

    try:
        pid = spawn(store, name, ["--job", name])
    except DtrunError as e:
        record_exit(ctl, "unwatched", f"{why}: the detached controller did not start ({e}); no controller watches "
                    f"the run — the nodes guard themselves (budget, deadline): `dtrun up` of the job "
                    f"re-attaches, `dtrun down {name}` stops it")
        raise
    record_exit(ctl, "detached", f"{why}: the foreground controller (pid {ctl.pid}) handed the run to a detached "
                f"controller (pid {pid})", detached_pid=pid)
    print(f"{name}: detached; controller pid {pid}. "
          f"dtrun status {name} / dtrun logs {name} -f / dtrun down {name}", flush=True)
    return EXIT_OK


def run_foreground(spec, plan, store: StateStore, spec_path: str, json_out: bool) -> int:
    """Run the job here to a final state (or until detached); the exit code."""
    from orchestrator.cli.jobs import _ask, _fmt_wall, _tty_in, _tty_out, job_status
    from orchestrator.cli.live import PlainView, RichView
    from orchestrator.contract.errors import EXIT_JOB_FAILED, EXIT_OK
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import TERMINAL_STATES

    tty = _tty_out() and not json_out
    view = RichView(store, spec.name, budget=spec.budget.max_usd) if tty else PlainView(store, spec.name, out=sys.stderr if json_out else None)
    ctl = Controller(spec, store, plan=plan, spec_path=spec_path, on_event=view.event)
    flag = {"n": 0, "last": None, "hup": False}

    def _sig(signum, frame):
        if signum == signal.SIGHUP:
            if not flag["hup"]:
                flag["hup"] = True
                ctl.ctx.on_event = None  # nothing to show it to any more
                _off_the_terminal(spec.name)
            return
        flag["n"] += 1
        flag["last"] = signum

    old = {s: signal.signal(s, _sig) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        with view:
            state = ctl.run(should_pause=lambda: flag["n"] > 0 or flag["hup"], on_tick=view.update)
        while state == "INTERRUPTED":
            who = SIGNAL_NAMES.get(flag["last"], "a signal")
            choice = "t"
            if not flag["hup"] and flag["last"] == signal.SIGINT and _tty_in() and not json_out:
                flag["n"] = 0
                signal.signal(signal.SIGINT, old[signal.SIGINT])
                try:
                    choice = _ask("\nInterrupted. [d]etach (keep running in the background), "
                                  "[t]ear down (checkpoint, then terminate), [n]ow (terminate at once), "
                                  "[c]ontinue? ") or "t"
                except KeyboardInterrupt:
                    choice = "n"
                except OSError:  # the terminal went away while asking
                    choice = "d"
                signal.signal(signal.SIGINT, _sig)
            elif not flag["hup"]:
                view.line(f"{who} without a terminal to ask: tearing down gracefully "
                          "(checkpoint, then terminate; signal again to terminate at once)")
            if flag["hup"]:
                return hand_over(ctl, store, spec.name, "the terminal was closed (SIGHUP)")
            flag["n"] = 0
            if choice.startswith("d"):
                return hand_over(ctl, store, spec.name, "detached at Ctrl-C")
            if choice.startswith("t") or choice.startswith("n"):
                stop(ctl, who, now=choice.startswith("n"))

            def pause() -> bool:
                if flag["n"] > 0:
                    stop(ctl, SIGNAL_NAMES.get(flag["last"], "a signal"), now=True)
                    flag["n"] = 0
                return False  # a closed terminal (SIGHUP) changes nothing: the teardown goes on

            with view:
                state = ctl.run(should_pause=pause if not choice.startswith("c")
                                else (lambda: flag["n"] > 0 or flag["hup"]), on_tick=view.update)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if ctl.started and ctl.state not in TERMINAL_STATES:
            store.release_controller(spec.name)
    s = ctl.summary()
    job = store.get_job(spec.name) or {}
    summary = (f"{state}: wall {_fmt_wall(s['wall_s'])}, cost ${s['cost_usd']:.4f}, {s['attempts']} attempt(s), "
               f"{s['steps_lost']} steps lost to preemptions, step {s['step']}/{s['steps']}")
    if json_out:
        sys.stdout.write(json.dumps(job_status(store, job)) + "\n")
        sys.stderr.write(summary + "\n")
    else:
        print(summary)
        if state != "SUCCEEDED" and job.get("reason"):
            print(f"reason: {job['reason']}")
    return EXIT_OK if state == "SUCCEEDED" else EXIT_JOB_FAILED

"""``dtrun up`` in the foreground: the controller in this process under a live view (rich on a
terminal, plain lines otherwise); Ctrl-C asks whether to detach, tear down (checkpoint, then
terminate), terminate now or continue (without a terminal: tear down gracefully); the summary
line at the end."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.run.state import StateStore


def run_foreground(spec, plan, store: StateStore, spec_path: str, json_out: bool) -> int:
    """Run the job here to a final state (or until detached); the exit code."""
    import signal

    from orchestrator.cli.detached import spawn
    from orchestrator.cli.jobs import _ask, _fmt_wall, _tty_in, _tty_out, job_status
    from orchestrator.cli.live import PlainView, RichView
    from orchestrator.contract.errors import EXIT_JOB_FAILED, EXIT_OK
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import TERMINAL_STATES

    tty = _tty_out() and not json_out
    view = RichView(store, spec.name) if tty else PlainView(store, spec.name, out=sys.stderr if json_out else None)
    ctl = Controller(spec, store, plan=plan, spec_path=spec_path, on_event=view.event)
    flag = {"n": 0}

    def _sigint(signum, frame):
        flag["n"] += 1

    old = signal.signal(signal.SIGINT, _sigint)
    old_term = signal.signal(signal.SIGTERM, _sigint)
    try:
        with view:
            state = ctl.run(should_pause=lambda: flag["n"] > 0, on_tick=view.update)
        while state == "INTERRUPTED":
            choice = "t"
            if _tty_in() and not json_out:
                flag["n"] = 0
                signal.signal(signal.SIGINT, old)
                try:
                    choice = _ask("\nInterrupted. [d]etach (keep running in the background), "
                                  "[t]ear down (checkpoint, then terminate), [n]ow (terminate at once), "
                                  "[c]ontinue? ") or "t"
                except KeyboardInterrupt:
                    choice = "n"
                signal.signal(signal.SIGINT, _sigint)
            else:
                view.line("interrupted without a terminal: tearing down gracefully "
                          "(checkpoint, then terminate; interrupt again to terminate at once)")
            flag["n"] = 0
            if choice.startswith("d"):
                pid = spawn(store, spec.name, ["--job", spec.name])
                print(f"{spec.name}: detached; controller pid {pid}. "
                      f"dtrun status {spec.name} / dtrun logs {spec.name} -f / dtrun down {spec.name}")
                return EXIT_OK
            if choice.startswith("t") or choice.startswith("n"):
                store.request_action(spec.name, "stop_now" if choice.startswith("n") else "stop")

            def pause() -> bool:
                if flag["n"] > 0:
                    store.request_action(spec.name, "stop_now")
                    flag["n"] = 0
                return False

            with view:
                state = ctl.run(should_pause=pause if not choice.startswith("c") else (lambda: flag["n"] > 0),
                                on_tick=view.update)
    finally:
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGTERM, old_term)
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

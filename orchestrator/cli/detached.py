"""The detached controller: ``python -m orchestrator.cli.detached (--spec JOB.yaml | --job NAME)``.

``dtrun up --detach`` (and "detach" after Ctrl-C) starts this in its own session with stdout and
stderr going to ``$DTRUN_HOME/logs/<job>/controller.log``. It prints plain lines. SIGTERM/SIGINT
make it exit at the next tick boundary *without* touching the nodes (they guard themselves; a
later ``dtrun up`` of the same job re-attaches); ``dtrun down`` is how to stop the job.
"""

from __future__ import annotations

import argparse
import signal
import sys

from orchestrator.contract.errors import EXIT_JOB_FAILED, EXIT_OK, DtrunError


def load_stored_spec(store, name: str):
    import yaml

    from orchestrator.contract.errors import NotFoundError
    from orchestrator.plan.spec import parse_spec

    job = store.get_job(name)
    if job is None:
        raise NotFoundError(f"no job named {name!r} in {store.path}")
    return parse_spec(yaml.safe_load(job["spec_yaml"]), source=f"{store.path} (job {name})"), job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.cli.detached")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--spec", help="job YAML (a new run, or continue it)")
    g.add_argument("--job", help="job name in the state store (re-attach)")
    ap.add_argument("--force", action="store_true", help="run auto's smallest plan even if it does not fit memory")
    args = ap.parse_args(argv)

    from orchestrator.cli.live import PlainView
    from orchestrator.plan.spec import load_spec
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import StateStore

    stop = {"flag": False}

    def _sig(signum, frame):
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _sig)
    signal.signal(signal.SIGINT, _sig)
    try:
        store = StateStore()
        if args.spec:
            spec, path = load_spec(args.spec), args.spec
            if args.force:
                from orchestrator.plan.planner import resolve_parallel

                spec = resolve_parallel(spec, force=True)
        else:
            spec, job = load_stored_spec(store, args.job)
            path = job["spec_path"]
        view = PlainView(store, spec.name)
        ctl = Controller(spec, store, spec_path=path, on_event=view.event)
        view.line(f"controller for {spec.name} started")
        state = ctl.run(should_pause=lambda: stop["flag"], on_tick=view.update)
    except DtrunError as e:
        print(f"dtrun: {e}", file=sys.stderr)
        return e.exit_code
    if state == "INTERRUPTED":
        view.line("controller signalled: exiting; the nodes keep running (re-attach with `dtrun up`)")
        return EXIT_OK
    s = ctl.summary()
    view.line(f"{state}: wall {s['wall_s']:.0f} s, cost ${s['cost_usd']:.4f}, {s['attempts']} attempt(s), "
              f"{s['steps_lost']} steps lost to preemptions")
    return EXIT_OK if state == "SUCCEEDED" else EXIT_JOB_FAILED


if __name__ == "__main__":
    sys.exit(main())

"""The detached controller: ``python -m orchestrator.cli.detached (--plan PLAN.json | --spec JOB.yaml | --job NAME)``,
and :func:`spawn`, which starts it.

``dtrun up --detach`` writes the plan the user confirmed (``orchestrator.run.prepare``) and starts
this with ``--plan``: the controller launches that plan — the same resolved spec, estimate, offer
and checkpoint interval — without planning again; if it cannot (the record is gone, the offer is
no longer sold) it plans once more and a ``plan`` event says why. "Detach" after Ctrl-C starts it
with ``--job`` (re-attach: the job's recorded spec, its plan when the record is that spec's).
``--spec`` plans a job file here (the same prepare step).

It runs in its own session with stdout and stderr going to ``$DTRUN_HOME/logs/<job>/controller.log``
and prints plain lines. SIGTERM/SIGINT/SIGHUP make it exit at the next tick boundary *without*
touching the nodes (they guard themselves; a later ``dtrun up`` of the same job re-attaches), and a
``controller_exit`` event names the signal; ``dtrun down`` is how to stop the job.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from orchestrator.contract.errors import EXIT_JOB_FAILED, EXIT_OK, DtrunError


def load_stored_spec(store, name: str):
    import yaml

    from orchestrator.contract.errors import NotFoundError
    from orchestrator.plan.spec import parse_spec

    job = store.get_job(name)
    if job is None:
        raise NotFoundError(f"no job named {name!r} in {store.path}")
    return parse_spec(yaml.safe_load(job["spec_yaml"]), source=f"{store.path} (job {name})"), job


def spawn(store, name: str, args: list[str]) -> int:
    """Start ``python -m orchestrator.cli.detached ARGS`` in its own session; its pid once it
    has claimed the job (or raise with its log's tail if it died first)."""
    import os
    import subprocess
    import time

    from orchestrator.run.state import dtrun_home

    logdir = dtrun_home() / "logs" / name
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / "controller.log"
    env = dict(os.environ, DTRUN_CONTROLLER_LOG=str(log))
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.detached", *args],
                                stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, cwd=os.getcwd())
    deadline = time.time() + 30
    while time.time() < deadline:
        row = store.get_job(name)
        if row and row["controller_pid"] == proc.pid:
            return proc.pid
        rc = proc.poll()
        if rc is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-10:])
            err = DtrunError(f"the detached controller exited ({rc}) before starting:\n{tail}")
            err.exit_code = rc if rc in (2, 3, 4, 5, 6) else EXIT_JOB_FAILED
            raise err
        time.sleep(0.1)
    return proc.pid


def _prepared(args: argparse.Namespace, store, get) -> tuple[Any, str | None]:
    """The plan to launch (``orchestrator.run.prepare.Prepared``) and, when it is not the one
    confirmed at ``dtrun up``, why."""
    from orchestrator.run import prepare

    if args.plan:
        return prepare.confirmed(args.plan, get)
    if args.spec:
        from orchestrator.plan.spec import load_spec

        written = load_spec(args.spec)
        if not args.force and written.trainer is not None and written.trainer.parallel == "auto":
            from orchestrator.plan.planner import resolve_parallel

            resolve_parallel(written)  # nothing fits: DoesNotFit (exit 4) unless --force
        return prepare.prepare(written, spec_path=args.spec, get=get), None
    spec, job = load_stored_spec(store, args.job)
    return prepare.confirmed(prepare.plan_path(args.job), get, spec_yaml=job["spec_yaml"], fallback=spec,
                             spec_path=job["spec_path"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.cli.detached")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--plan", help="the plan `dtrun up` confirmed (written by orchestrator.run.prepare)")
    g.add_argument("--spec", help="job YAML (a new run, or continue it), planned here")
    g.add_argument("--job", help="job name in the state store (re-attach)")
    ap.add_argument("--force", action="store_true", help="with --spec: run auto's smallest plan even if it does "
                    "not fit memory")
    args = ap.parse_args(argv)

    from orchestrator.cli.live import PlainView
    from orchestrator.run import prepare
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import StateStore
    from providers import registry

    stop: dict[str, Any] = {"flag": False, "signal": None}

    def _sig(signum, frame):
        stop["flag"] = True
        stop["signal"] = stop["signal"] or signal.Signals(signum).name

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, _sig)
    providers: dict[str, Any] = {}

    def get(name: str):
        if name not in providers:
            providers[name] = registry.get(name)
        return providers[name]

    ctl = None
    try:
        store = StateStore()
        p, why = _prepared(args, store, get)
        name = p.spec.name
        view = PlainView(store, name)
        e = p.estimate
        data = {"confirmed": why is None, "offer": p.chosen.key() if p.chosen else None,
                "cost_usd": e.cost_usd if e else None, "checkpoint_every_steps": p.checkpoint_every_steps}
        if why is None:
            why = (f"planned {args.spec}: " if args.spec else "the plan confirmed at `dtrun up`: ") + prepare.summary(p)
        store.add_event(name, "plan", why, data)
        view.event("plan", why)
        ctl = Controller(p.spec, store, providers=providers, plan=p.plan, spec_path=p.spec_path,
                         on_event=view.event)
        view.line(f"controller for {name} started")
        state = ctl.run(should_pause=lambda: stop["flag"], on_tick=view.update)
    except DtrunError as e:
        print(f"dtrun: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        if ctl is None:  # the controller closes the providers it ran with; these it never got
            for inst in providers.values():
                try:
                    inst.close()
                except Exception:  # noqa: BLE001 - closing must not hide why it stopped
                    pass
    if state == "INTERRUPTED":
        from orchestrator.run.loop import record_exit

        record_exit(ctl, "signalled", f"detached controller (pid {ctl.pid}) exited on {stop['signal']}: no "
                    f"controller watches the run — the nodes keep running under their own watchdogs "
                    f"(budget, deadline): `dtrun up` of the job re-attaches, `dtrun down {name}` stops it",
                    signal=stop["signal"])
        view.line("controller signalled: exiting; the nodes keep running (re-attach with `dtrun up`)")
        return EXIT_OK
    s = ctl.summary()
    view.line(f"{state}: wall {s['wall_s']:.0f} s, cost ${s['cost_usd']:.4f}, {s['attempts']} attempt(s), "
              f"{s['steps_lost']} steps lost to preemptions")
    return EXIT_OK if state == "SUCCEEDED" else EXIT_JOB_FAILED


if __name__ == "__main__":
    sys.exit(main())

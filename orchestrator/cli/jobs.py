"""``dtrun status``, ``ls``, ``logs``, ``down``: the jobs dtrun knows (``dtrun up`` lives in
``orchestrator/cli/up.py``, which imports this module's helpers; this module never imports it).

Exit codes are orchestrator.contract.errors': 0 done/succeeded, 1 the job ended badly, 2 bad input or a
question that cannot be asked (no terminal and no ``--yes``), 6 no such job, 130 interrupted with
nothing left running.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from orchestrator.cli.attempts import attempt_list
from orchestrator.cli.options import JsonOpt
from orchestrator.cli.statusfacts import fmt_wall as _fmt_wall
from orchestrator.cli.statusfacts import step_facts, watch_lines
from orchestrator.contract.errors import (
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    NotFoundError,
)
from orchestrator.run.state import TERMINAL_STATES, StateStore


def _err(msg: str) -> None:
    sys.stderr.write(f"dtrun: {msg}\n")
    sys.stderr.flush()


def _tty_in() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):
        return False


def _tty_out() -> bool:
    try:
        return sys.stdout.isatty()
    except (ValueError, OSError):
        return False


def _ask(prompt: str) -> str:
    sys.stdout.write(prompt)
    sys.stdout.flush()
    line = sys.stdin.readline()
    return line.strip().lower()


# ---- status --------------------------------------------------------------------------------------

def cluster_nodes(run_uri: str, att: dict | None, live: bool) -> list[dict[str, Any]]:
    """Each node of a multi-node attempt as its bootstrap reported it (rank, private IP, host,
    state, exit code, last report): read from the run URI when ``live`` (falling back to the
    controller's copy in the attempt's record). A node whose attempt ended without its
    ``EXITED`` report (the instance was taken away, or torn down while it hung) shows as GONE."""
    if att is None:
        return []
    recs: list[dict] = []
    if live:
        from orchestrator.contract import runuri

        try:
            recs = runuri.node_records(run_uri, att["n"])
        except OSError:
            recs = []
    recs = recs or att.get("cluster") or []
    if not any((r.get("nnodes") or 1) > 1 for r in recs):
        return []  # one node: its facts are the provider's node row
    out = []
    for r in recs:
        state = r.get("state")
        if att["state"] == "ENDED" and state != "EXITED":
            state = "GONE"
        out.append({"rank": r.get("rank"), "ip": r.get("ip"), "host": r.get("host"), "state": state,
                    "exit_code": r.get("exit_code"), "reported_at": r.get("updated")})
    return out


def job_status(store: StateStore, job: dict, live: bool = False) -> dict[str, Any]:
    """The JSON object ``dtrun status JOB --json`` prints (also for finished jobs); ``live``
    reads the run URI: a multi-node attempt's node records rather than the stored copy, and the
    step when the run URI is past the controller's record (``step_source`` says which)."""
    name = job["name"]
    atts = store.attempts(name)
    first = job["session_first_attempt"] or 1
    session = [a for a in atts if a["n"] >= first]
    last = atts[-1]["n"] if atts else None
    nodes = []
    for nd in store.nodes(name):
        if nd["terminated_at"] is not None and nd["attempt"] != last:
            continue
        data = nd["handle"].get("data") or {}
        row = {"provider": nd["provider"], "name": nd["name"], "instance_id": nd["instance_id"],
               "region": nd["region"], "attempt": nd["attempt"],
               "state": "TERMINATED" if nd["terminated_at"] is not None else nd["state"],
               "terminated_at": nd["terminated_at"]}
        if nd["provider"] == "local":
            row["pid"] = data.get("pid")
            row["pgid"] = data.get("pgid")
        nodes.append(row)
    alive = StateStore.controller_alive(job)
    active = job["state"] not in TERMINAL_STATES
    prog = step_facts(job, read_run_uri=live)
    est = json.loads(job["estimate_json"]) if job.get("estimate_json") else None
    start = job["started_at"]
    end = job["finished_at"] if job["state"] in TERMINAL_STATES else time.time()
    return {
        "name": name, "state": job["state"], "reason": job["reason"], "step": prog["step"],
        "step_source": prog["step_source"], "step_time": prog["step_time"], "recorded_step": job["step"],
        "steps": job["steps"], "loss": prog["loss"], "val_loss": job.get("val_loss"),
        "tokens_per_s": job["tokens_per_s"],
        "last_committed_step": prog["last_committed_step"], "steps_lost": job["steps_lost"] or 0,
        "cost_usd": round(store.spend_total(name), 6), "budget_usd": job["budget_usd"],
        "estimate_usd": est.get("cost_usd") if isinstance(est, dict) else None,
        "attempts": len(session), "attempts_total": len(atts), "attempt": last,
        "attempt_list": attempt_list(atts),  # every attempt, billed or not
        "nodes": nodes, "controller_pid": job["controller_pid"] if alive else None,
        "watched": alive if active else None,
        "gone_controller_pid": job["controller_pid"] if active and not alive else None,
        **({"run_uri_error": prog["run_uri_error"]} if "run_uri_error" in prog else {}),
        "cluster": cluster_nodes(job["run_uri"], atts[-1] if atts else None, live),
        "run_uri": job["run_uri"], "started_at": start, "finished_at": job["finished_at"],
        "wall_s": (end - start) if (start and end) else None,
    }


def cmd_status(job: str | None, json_out: bool) -> int:
    store = StateStore()
    if job is not None:
        row = store.get_job(job)
        if row is None:
            raise NotFoundError(f"no job named {job!r} (see `dtrun ls`)")
        st = job_status(store, row, live=True)
        if json_out:
            sys.stdout.write(json.dumps(st) + "\n")
            return EXIT_OK
        _print_status(st)
        return EXIT_OK
    rows = [job_status(store, r) for r in store.list_jobs()]
    if json_out:
        sys.stdout.write(json.dumps({"jobs": rows}) + "\n")
        return EXIT_OK
    if not rows:
        print("no jobs yet (start one with `dtrun up job.yaml`)")
    for st in rows:
        _print_status(st)
    return EXIT_OK


def _print_status(st: dict[str, Any]) -> None:
    step = f"{st['step'] if st['step'] is not None else 0}/{st['steps'] or '?'}"
    lines = (st["reason"] or "").splitlines()
    print(f"{st['name']}: {st['state']}" + (f" ({lines[0]})" if lines else ""))
    for line in lines[1:]:  # a FAILED reason's trainer log tail: the first line ends "last trainer log lines:"
        print(f"  | {line}")
    val = f"  val loss {st['val_loss']:.4f}" if st.get("val_loss") is not None else ""
    loss = f"{st['loss']:.4f}" if st["loss"] is not None else "—"
    print(f"  step {step}  loss {loss}{val}  "
          f"cost ${st['cost_usd']:.4f}" + (f" of ${st['budget_usd']:.2f}" if st["budget_usd"] else "")
          + f"  attempts {st['attempts']}  steps lost {st['steps_lost']}")
    for line in watch_lines(st):
        print(line)
    for n in st["nodes"]:
        extra = f" pid {n['pid']} pgid {n['pgid']}" if n.get("pid") else ""
        print(f"  node {n['name']} [{n['provider']} {n['instance_id']}] {n['state']}{extra}")
    for c in st.get("cluster") or []:
        code = f" exit {c['exit_code']}" if c.get("exit_code") is not None else ""
        when = time.strftime(" (reported %H:%M:%S)", time.localtime(c["reported_at"])) if c.get("reported_at") else ""
        print(f"    node {c['rank']}: {c['ip'] or '?'} ({c['host'] or '?'}) {c['state']}{code}{when}"
              f" — dtrun logs {st['name']} --node {c['rank']}")
    print(f"  run URI {st['run_uri']}")
    print(f"  report: dtrun report {st['name']}")


def cmd_ls(json_out: bool) -> int:
    store = StateStore()
    rows = [job_status(store, r) for r in store.list_jobs()]
    if json_out:
        sys.stdout.write(json.dumps({"jobs": rows}) + "\n")
        return EXIT_OK
    if not rows:
        print("no jobs yet (start one with `dtrun up job.yaml`)")
        return EXIT_OK
    print(f"{'NAME':<24} {'STATE':<13} {'STEP':>13} {'COST':>10} {'ATTEMPTS':>8}  CONTROLLER")
    for st in rows:
        step = f"{st['step'] if st['step'] is not None else 0}/{st['steps'] or '?'}"
        print(f"{st['name']:<24} {st['state']:<13} {step:>13} {'$' + format(st['cost_usd'], '.4f'):>10} "
              f"{st['attempts']:>8}  {st['controller_pid'] or '-'}")
    return EXIT_OK


# ---- logs ----------------------------------------------------------------------------------------

REMOTE_LOG_LINES = 10_000
LOG_POLL_SECONDS = 2.0


def _remote_log(store: StateStore, job: str, n: int, lines: int = REMOTE_LOG_LINES) -> str | None:
    """Attempt ``n``'s node output from its provider (None when it ran on this machine or no
    node was recorded). A gone node says so instead of failing."""
    from providers import registry
    from providers.base import Handle

    out = []
    nodes = [nd for nd in store.nodes(job) if nd["attempt"] == n]
    if not nodes or all(nd["provider"] in ("local", "fake") for nd in nodes):
        return None
    for nd in nodes:
        try:
            text = registry.get(nd["provider"]).logs(Handle.from_dict(nd["handle"]), tail=lines)
        except Exception as e:  # noqa: BLE001 - logs are best effort; say why they are missing
            text = f"(logs of {nd['name']} unavailable: {type(e).__name__}: {e})"
        out.append(text or "")
    return "\n".join(out)


def _new_lines(old: list[str], new: list[str]) -> list[str]:
    """The lines of ``new`` after its overlap with the end of ``old`` (a sliding tail)."""
    for k in range(min(len(old), len(new)), 0, -1):
        if old[-k:] == new[:k]:
            return new[k:]
    return new


def cmd_logs(job: str, follow: bool, attempt: int | None = None, node: int | None = None) -> int:
    if node is not None:
        return _node_logs(job, follow, attempt, node)
    try:
        return _logs(job, follow, attempt)
    finally:
        from providers import registry

        registry.close_all()  # stop SkyPilot's API server if reading a node's output started it


def _node_logs(job: str, follow: bool, attempt: int | None, node: int) -> int:
    """One node's output (``nodes/a<A>/node-<N>.log`` in the run URI, which that node's bootstrap
    rewrites while it runs): the last attempt unless ``--attempt``; ``-f`` follows it until the
    attempt ends."""
    from orchestrator.contract import runuri

    store = StateStore()
    row = store.get_job(job)
    if row is None:
        raise NotFoundError(f"no job named {job!r} (see `dtrun ls`)")
    atts = store.attempts(job)
    n = attempt if attempt is not None else (atts[-1]["n"] if atts else None)
    if n is None or store.get_attempt(job, n) is None:
        have = [a["n"] for a in atts]
        raise NotFoundError(f"job {job!r} has no attempt {n} (attempts: {', '.join(map(str, have)) or 'none'})")
    uri = runuri.node_uri(row["run_uri"], n, node, "log")
    text = runuri.read_text(uri)
    if text is None:
        ranks = [r.get("rank") for r in runuri.node_records(row["run_uri"], n)]
        raise NotFoundError(f"--node {node}: no output from node {node} in attempt {n} of {job!r} "
                            f"(nodes that reported: {', '.join(map(str, ranks)) or 'none'}; looked in {uri})")
    sys.stdout.write(f"--- attempt {n} node {node} output: {uri} ---\n")
    seen = text.splitlines()
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
    sys.stdout.flush()
    if not follow:
        return EXIT_OK
    try:
        while True:
            a = store.get_attempt(job, n)
            ended = a is None or a["state"] == "ENDED"
            lines = (runuri.read_text(uri) or "").splitlines()
            for ln in _new_lines(seen, lines):
                sys.stdout.write(ln + "\n")
            seen = lines
            sys.stdout.flush()
            if ended:
                return EXIT_OK
            time.sleep(LOG_POLL_SECONDS)
    except KeyboardInterrupt:
        return EXIT_OK


def _logs(job: str, follow: bool, attempt: int | None) -> int:
    store = StateStore()
    if store.get_job(job) is None:
        raise NotFoundError(f"no job named {job!r} (see `dtrun ls`)")
    if attempt is not None and store.get_attempt(job, attempt) is None:
        have = [a["n"] for a in store.attempts(job)]
        raise NotFoundError(f"job {job!r} has no attempt {attempt} (attempts: {', '.join(map(str, have)) or 'none'})")
    last_id = 0
    cur_log: str | None = None
    pos = 0
    remote_seen: list[str] = []
    remote_n: int | None = None

    def attempt_text(a: dict) -> str | None:
        if a["log_path"] and os.path.exists(a["log_path"]):
            return Path(a["log_path"]).read_text(errors="replace")
        return _remote_log(store, job, a["n"])

    def drain(logs: bool = True) -> None:
        nonlocal last_id, cur_log, pos, remote_seen, remote_n
        for e in store.events(job, after_id=last_id):
            last_id = e["id"]
            stamp = time.strftime("%H:%M:%S", time.localtime(e["time"]))
            sys.stdout.write(f"{stamp} [{e['type']}] {e['message']}\n")
        if not logs:
            sys.stdout.flush()
            return
        atts = store.attempts(job)
        if attempt is not None:
            atts = [a for a in atts if a["n"] == attempt]
        if not atts:
            sys.stdout.flush()
            return
        a = atts[-1]
        lp = a["log_path"]
        if lp and os.path.exists(lp):
            if lp != cur_log:
                cur_log, pos = lp, 0
                sys.stdout.write(f"--- attempt {a['n']} log: {lp} ---\n")
            with open(cur_log, "rb") as f:
                f.seek(pos)
                data = f.read()
                pos += len(data)
            sys.stdout.write(data.decode(errors="replace"))
        else:
            text = _remote_log(store, job, a["n"], lines=1000)
            if text is not None:
                if remote_n != a["n"]:
                    remote_n, remote_seen = a["n"], []
                    sys.stdout.write(f"--- attempt {a['n']} ({a['provider']}) node output ---\n")
                lines = text.splitlines()
                for ln in _new_lines(remote_seen, lines):
                    sys.stdout.write(ln + "\n")
                remote_seen = lines
        sys.stdout.flush()

    if not follow:
        # every attempt's output (or the one asked for), then the events
        for a in store.attempts(job):
            if attempt is not None and a["n"] != attempt:
                continue
            text = attempt_text(a)
            if text is None:
                continue
            where = a["log_path"] if a["log_path"] and os.path.exists(a["log_path"]) else f"{a['provider']} node output"
            sys.stdout.write(f"--- attempt {a['n']} log: {where} ---\n")
            sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
        sys.stdout.write("--- controller events ---\n")
        drain(logs=False)
        return EXIT_OK
    try:
        while True:
            drain()
            row = store.get_job(job)
            if row and row["state"] in TERMINAL_STATES and not StateStore.controller_alive(row):
                drain()
                return EXIT_OK
            if attempt is not None:
                a = store.get_attempt(job, attempt)
                if a and a["state"] == "ENDED" and not store.nodes(job, live_only=True):
                    drain()
                    return EXIT_OK
            time.sleep(LOG_POLL_SECONDS if remote_n is not None else 0.5)
    except KeyboardInterrupt:
        return EXIT_OK


# ---- down ----------------------------------------------------------------------------------------

def cmd_down(job: str, now: bool, yes: bool = False) -> int:
    store = StateStore()
    row = store.get_job(job)
    if row is None:
        raise NotFoundError(f"no job named {job!r} (see `dtrun ls`)")
    if row["state"] in TERMINAL_STATES and not store.nodes(job, live_only=True):
        print(f"{job} is already {row['state']}; nothing is running")
        return EXIT_OK
    if not yes and _tty_in():
        # On a terminal, ask first; without one (scripts, CI) stopping goes ahead: it only ever
        # ends spending, so it never waits for an answer nobody can give.
        how = "terminate now, no final checkpoint" if now else "final checkpoint, then terminate"
        if _ask(f"Stop {job} ({row['state']}, step {row['step'] or 0}; {how})? [y/N] ") not in ("y", "yes"):
            print(f"{job}: not stopped")
            return EXIT_INTERRUPTED
    store.request_action(job, "stop_now" if now else "stop")
    what = "terminating now" if now else "asking the trainer to checkpoint and stop"
    if StateStore.controller_alive(row):
        print(f"{job}: {what} (controller pid {row['controller_pid']})")
        return _wait_terminal(store, job)
    print(f"{job}: no controller is running; {what} here")
    from orchestrator.cli.detached import load_stored_spec
    from orchestrator.cli.live import PlainView
    from orchestrator.run.controller import Controller

    spec, _ = load_stored_spec(store, job)
    view = PlainView(store, job)
    ctl = Controller(spec, store, on_event=view.event)
    if row["state"] in TERMINAL_STATES:
        # finished, but a node is still recorded alive: terminate it (confirmed), then close the
        # providers (SkyPilot: stop the API server if terminating started it)
        ctl.teardown.terminate_all(sleep=time.sleep)
        print(f"{job}: every node terminated (confirmed)")
        return EXIT_OK
    state = ctl.run()
    print(f"{job}: {state}")
    return EXIT_OK


def _wait_terminal(store: StateStore, job: str) -> int:
    last = None
    try:
        while True:
            row = store.get_job(job)
            assert row is not None
            if row["state"] != last:
                last = row["state"]
                print(f"  {last}" + (f": {row['reason'].splitlines()[0]}" if row["reason"] else ""))
            if row["state"] in TERMINAL_STATES:
                return EXIT_OK
            if not StateStore.controller_alive(row):
                _err("the controller exited before the job stopped; run `dtrun down` again")
                return EXIT_JOB_FAILED
            time.sleep(0.5)
    except KeyboardInterrupt:
        print(f"stopped waiting; the controller keeps stopping {job} (see `dtrun status {job}`)")
        return EXIT_INTERRUPTED


# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def status(
    job: Annotated[Optional[str], typer.Argument(help="Job name (default: every job).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Show a job's state, step, spend, attempts and nodes."""
    from orchestrator.cli import remote

    if remote.target():
        raise typer.Exit(remote.status(job, json_out))
    raise typer.Exit(cmd_status(job, json_out))


@app.command("ls")
def ls_(json_out: JsonOpt = False) -> None:
    """List jobs."""
    raise typer.Exit(cmd_ls(json_out))


@app.command()
def logs(
    job: Annotated[str, typer.Argument(help="Job name.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
    attempt: Annotated[int | None, typer.Option("--attempt", "-a", help="Only this attempt's node output.")] = None,
    node: Annotated[int | None, typer.Option("--node", "-n", min=0,
                                             help="Only node N's output (its rank; the run URI's copy).")] = None,
) -> None:
    """Print the job's controller events and the nodes' output (local log files, or the
    provider's logs for a remote node: SkyPilot's job log of the attempt's cluster). ``--node N``:
    that node's own output, which every node's bootstrap writes to the run URI."""
    from orchestrator.cli import remote

    if remote.target():  # the server's events for the job (follow: polled)
        raise typer.Exit(remote.logs(job, follow))
    raise typer.Exit(cmd_logs(job, follow, attempt, node))


@app.command()
def down(
    job: Annotated[str, typer.Argument(help="Job name.")],
    now: Annotated[bool, typer.Option("--now", help="Skip the final checkpoint; terminate at once.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (asked only on a terminal).")] = False,
) -> None:
    """Stop a job: STOP → final checkpoint → terminate every node (confirmed)."""
    from orchestrator.cli import remote

    if remote.target():
        raise typer.Exit(remote.down(job, now))
    raise typer.Exit(cmd_down(job, now, yes))

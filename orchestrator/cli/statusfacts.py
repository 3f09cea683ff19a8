"""What ``dtrun status`` says beyond the controller's record: the step the run URI shows when it
is past that record (the controller is gone, or stopped reading before the trainer's last
checkpoint), and whether any controller still watches an active run."""

from __future__ import annotations

import time
from typing import Any

from orchestrator.contract import runuri
from orchestrator.run.context import describe_error


def fmt_wall(s: float) -> str:
    """A duration as ``1h02m03s`` (or ``2m03s`` under an hour)."""
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def step_facts(job: dict, read_run_uri: bool = True) -> dict[str, Any]:
    """The step, loss and last COMMITTED step to show for ``job``: the controller's record, or
    (``read_run_uri``) what the run URI shows when it is past that record, with where the step
    came from: ``controller`` (the state store), ``progress.json``
    (the trainer's heartbeat) or ``checkpoints/step-N`` (its newest COMMITTED marker)."""
    out: dict[str, Any] = {"step": job["step"], "step_source": "controller", "step_time": job.get("progress_time"),
                           "last_committed_step": job["last_committed_step"], "loss": job["loss"]}
    if not read_run_uri:
        return out
    uri = job["run_uri"]
    try:
        prog = runuri.read_json(runuri.join(uri, runuri.PROGRESS))
        last = runuri.latest_committed(uri)
    except Exception as e:  # noqa: BLE001 - no credentials, no backend: the record is all there is
        out["run_uri_error"] = describe_error(e)
        return out
    rec = out["step"] if out["step"] is not None else -1
    if isinstance(prog, dict) and isinstance(prog.get("step"), int) and prog["step"] > rec:
        out.update(step=prog["step"], step_source=runuri.PROGRESS, step_time=prog.get("time"),
                   loss=prog.get("loss", out["loss"]))
        lc = prog.get("last_committed_step")
        if isinstance(lc, int) and lc > (out["last_committed_step"] or -1):
            out["last_committed_step"] = lc
    if last is not None:
        step, marker = last
        if step > (out["last_committed_step"] if out["last_committed_step"] is not None else -1):
            out["last_committed_step"] = step
        if step > (out["step"] if out["step"] is not None else -1):
            out.update(step=step, step_source=f"{runuri.CHECKPOINTS}/step-{step}", step_time=marker.get("time"),
                       loss=marker.get("loss", out["loss"]))
    return out


def watch_lines(st: dict[str, Any]) -> list[str]:
    """Lines under a job's status: where its step came from (when not the controller's record)
    and who watches it (the live controller's pid, or that none does)."""

    out = []
    if st.get("step_source", "controller") != "controller":
        ago = f", {fmt_wall(max(0.0, time.time() - st['step_time']))} ago" if st.get("step_time") else ""
        was = st["recorded_step"] if st.get("recorded_step") is not None else "none"
        out.append(f"  step from the run URI's {st['step_source']}{ago} (the controller's record says {was})")
    elif st.get("run_uri_error"):
        out.append(f"  step from the controller's record (the run URI could not be read: {st['run_uri_error']})")
    if st["controller_pid"]:
        out.append(f"  controller pid {st['controller_pid']}")
    elif st.get("watched") is False:
        gone = f" (controller pid {st['gone_controller_pid']} is gone)" if st.get("gone_controller_pid") else ""
        out.append(f"  no controller watches this run{gone}: the nodes guard themselves (budget, deadline) but "
                   f"nothing relaunches after a preemption — `dtrun up` of the job re-attaches, "
                   f"`dtrun down {st['name']}` stops it")
    return out

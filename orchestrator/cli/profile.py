"""``dtrun profile JOB [--steps N]``: a short run under ``torch.profiler`` on this machine.

The job runs as the trainer would run it (``torchrun -m trainer.profiling``, one rank per
``resources.gpus_per_node``; ``trainer.parallel: auto`` resolved by the planner first); the
traces and a breakdown land in ``<run-uri>/profile/`` and the breakdown is printed: compute,
communication, data loading, checkpoint stall, idle — with tokens/s, MFU and the verdict
("MFU below 30%: communication- or dataloader-bound; fix before scaling"). A job with
``trainer.parallel.pp > 1`` also gets ``pipeline bubble: measured X% vs formula Y% (schedule, m
microbatches, pp N)`` (JSON: ``pipeline_bubble``; trainer/profile_bubble.py says how it is measured).

Scope: it runs *locally* — CPU ranks for ``gpu: cpu`` jobs, or this machine's CUDA GPUs when it
has them. Profiling on a rented offer (launch through the controller, fetch the trace) is not
built; for a GPU job on a machine without GPUs the command says so and exits 2.

JOB is a job file or the name of a job in the state store (``dtrun ls``), like the other
commands; an existing file of that name wins, and the command says which one it profiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from orchestrator.cli.options import JsonOpt
from orchestrator.contract.errors import EXIT_JOB_FAILED, EXIT_OK, NotFoundError, UsageError

TIMEOUT_S = 1800


def _cuda_devices() -> int:
    """Local CUDA GPUs, without importing torch in this process (nvidia-smi, else 0)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _render(res: dict[str, Any]) -> str:
    sec, sh = res["seconds"], res["shares"]
    rows = [("compute", "compute"), ("communication", "communication"), ("data loading", "data"),
            ("checkpoint stall", "checkpoint_stall"), ("idle", "idle")]
    par = res["parallel"]
    extra = "".join(f", {k} {par[k]}" for k in ("pp", "cp") if k in par)
    extra += f", pp_schedule {par['pp_schedule']}" if "pp_schedule" in par else ""
    lines = [f"profile: {res['steps']} steps on {res['world_size']} {res['device']} rank(s) "
             f"(dp_shard {par['dp_shard']}, tp {par['tp']}, ep {par['ep']}{extra})"]
    for label, key in rows:
        lines.append(f"  {label:<17}{sec[key]:>9.3f} s  {sh.get(key, 0.0):>6.1%}")
    lines.append(f"  {'wall':<17}{sec['wall']:>9.3f} s")
    mfu = res["mfu"]
    lines.append(f"  tokens/s {res['tokens_per_s']:,.0f}   step {res['step_seconds'] * 1000:.1f} ms   "
                 f"MFU {'n/a' if mfu is None else f'{mfu:.1%}'}"
                 + (f" (vs {res['peak_note']})" if res["device"] == "cpu" else ""))
    if res.get("pipeline_bubble"):  # pp > 1 (trainer/profile_bubble.py)
        from trainer.profile_bubble import render

        lines.append("  " + render(res["pipeline_bubble"]))
    lines.append(f"  verdict: {res['verdict']}")
    lines.append(f"  trace: {res['trace_uris'][0]}" + (f" (+{len(res['trace_uris']) - 1} more)"
                                                         if len(res["trace_uris"]) > 1 else ""))
    return "\n".join(lines)


def resolve(job: str) -> tuple[Any, str]:
    """(JobSpec, where it came from) for a job file, else a job name in the state store."""
    from orchestrator.plan.spec import load_spec

    path = Path(job).expanduser()
    if path.is_file():
        return load_spec(path), f"job file {path}"
    if os.path.sep not in job and not job.endswith((".yaml", ".yml")):
        from orchestrator.cli.detached import load_stored_spec
        from orchestrator.run.state import StateStore

        store = StateStore()
        if store.get_job(job) is not None:
            spec, _ = load_stored_spec(store, job)
            return spec, f"job {job!r} in the state store ({store.path})"
        raise NotFoundError(f"{job}: no such job file, and no job named {job!r} in the state store "
                            f"({store.path}; see `dtrun ls`)")
    raise NotFoundError(f"{job}: no such job file")


def cmd_profile(job: str, steps: int, json_out: bool) -> int:
    import typer

    from orchestrator.plan.planner import resolve_parallel
    from orchestrator.plan.spec import spec_to_yaml

    if steps < 1:
        raise UsageError("--steps must be at least 1")
    spec, source = resolve(str(job))
    job = f"{job} ({source})"
    if spec.trainer is None:
        raise UsageError(f"{job}: runs your own command: `dtrun profile` profiles the bundled trainer "
                         "(profile your script with torch.profiler inside it)")
    r = spec.resources
    if r.gpu != "cpu":
        have = _cuda_devices()
        if have < r.gpus_per_node:
            raise UsageError(
                f"{job}: dtrun profile runs on this machine, which has {have} CUDA GPU(s); the job asks for "
                f"{r.gpus_per_node} × {r.gpu}. Profile a gpu: cpu copy locally, or run it on a GPU machine "
                "(profiling on a rented offer is not built yet)")
    if r.nodes > 1:
        raise UsageError(f"{job}: dtrun profile runs one node; the job has resources.nodes: {r.nodes}")
    spec = resolve_parallel(spec)  # trainer.parallel: auto → the planner's degrees
    nproc = r.gpus_per_node
    with tempfile.TemporaryDirectory(prefix="dtrun-profile-") as tmp:
        job_file = Path(tmp) / "job.yaml"
        job_file.write_text(spec_to_yaml(spec))
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "trainer.profiling", "--job", str(job_file), "--run-uri", spec.run_uri,
               "--profile-steps", str(steps), "--result", str(result)]
        env = {**os.environ}
        if r.gpu == "cpu":
            env.setdefault("OMP_NUM_THREADS", "1")
        if not json_out:
            typer.echo(f"profiling {spec.name} from the {source}: {nproc} rank(s), {steps} steps …", err=True)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            typer.echo(f"dtrun: profile run exceeded {TIMEOUT_S} s", err=True)
            return EXIT_JOB_FAILED
        if proc.returncode != 0 or not result.exists():
            tail = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()][-6:]
            typer.echo(f"dtrun: profile run failed (exit {proc.returncode}):\n  " + "\n  ".join(tail), err=True)
            return proc.returncode if proc.returncode == 2 else EXIT_JOB_FAILED
        res = json.loads(result.read_text())
    res["source"] = source
    typer.echo(json.dumps(res, indent=2) if json_out else _render(res))
    return EXIT_OK

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def profile(
    job: Annotated[str, typer.Argument(help="Job name (see `dtrun ls`) or its job.yaml.", show_default=False)],
    steps: Annotated[int, typer.Option(help="Steps to profile.")] = 10,
    json_out: JsonOpt = False,
) -> None:
    """A short run under torch.profiler: where the time goes, tokens/s, MFU and a verdict."""
    raise typer.Exit(cmd_profile(job, steps, json_out))

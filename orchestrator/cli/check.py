"""``dtrun check [JOB] [--online] [--json]``: what is set up here, one ✓/✗ line per item with the
fix (``orchestrator.run.readiness`` gathers them). Exit 0 when everything the job needs is ✓
(without a job: at least one rentable provider is ready), 5 when no provider is ready, 6 when a
URI of the job cannot work, 2 for data whose vocabulary the model cannot hold."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from orchestrator.cli.options import JsonOpt

MARK = {True: "✓", False: "✗", None: "·"}


def cmd_check(job: Path | None, online: bool, json_out: bool, timeout: float) -> int:
    from orchestrator.run.readiness import check

    spec = None
    if job is not None:
        from orchestrator.plan.spec import load_spec

        spec = load_spec(job)
    items, code, ready = check(spec, str(job) if job else "", online=online, timeout=timeout)
    if json_out:
        sys.stdout.write(json.dumps({"job": spec.name if spec else None, "items": [i.to_dict() for i in items],
                                     "ready_providers": ready, "exit_code": code}) + "\n")
        return code
    group = None
    for i in items:
        if i.group != group:
            group = i.group
            print(f"{group}:")
        detail = i.detail[len(i.name) + 2:] if i.detail.startswith(f"{i.name}: ") else i.detail  # named once
        line = f"  {MARK[i.ok]} {i.name}: {detail}"
        if i.ok is False and i.fix:
            line += f" → {i.fix}"
        print(line)
    if spec is not None:
        verdict = ("ready" if code == 0 else
                   {5: "no provider it names is ready (exit 5)", 6: "a URI of the job cannot work (exit 6)",
                    2: "the data does not fit the model (exit 2)"}.get(code, f"exit {code}"))
        print(f"{spec.name}: {verdict}" + (f"; can rent from {', '.join(ready)}" if ready else ""))
    else:
        print(f"ready to rent from: {', '.join(ready)}" if ready else
              "no provider is ready (exit 5); `dtrun up JOB --dry-run` still prices every offer")
    return code

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def check(
    job: Annotated[Optional[Path], typer.Argument(help="Also check this job's run URI, data and providers.")] = None,
    online: Annotated[bool, typer.Option("--online", help="Ask each provider's API whether the key is accepted.")] = False,
    json_out: JsonOpt = False,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="Seconds to wait for each online answer.")] = 10.0,
) -> None:
    """What is set up: credentials, packages, rsync, SkyPilot's API server; for a JOB its run URI,
    data and this machine's torch/CUDA/NCCL. One ✓/✗ line per item, with the fix."""
    raise typer.Exit(cmd_check(job, online, json_out, timeout))

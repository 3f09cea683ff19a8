"""``dtrun check [JOB] [--online] [--json]``: what is set up here, one ✓/✗ line per item with the
fix (``orchestrator.run.readiness`` gathers them). Exit 0 when everything the job needs is ✓
(without a job: at least one rentable provider is ready), 5 when no provider is ready, 6 when a
URI of the job cannot work, 2 for data whose vocabulary the model cannot hold.

``local`` (this machine) is ready when it can run the trainer: torch imports here (a ``command:``
job brings its own program and needs nothing dtrun checks). Without a job the verdict says both:
whether a cloud is ready to rent from (exit 5 when none is) and whether local runs work.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from orchestrator.cli.options import JsonOpt

MARK = {True: "✓", False: "✗", None: "·"}


def local_ready(items, spec) -> tuple[bool, str]:
    """Whether ``local`` can run ``spec`` (without a job: the bundled trainer) on this machine,
    from the ``local`` items, and what to say about it."""
    if spec is not None and getattr(spec, "command", None) is not None:
        return True, "local runs your command here"
    torch = next((i for i in items if i.group == "local" and i.name == "torch"), None)
    if torch is None or torch.ok is False:
        return False, "local cannot run the trainer here: " + (f"torch {torch.detail} → {torch.fix}" if torch
                                                               else "torch was not checked")
    cuda = next((i for i in items if i.group == "local" and i.name == "CUDA"), None)
    how = "CPU ranks over gloo" if cuda is None or cuda.detail.startswith("none") else f"CUDA {cuda.detail}"
    return True, f"local is ready: this machine can run the trainer (torch {torch.detail}, {how})"


def cmd_check(job: Path | None, online: bool, json_out: bool, timeout: float) -> int:
    from orchestrator.run.readiness import RENTABLE, check, local_items

    spec = None
    if job is not None:
        from orchestrator.plan.spec import load_spec

        spec = load_spec(job)
    items, code, ready = check(spec, str(job) if job else "", online=online, timeout=timeout)
    if spec is None:
        items = items + local_items()
    local_ok, local_says = local_ready(items, spec)
    names_local = spec is not None and "local" in spec.resources.providers
    if names_local and not local_ok:
        ready = [p for p in ready if p != "local"]
        if code == 0 and not [p for p in ready if p in RENTABLE]:
            code = 5
    if json_out:
        sys.stdout.write(json.dumps({"job": spec.name if spec else None, "items": [i.to_dict() for i in items],
                                     "ready_providers": ready, "local_ready": local_ok, "local": local_says,
                                     "exit_code": code}) + "\n")
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
        print(f"{spec.name}: {verdict}" + (f"; can rent from {', '.join(ready)}" if ready else "")
              + (f"; {local_says}" if names_local and not local_ok else ""))
    else:
        clouds = (f"ready to rent from: {', '.join(ready)}" if ready else
                  "no cloud provider is ready to rent from (exit 5); `dtrun up JOB --dry-run` still prices every offer")
        print(f"{clouds}\n{local_says}" + (": `dtrun up jobs/quickstart.yaml --yes` trains here" if local_ok else ""))
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

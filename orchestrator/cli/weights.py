"""``dtrun weights JOB --out DIR [--step N] [--format safetensors|hf]``: parse, call
``trainer.export``, print. JOB is a job name from the state store or a job.yaml path.

Exit codes: 0 written, 2 bad request (no COMMITTED checkpoint, no such step, a shape with no
transformers class for ``--format hf``), 6 no such job.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from orchestrator.contract.errors import EXIT_OK, NotFoundError, UsageError


def resolve_job(job: str) -> tuple[Any, str]:
    """(JobSpec, run URI) for a job name (the state store) or a job.yaml path."""
    from orchestrator.plan.spec import load_spec

    if job.endswith((".yaml", ".yml")) or os.path.sep in job:
        if not Path(job).exists():
            raise NotFoundError(f"{job}: no such job file")
        spec, uri = load_spec(job), None
    else:
        from orchestrator.cli.detached import load_stored_spec
        from orchestrator.run.state import StateStore

        store = StateStore()
        if store.get_job(job) is None:
            raise NotFoundError(f"no job named {job!r} (see `dtrun ls`; or give its job.yaml)")
        spec, row = load_stored_spec(store, job)
        uri = row["run_uri"]
    if spec.trainer is None:
        raise UsageError(f"{job}: runs your own command, whose checkpoints are its own format: `dtrun weights` "
                         f"and `dtrun sample` read the bundled trainer's (your files are under "
                         f"{uri or spec.run_uri}/checkpoints/step-N/)")
    return spec, uri or spec.run_uri


def data_manifest(spec) -> tuple[dict | None, str | None]:
    from orchestrator.contract.dataset import manifest_dir, read_manifest

    data = spec.trainer.data
    if data == "synthetic":
        return None, None
    m = read_manifest(data)
    d = manifest_dir(data if "://" in data else os.path.abspath(os.path.expanduser(data)))
    return m, d


def cmd_weights(job: str, out: Path, step: int | None, fmt: str) -> int:
    from trainer.export import ExportError, export

    spec, run_uri = resolve_job(job)
    manifest, data_dir = data_manifest(spec)
    t0 = time.monotonic()
    try:
        res = export(run_uri, spec.trainer.model_spec, str(out), step=step, fmt=fmt, manifest=manifest,
                     data_uri=data_dir)
    except ExportError as e:
        raise UsageError(f"weights: {e}") from None
    print(f"{out}: step {res['step']} as {res['format']} ({res['tensors']} tensors, {res['bytes'] / 1e6:.1f} MB) "
          f"in {time.monotonic() - t0:.1f} s from {res['checkpoint']}")
    if fmt == "hf":
        if res["tokenizer_files"]:
            print(f"  load it: AutoModelForCausalLM.from_pretrained('{out}'), AutoTokenizer.from_pretrained('{out}')")
        else:
            print("  no tokenizer files copied (the data manifest names no tokenizer.json: a tiktoken tokenizer "
                  "or synthetic data); load the model with AutoModelForCausalLM.from_pretrained")
    return EXIT_OK

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def weights(
    job: Annotated[str, typer.Argument(help="Job name (or its job.yaml).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Output folder.", show_default=False)],
    step: Annotated[Optional[int], typer.Option(help="Checkpoint step (default: newest COMMITTED).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="safetensors (dtrun names) or hf (transformers).")] = "safetensors",
) -> None:
    """Write the model's weights (no optimizer state) from a checkpoint, tensor by tensor."""
    raise typer.Exit(cmd_weights(job, out, step, fmt))

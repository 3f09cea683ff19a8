"""``dtrun init``: a commented job file to start from, which passes ``dtrun up --dry-run``.

Asks for what was not given on the command line when there is a terminal; uses the defaults
without one (a tiny model on this machine's CPU: free, no account). Never overwrites a file
unless ``--force``. Imports only the spec and the presets (the dry run's own path).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from orchestrator.contract.errors import EXIT_OK, UsageError

DEFAULTS = {"model": "tiny", "gpu": "cpu", "data": "synthetic"}
DEFAULT_BUDGET_USD = {"cpu": 1.0, "gpu": 50.0}
RENTED_PROVIDERS = ["runpod", "lambda", "vast", "modal"]
CHINCHILLA_TOKENS_PER_PARAM = 20
"""Training tokens per parameter a GPU job file starts from (Hoffmann et al. 2022)."""


def _tty() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (ValueError, OSError):
        return False


def _ask(question: str, default: str) -> str:
    sys.stdout.write(f"{question} [{default}]: ")
    sys.stdout.flush()
    return sys.stdin.readline().strip() or default


def _job_name(out: Path) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", out.stem.lower()).strip("-")
    if not stem or not stem[0].isalpha():
        stem = "job-" + stem if stem else "my-job"
    return stem[:40].rstrip("-") if len(stem) >= 2 else "my-job"


def render(name: str, model: str, gpu: str, budget: float, data: str, gpus: int, path: str = "job.yaml") -> str:
    """The job file's text: every field commented (the dry run and `dtrun schema` say more)."""
    from orchestrator.plan.presets import PRESETS

    local = gpu == "cpu"
    ms = PRESETS[model]
    seq_len = min(ms.max_seq_len, 64 if local else 1024)
    batch = max(gpus, (8 if local else 64) // gpus * gpus)  # every layout splits it over the ranks
    if local:
        length = "  steps: 200                # optimizer steps (or tokens: N)\n"
    else:
        tokens = CHINCHILLA_TOKENS_PER_PARAM * ms.num_params()
        length = (f"  tokens: {tokens:_}   # {CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter "
                  "(Chinchilla); or steps: N\n")
    providers = "[local]" if local else "[" + ", ".join(RENTED_PROVIDERS) + "]"
    uri = "./runs/{name}" if local else "s3://my-bucket/dtrun/{name}"
    uri_note = ("relative to this file's folder" if local else
                "CHANGE my-bucket to yours: rented nodes reach only object storage")
    data_note = ("seeded random tokens (no corpus needed); or token shards from `dtrun data prepare`"
                 if data == "synthetic" else "token shards (llm.c .bin or .npy): a folder, glob or s3:// URI")
    return f"""# Written by `dtrun init`. Check it with `dtrun up {path} --dry-run` (prices, memory, budget;
# rents nothing) and `dtrun check {path}` (credentials, storage, data); `dtrun schema` lists every field.
name: {name}                      # 2-40 lowercase letters, digits or dashes
resources:
  providers: {providers}   # where nodes may come from; the cheapest fitting offer wins
  gpu: {gpu}                      # {"this machine's CPU ranks (free)" if local else "H100, A100-80GB, L40S, … (`dtrun prices`)"}
  gpus_per_node: {gpus}
  nodes: 1
{"" if local else "  spot: prefer               # spot where cheaper (preemptions are survived), else on-demand" + chr(10)}trainer:
  model: {model}                  # a preset ({", ".join(PRESETS)}) or explicit sizes
  parallel: auto             # the memory planner picks DDP / FSDP / TP that fits
{length}  batch_size: {batch}              # sequences per optimizer step (global)
  seq_len: {seq_len}                # tokens per sequence
  data: {data}   # {data_note}
  precision: {"fp32" if local else "bf16"}
checkpoint:
  uri: {uri}   # the run URI: checkpoints, progress, logs ({uri_note})
  every_steps: {"50" if local else "auto"}            # {"a checkpoint every N steps" if local else "Young/Daly from the checkpoint cost and the preemption rate"}
budget:
  max_usd: {budget:g}               # the dry run refuses a plan over this (exit 3); the run stops at it
  max_hours: {1 if local else 12}               # hard wall-clock deadline from the first launch
"""


def cmd_init(model: str | None, gpu: str | None, budget: float | None, data: str | None,
             out: Path, force: bool, gpus: int | None) -> int:
    from orchestrator.contract.gpus import GPUS, canonical_gpu
    from orchestrator.plan.presets import PRESETS

    if out.exists() and not force:
        raise UsageError(f"{out} already exists; pass --force to overwrite it (or --out another file)")
    if _tty():
        if model is None:
            model = _ask(f"Model preset ({', '.join(PRESETS)})", DEFAULTS["model"])
        if gpu is None:
            gpu = _ask("GPU (cpu = this machine, free; or H100, A100-80GB, L40S, …)", DEFAULTS["gpu"])
        if data is None:
            data = _ask("Training data (synthetic, a shards folder, or s3://…)", DEFAULTS["data"])
    model = model or DEFAULTS["model"]
    gpu = gpu or DEFAULTS["gpu"]
    data = data or DEFAULTS["data"]
    if model not in PRESETS:
        raise UsageError(f"--model: unknown preset {model!r}; known: {', '.join(PRESETS)}")
    g = canonical_gpu(gpu)
    if g is None:
        raise UsageError(f"--gpu: unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    local = g == "cpu"
    if budget is None:
        default = DEFAULT_BUDGET_USD["cpu" if local else "gpu"]
        answer = _ask("Budget in USD (budget.max_usd)", f"{default:g}") if _tty() else f"{default:g}"
        try:
            budget = float(answer.lstrip("$").replace(",", ""))
        except ValueError:
            raise UsageError(f"budget: {answer!r} is not a number of USD (e.g. 50)") from None
    if budget <= 0:
        raise UsageError("--budget: must be more than 0 USD")
    gpus = gpus or (2 if local else 1)
    text = render(_job_name(out), model, g, budget, data, gpus, str(out))
    # The file must load: validate before writing (a wrong template never reaches the user).
    import yaml

    from orchestrator.plan.spec import parse_spec

    from orchestrator.plan.spec import anchor_paths
    from orchestrator.run.uricheck import offline_problems

    spec = anchor_paths(parse_spec(yaml.safe_load(text), str(out)), out.resolve().parent)
    problems = [p for p in offline_problems(spec) if p.field == "trainer.data"]
    later = ""
    if problems and "dtrun data prepare" in problems[0].message:  # a local folder to fill later
        later = f"\nnote: {problems[0].message}"
    elif problems:  # a URI that can never work (malformed, unknown scheme, package missing)
        raise UsageError(f"--data: {problems[0].message}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}: {model} on {gpus}× {g}, budget ${budget:g}. Next: dtrun up {out} --dry-run{later}")
    return EXIT_OK

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def init(
    model: Annotated[Optional[str], typer.Option("--model", help="Model preset (default tiny).")] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU type, or cpu for this machine (default cpu).")] = None,
    budget: Annotated[Optional[float], typer.Option("--budget", help="budget.max_usd in USD.")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Token shards (URI/path) or synthetic.")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="The job file to write.")] = Path("job.yaml"),
    gpus: Annotated[Optional[int], typer.Option("--gpus", min=1, help="GPUs per node.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented job file that passes `dtrun up --dry-run` (asks on a terminal)."""
    raise typer.Exit(cmd_init(model, gpu, budget, data, out, force, gpus))

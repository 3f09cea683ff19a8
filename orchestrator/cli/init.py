"""``dtrun init``: a commented job file to start from, which passes ``dtrun up --dry-run``.

Asks for what was not given on the command line when there is a terminal (model, GPU, data,
budget, GPUs per node, spot); uses the defaults without one (a tiny model on this machine's CPU:
free, no account). Never overwrites a file unless ``--force``. Every value is written by the YAML
dumper and the text is checked to load back to the job asked for. A rented job's tokens start at
20 per parameter and are cut to what the dry run's own estimate fits in the budget and deadline
(or the command says why it could not).
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


def _y(value: object) -> str:
    """One value as YAML, by the YAML library's dumper (quoted where a plain scalar would be
    read as something else: ``a: b``, `` #c``, ``8``, ``yes``)."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True)
    return text[: -len("\n...\n")] if text.endswith("\n...\n") else text.rstrip("\n")


def job_dict(name: str, model: str, gpu: str, budget: float, data: str, gpus: int, spot: bool | str,
             tokens: int | None = None) -> dict:
    """The job the file says (what :func:`render` writes, and what loading the file must give back)."""
    from orchestrator.plan.presets import PRESETS

    local = gpu == "cpu"
    ms = PRESETS[model]
    length = {"steps": 200} if local else {"tokens": tokens or CHINCHILLA_TOKENS_PER_PARAM * ms.num_params()}
    res = {"providers": ["local"] if local else list(RENTED_PROVIDERS), "gpu": gpu, "gpus_per_node": gpus, "nodes": 1}
    if not local:
        res["spot"] = spot
    return {
        "name": name,
        "resources": res,
        "trainer": {"model": model, "parallel": "auto", **length,
                    "batch_size": max(gpus, (8 if local else 64) // gpus * gpus),  # every layout splits it
                    "seq_len": min(ms.max_seq_len, 64 if local else 1024),
                    "data": data, "precision": "fp32" if local else "bf16"},
        "checkpoint": {"uri": "./runs/{name}" if local else "s3://my-bucket/dtrun/{name}",
                       "every_steps": 50 if local else "auto"},
        "budget": {"max_usd": budget, "max_hours": 1 if local else 12},
    }


def render(job: dict, path: str = "job.yaml", tokens_note: str | None = None) -> str:
    """The job file's text: every field commented (the dry run and `dtrun schema` say more); every
    value written by the YAML dumper, and the text checked to load back to ``job`` exactly."""
    import yaml

    from orchestrator.plan.presets import PRESETS

    r, t, c, b = job["resources"], job["trainer"], job["checkpoint"], job["budget"]
    local = r["gpu"] == "cpu"
    if "steps" in t:
        length = f"  steps: {_y(t['steps'])}                # optimizer steps (or tokens: N)\n"
    else:
        length = f"  tokens: {t['tokens']:_}   # {tokens_note or 'or steps: N'}\n"
    uri_note = ("relative to this file's folder" if local else
                "CHANGE my-bucket to yours: rented nodes reach only object storage")
    data_note = ("seeded random tokens (no corpus needed); or token shards from `dtrun data prepare`"
                 if t["data"] == "synthetic" else "token shards (llm.c .bin or .npy): a folder, glob or s3:// URI")
    spot = ("" if local else f"  spot: {_y(r['spot'])}               # prefer: spot where cheaper (preemptions "
            "are survived), else on-demand; true: only spot; false: only on-demand\n")
    text = f"""# Written by `dtrun init`. Check it with `dtrun up {path} --dry-run` (prices, memory, budget;
# rents nothing) and `dtrun check {path}` (credentials, storage, data); `dtrun schema` lists every field.
name: {_y(job['name'])}                      # 2-40 lowercase letters, digits or dashes
resources:
  providers: {_y(r['providers'])}   # where nodes may come from; the cheapest fitting offer wins
  gpu: {_y(r['gpu'])}                      # {"this machine's CPU ranks (free)" if local else "H100, A100-80GB, L40S, … (`dtrun prices`)"}
  gpus_per_node: {_y(r['gpus_per_node'])}
  nodes: {_y(r['nodes'])}
{spot}trainer:
  model: {_y(t['model'])}                  # a preset ({", ".join(PRESETS)}) or explicit sizes
  parallel: {_y(t['parallel'])}             # the memory planner picks DDP / FSDP / TP that fits
{length}  batch_size: {_y(t['batch_size'])}              # sequences per optimizer step (global)
  seq_len: {_y(t['seq_len'])}                # tokens per sequence
  data: {_y(t['data'])}   # {data_note}
  precision: {_y(t['precision'])}
checkpoint:
  uri: {_y(c['uri'])}   # the run URI: checkpoints, progress, logs ({uri_note})
  every_steps: {_y(c['every_steps'])}            # {"a checkpoint every N steps" if local else "Young/Daly from the checkpoint cost and the preemption rate"}
budget:
  max_usd: {_y(b['max_usd'])}               # the dry run refuses a plan over this (exit 3); the run stops at it
  max_hours: {_y(b['max_hours'])}               # hard wall-clock deadline from the first launch
"""
    back = yaml.safe_load(text)
    if back != job:  # a value the template would change on the way: never write it
        raise AssertionError(f"dtrun init: the job file would not say what was asked: {back!r} != {job!r}")
    return text


def size_tokens(spec, budget: float) -> tuple[int, str, str | None]:
    """(tokens, the file's comment on them, a line to print) for a rented job: 20 tokens per parameter
    (Chinchilla) when the dry run's own estimate of that is within the budget and deadline, else the
    most tokens (two significant digits) whose estimate is — the same arithmetic as ``dtrun up
    --dry-run`` (``run.prepare.run_spec`` then ``plan.estimate.make_plan`` over the same offers)."""
    from orchestrator.cli.planview import fmt_money
    from orchestrator.plan.estimate import make_plan
    from orchestrator.run.prepare import run_spec

    chin = spec.trainer.tokens
    chin_note = f"{CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter (Chinchilla); or steps: N"
    rs = run_spec(spec)
    p0 = make_plan(rs, usable_only=True)
    pool = p0.offers or p0.locked
    est0 = p0.estimate or (p0.locked_estimates[0] if p0.locked_estimates else None)
    if est0 is None or not pool:
        why = "; ".join(p0.refusals) or "no offer"
        return chin, chin_note, f"note: the tokens were not sized to the budget: nothing to price ({why})"
    if est0.within_budget:
        return chin, chin_note, None
    tps = rs.trainer.tokens_per_step

    def est(tokens: int):
        t = rs.model_copy(update={"trainer": rs.trainer.model_copy(update={"tokens": tokens})})
        return make_plan(t, offers=pool).estimate

    what = f"{CHINCHILLA_TOKENS_PER_PARAM} per parameter (Chinchilla, {fmt_tokens(chin)} tokens)"
    if est0.cost_usd > budget:
        what += f" would cost {fmt_money(est0.cost_usd)} > budget ${budget:g}"
    else:
        what += f" would take {est0.hours:,.1f} h > budget.max_hours {spec.budget.max_hours:g} h"
    one = est(tps)
    if one is None or not one.within_budget:
        floor = fmt_money(one.cost_usd) if one is not None else "?"
        return chin, chin_note, (f"note: tokens: {what}; even one step is estimated at {floor} "
                                 f"(start-up included): `dtrun up --dry-run` will refuse it (exit 3); raise --budget")
    lo, hi = 1, -(-chin // tps)  # steps: lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        e = est(mid * tps)
        lo, hi = (mid, hi) if e is not None and e.within_budget else (lo, mid)
    tokens = lo * tps
    digits = len(str(tokens)) - 2
    tokens = max(tps, tokens // 10 ** digits * 10 ** digits) if digits > 0 else tokens
    e = est(tokens)
    offer = (p0.chosen or p0.locked[0]).key()
    note = (f"sized to budget.max_usd: estimated {fmt_money(e.cost_usd)} on {offer}; "
            f"{CHINCHILLA_TOKENS_PER_PARAM}/param would be {chin:_}")
    return tokens, note, (f"tokens: {what}: sized to {fmt_tokens(tokens)} tokens "
                          f"(estimated {fmt_money(e.cost_usd)} with buffer on {offer}); raise --budget for more")


def fmt_tokens(n: int) -> str:
    """A token count for a sentence: 1.4T, 161B, 5.2M, 12,000 (three significant digits at most)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,}"


def _spot(answer: str) -> bool | str:
    a = answer.strip().lower()
    if a in ("prefer", ""):
        return "prefer"
    if a in ("true", "yes", "y", "spot", "only"):
        return True
    if a in ("false", "no", "n", "on-demand", "ondemand"):
        return False
    raise UsageError(f"spot: {answer!r}: answer prefer, true (only spot) or false (only on-demand)")


def cmd_init(model: str | None, gpu: str | None, budget: float | None, data: str | None,
             out: Path, force: bool, gpus: int | None, spot: str | None = None) -> int:
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
    budget = int(budget) if float(budget).is_integer() else budget
    if gpus is None:
        default_gpus = 2 if local else 1
        if _tty():
            answer = _ask("GPUs per node (resources.gpus_per_node)" if not local else "CPU ranks", str(default_gpus))
            if not answer.isdigit() or int(answer) < 1:
                raise UsageError(f"gpus per node: {answer!r} is not a whole number ≥ 1")
            gpus = int(answer)
        else:
            gpus = default_gpus
    spot_v = _spot(spot if spot is not None else
                   (_ask("Spot (prefer / true = only spot / false = only on-demand)", "prefer")
                    if _tty() and not local else "prefer"))
    name = _job_name(out)
    job = job_dict(name, model, g, budget, data, gpus, spot_v)
    # The file must load: validate before writing (a wrong template never reaches the user).
    from orchestrator.plan.spec import anchor_paths, parse_spec
    from orchestrator.run.uricheck import offline_problems

    spec = anchor_paths(parse_spec(job, str(out)), out.resolve().parent)
    problems = [p for p in offline_problems(spec) if p.field == "trainer.data"]
    later = ""
    if problems and "dtrun data prepare" in problems[0].message:  # a local folder to fill later
        later = f"\nnote: {problems[0].message}"
    elif problems:  # a URI that can never work (malformed, unknown scheme, package missing)
        raise UsageError(f"--data: {problems[0].message}")
    tokens_note = sized = None
    if not local:
        tokens, tokens_note, sized = size_tokens(spec, budget)
        job = job_dict(name, model, g, budget, data, gpus, spot_v, tokens=tokens)
    text = render(job, str(out), tokens_note)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}: {model} on {gpus}× {g}" + ("" if local else f" (spot: {_y(spot_v)})")
          + f", budget ${budget:g}. Next: dtrun up {out} --dry-run{later}" + (f"\n{sized}" if sized else ""))
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
    spot: Annotated[Optional[str], typer.Option("--spot", help="prefer (default), true (only spot) or false.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented job file that passes `dtrun up --dry-run` (asks on a terminal)."""
    raise typer.Exit(cmd_init(model, gpu, budget, data, out, force, gpus, spot))

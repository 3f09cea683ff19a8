"""``dtrun up``, its ``--dry-run`` and ``dtrun prices``: what fits, what it costs, whether it fits
the budget, then (without ``--dry-run``) the run itself. The dry run rents nothing and imports
neither torch nor sky nor boto3; the real run imports the controller when it starts."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from orchestrator.cli.options import JobArg, JsonOpt
from orchestrator.contract.errors import (
    EXIT_INVALID,
    EXIT_NO_FIT,
    EXIT_NO_OFFER,
    EXIT_OK,
    EXIT_OVER_BUDGET,
    EXIT_PROVIDER,
)

if TYPE_CHECKING:  # the plan imports pydantic and the presets: only when a command runs
    from orchestrator.plan.estimate import Plan
    from orchestrator.plan.spec import JobSpec
    from orchestrator.run.state import StateStore

RENTABLE = ("runpod", "lambda", "vast", "modal")


def _console(stderr: bool = False):
    """Rich on a terminal; without one (CI, a pipe) plain text wide enough not to truncate."""
    import sys as _sys

    from rich.console import Console

    stream = _sys.stderr if stderr else _sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, highlight=False, soft_wrap=False,
                   width=None if tty else 200, no_color=not tty)


def _money(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "∞"
    return f"${x:,.2f}"


def _hours(h: float) -> str:
    """Hours, always in hours (a column of "0.76 h" next to "45.4 min" reads wrong)."""
    if math.isinf(h):
        return "∞"
    return f"{h:,.1f} h" if h >= 10 else f"{h:.2f} h" if h >= 0.1 or h == 0 else f"{h:.3f} h"


def _flops(x: float) -> str:
    """A peak rate readable for a CPU (50 GFLOP/s, not "0 TFLOP/s") and for a GPU."""
    return f"{x / 1e12:,.0f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:,.0f} GFLOP/s"


def is_free(o: Any) -> bool:
    """An offer on this machine: nothing is rented, so it has no price (not a price of $0)."""
    return o.provider in ON_THIS_MACHINE and o.price_per_gpu_hour == 0


def price_note(o: Any) -> str:
    """The offers table's footnote text for an offer's price: where it came from."""
    if is_free(o):
        return f"{o.provider}: no price ({o.price_source}; nothing is rented)"
    return o.price_source


def footnotes(notes: list[str]) -> tuple[list[int], list[str]]:
    """(footnote number per row, the distinct notes in first-seen order)."""
    distinct: list[str] = []
    nums = []
    for n in notes:
        if n not in distinct:
            distinct.append(n)
        nums.append(distinct.index(n) + 1)
    return nums, distinct


FORCE_WARNING = ("--force: renting a plan that does NOT fit the GPU's memory by the planner's bytes: "
                 "the first step will most likely die of CUDA out-of-memory after provisioning and "
                 "setup were paid for, and every retry pays them again")


def run_spec(spec: JobSpec) -> JobSpec:
    """The spec the nodes will run: ``trainer.parallel: auto`` resolved to the planner's choice
    (degrees, micro-batch, activation checkpointing) — the smallest plan even when none fits, so
    the estimate prices what ``--force`` would rent. Explicit degrees: the spec itself."""
    if spec.trainer is None or spec.trainer.parallel != "auto":
        return spec
    from orchestrator.contract.errors import SpecError
    from orchestrator.plan.planner import resolve_parallel

    try:
        return resolve_parallel(spec, force=True)
    except SpecError:
        return spec  # no valid layout at all: the memory plan reports it


def plan_report(spec: JobSpec, plan: Plan) -> dict[str, Any]:
    """The dry run's JSON object (also what `dtrun up` shows before asking)."""
    out: dict[str, Any] = {"job": spec.name, "run_uri": spec.run_uri}
    out.update(plan.to_dict())
    if spec.command is not None:
        from orchestrator.run.codeship import code_report

        out["steps"] = spec.command.steps
        out["tokens"] = int(spec.command.tokens) if spec.command.tokens else None
        out["command"] = {"run": spec.command.run, "torchrun": spec.command.torchrun,
                          "checkpoint_format": spec.command.checkpoint_format,
                          "code": code_report(spec)}
        # Your code's memory is yours: no memory plan and no trainer traps for a command job.
        out.update({"plan": None, "fits_memory": True, "does_not_fit": None, "traps": []})
        if out.get("chosen") is not None:
            out["chosen"]["fits_memory"] = True
        return out
    out["steps"] = spec.trainer.total_steps
    out["tokens"] = spec.trainer.total_tokens
    extra = _memory_and_traps(spec, plan, out.get("offers") or [])
    out.update(extra)
    if out.get("chosen") is not None:
        out["chosen"]["fits_memory"] = out["fits_memory"]
    return out


def _memory_and_traps(spec: JobSpec, plan: Plan, offer_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The planner's memory plan and the known traps."""
    from orchestrator.plan import planner, traps

    out: dict[str, Any] = {}
    shown, _ = plan.shown
    gpu = shown.gpu if shown else spec.resources.gpu
    mem, why = planner.fit_check(spec, gpu=gpu)
    out["plan"] = mem.to_dict()
    if spec.trainer.parallel != "auto" and gpu == spec.resources.gpu:
        mine = planner.evaluate_spec_parallel(spec)  # what the nodes will run: the degrees you wrote
        if mine is not None:
            out["plan"]["spec_parallel"] = {**mine.to_dict(), "set_by_user": "parallel" in spec.trainer.model_fields_set}
    out["fits_memory"] = why is None
    out["does_not_fit"] = why
    # Which offers fit: the memory plan per distinct (GPU, GPUs per node, nodes) of the offers.
    seen: dict[tuple, bool] = {}
    for row, (o, _e, _u) in zip(offer_rows, plan.ranked()):
        key = (o.gpu, o.gpus_per_node, max(o.nodes, spec.resources.nodes))
        if key not in seen:
            if key == (gpu, spec.resources.gpus_per_node, spec.resources.nodes):
                seen[key] = why is None
            else:
                alt = spec.model_copy(update={"resources": spec.resources.model_copy(
                    update={"gpu": key[0], "gpus_per_node": key[1], "nodes": key[2]})})
                seen[key] = planner.fit_check(alt, gpu=key[0])[1] is None
        row["fits_memory"] = seen[key]
    found = traps.find_traps(spec, shown, mem)
    out["traps"] = [{"code": t.code, "message": t.message} for t in found]
    return out


def _what_to_cut(spec: JobSpec) -> str:
    """The fields that shorten the job (a command job has no trainer section)."""
    return "command.hours (or command.tokens)" if spec.command is not None else "trainer.tokens/steps"


def print_plan(spec: JobSpec, plan: Plan, report: dict[str, Any] | None = None, console=None) -> None:
    """Human-readable plan: ranked offers, the choice, the breakdown, the budget verdict."""
    from rich.markup import escape
    from rich.table import Table

    con = console or _console()
    report = report or plan_report(spec, plan)
    r = spec.resources
    spot_word = {True: "spot", False: "on-demand", "prefer": "spot or on-demand"}[r.spot]
    if spec.command is not None:
        c = spec.command
        con.print(f"[bold]{spec.name}[/]: your command ({'torchrun ' if c.torchrun else ''}{c.run}; "
                  f"checkpoints: {c.checkpoint_format}) on {r.nodes}×{r.gpus_per_node} {r.gpu} ({spot_word}); "
                  f"run URI {spec.run_uri}")
        code = report.get("command", {}).get("code") or {}
        con.print(f"  code           {code.get('folder')}: {code.get('files', 0)} files, "
                  f"{code.get('bytes', 0) / 2**20:.1f} MiB shipped")
        for left in code.get("left_out", []):
            con.print(f"[yellow]warning[/] not shipped: {left}")
    else:
        con.print(f"[bold]{spec.name}[/]: {spec.trainer.model if isinstance(spec.trainer.model, str) else 'custom model'}, "
                  f"{spec.trainer.total_steps:,} steps ({spec.trainer.total_tokens:,} tokens) on "
                  f"{r.nodes}×{r.gpus_per_node} {r.gpu} ({spot_word}); run URI {spec.run_uri}")
    from rich import box
    from rich.markup import escape

    ranked = plan.ranked()
    if ranked:
        rows = report.get("offers") or []
        fit = [bool(r.get("fits_memory", True)) for r in rows] or [True] * len(ranked)
        n_fit = sum(fit)
        order = ("cheapest expected cost first" if all(o.price_known for o, _e, _u in ranked)
                 else "cheapest expected cost first, unknown spot prices last")
        title = (f"Offers ({order}); every one fits memory" if n_fit == len(fit)
                 else f"Offers ({order}); {n_fit} of {len(fit)} fit memory"
                 if n_fit else f"Offers ({order}); NONE fits memory")
        if plan.locked:
            title += ("; * needs credentials (all)" if not plan.offers
                      else f"; * needs credentials (the last {len(plan.locked)})")
        # Fits 100 columns: the price source, often a long sentence, is a numbered footnote.
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
                  collapse_padding=True, show_edge=False)
        for col, j in [("#", "right"), ("provider", "left"), ("region", "left"), ("gpu", "left"),
                       ("n×gpu", "right"), ("spot", "left"), ("$/GPU-h", "right"),
                       ("$/h", "right"), ("hours", "right"), ("est. $", "right"), ("fits", "left"),
                       ("src", "right")]:
            t.add_column(col, justify=j, no_wrap=True)  # type: ignore[arg-type]
        nums, notes = footnotes([price_note(o) for o, _e, _u in ranked])
        for i, (o, e, usable) in enumerate(ranked, 1):
            ok = fit[i - 1] if i - 1 < len(fit) else True
            if not usable and i - 1 == len(plan.offers) and plan.offers:
                t.add_section()  # the line: offers below it need credentials
            style = ("bold green" if ok else "red") if i == 1 and usable else (None if ok else "red")
            if not usable:
                style = "dim" if ok else "dim red"
            free = is_free(o)
            t.add_row(str(i), o.provider + ("" if usable else "*"), o.region, o.gpu, f"{o.nodes}×{o.gpus_per_node}",
                      "spot" if o.spot else "on-dem.", "-" if free else f"{o.price_per_gpu_hour:.2f}",
                      "-" if free else f"{o.price_per_hour:.2f}", _hours(e.hours),
                      "-" if free else _money(e.cost_usd), "yes" if ok else "NO: mem", f"[{nums[i - 1]}]",
                      style=style)
        con.print(t)
        for k, note in enumerate(notes, 1):
            con.print(escape(f"[{k}] {note}"))
    for name, why in plan.unusable.items():
        con.print(f"[yellow]* needs credentials:[/] {escape(why)}")
    for reason in plan.refusals:
        con.print(f"[yellow]not offered:[/] {escape(reason)}")  # reasons quote `[default]`
    shown, est = plan.shown
    if shown and est:
        b = est.breakdown
        head = ("[bold]Chosen:[/]" if plan.chosen else
                "[bold]Would choose[/] (once its credentials are set; nothing can be rented yet):")
        if is_free(shown):
            con.print(f"{head} {shown.key()} ({b['gpus']} rank{'s' if b['gpus'] != 1 else ''}): {shown.provider}: no price")
        else:
            con.print(f"{head} {shown.key()} at ${shown.price_per_gpu_hour:.2f}/GPU-h "
                      f"× {b['gpus']} GPUs = ${b['price_per_hour']:.2f}/h")
        if b["hours_source"] == "budget.hours":
            con.print(f"  hours          {_hours(spec.budget.hours or 0)} (budget.hours)")
        elif spec.command is not None:
            src = b["hours_source"]
            if b["params"] and b["tokens"] and not src.startswith("command.hours"):
                src = (f"6 × {b['params'] / 1e6:,.1f}M params × {b['tokens'] / 1e9:,.3g}B tokens / "
                       f"({b['gpus']} × {_flops(b['peak_flops_per_gpu'])} × MFU {b['mfu']:.2f})")
            con.print(f"  compute        {_hours(b['compute_hours'])}  = {src}")
        elif b.get("step_floor_seconds") and b["step_seconds"] <= b["step_floor_seconds"]:
            con.print(f"  compute        {_hours(b['compute_hours'])}  = {b['steps']:,} steps × {b['step_seconds'] * 1e3:.1f} ms, "
                      f"the per-step floor (launching the step's kernels: operators × ~10 µs; the FLOPs alone "
                      f"would take {_hours(b['steps'] * b['flops_step_seconds'] / 3600)})")
        else:
            con.print(f"  compute        {_hours(b['compute_hours'])}  = 6 × {b['active_params'] / 1e6:,.1f}M params "
                      f"× {b['tokens'] / 1e9:,.3g}B tokens / ({b['gpus']} × {_flops(b['peak_flops_per_gpu'])} "
                      f"× MFU {b['mfu']:.2f})")
        if b["hours_source"] != "budget.hours":
            su = b.get("startup") or {}
            con.print(f"  start-up       {_hours(b['startup_hours'])}  (per start: provisioning "
                      f"{su.get('provisioning_minutes', 0):g} + setup {su.get('setup_minutes', 0):g}"
                      f" ({'prebuilt image' if su.get('prebuilt_image') else 'installs torch'})"
                      f" + first step {su.get('first_step_minutes', 0):g} + compile {su.get('compile_minutes', 0):g}"
                      " min; figures and sources: providers/data/prices.yaml)")
            if spec.command is not None:  # its saves are inside its own hours; no step count to show
                con.print(f"  checkpoints    (your script's own, every ~{spec.command.checkpoint_every_minutes:g} min "
                          "(command.checkpoint_every_minutes); their time is inside the hours above)")
            else:
                con.print(f"  checkpoints    {_hours(b['checkpoint_hours'])}  (every {b['checkpoint_every_steps']} steps)")
        if b["preemptions_per_hour"]:
            con.print(f"  preemptions    {_hours(b['preemption_overhead_hours'])}  "
                      f"(~{b['expected_preemptions']:.1f} at {b['preemptions_per_hour']:g}/h: restart + half an interval each)")
        if is_free(shown):
            con.print(f"  total          {_hours(est.hours)} (nothing rented: no money spent)")
        elif (b.get("deadline") or {}).get("cut"):  # no buffer: the deadline caps hours and money
            con.print(f"  total          {_hours(est.hours)} → [bold]{_money(est.cost_usd)}[/] ({b['buffer_basis']})")
        else:
            con.print(f"  total          {_hours(est.hours)} → expected {_money(est.expected_usd)}, "
                      f"with {b.get('buffer_basis') or f'{est.buffer:.0%} buffer'} [bold]{_money(est.cost_usd)}[/]")
    sc = plan.spot_choice
    if sc and sc.get("won"):
        con.print(f"[bold]Spot or on-demand:[/] {escape(sc['why'])}")
        for label, side in (("best spot", sc.get("spot")), ("best on-demand", sc.get("on_demand"))):
            if side:
                bid = f", bid ${side['spot_bid']:.2f}/GPU-h" if side.get("spot_bid") else ""
                pre = (f", ~{side['expected_preemptions']:.1f} preemptions at {side['preemptions_per_hour']:g}/h = "
                       f"{_hours(side['preemption_overhead_hours'])} overhead" if side.get("preemptions_per_hour") else "")
                con.print(f"  {label:15}{side['offer']} ${side['price_per_gpu_hour']:.2f}/GPU-h{bid}: expected "
                          f"{_money(side['expected_usd'])} over {_hours(side['hours'])}{pre}")
    mem = report.get("plan")
    if mem:
        ok = report.get("fits_memory", mem.get("fits"))
        fit = "fits" if ok else "does NOT fit"
        auto = mem.get("auto") or {}
        sp = mem.get("spec_parallel")
        if sp:
            whose = "your trainer.parallel" if sp.get("set_by_user", True) else "the default trainer.parallel (none set)"
            con.print(f"[bold]Memory:[/] {whose} ({sp['strategy']}) → {sp['memory_per_gpu_gb']:.1f} GB "
                      f"per GPU ({'fits' if sp['fits'] else 'does NOT fit'}); the planner's pick would be "
                      f"{mem.get('strategy')} at {mem.get('memory_per_gpu_gb', 0):.1f} GB")
        else:
            con.print(f"[bold]Memory:[/] {mem.get('strategy')}, micro-batch {mem.get('micro_batch_size')}, "
                      f"activation checkpointing {mem.get('activation_checkpointing')} → "
                      f"{mem.get('memory_per_gpu_gb', 0):.1f} GB per GPU ({fit})"
                      + (f"; auto chose {'; '.join(auto['changed'])}" if auto.get("changed") else ""))
        if mem.get("why") and not sp:
            con.print(f"  across nodes: {mem['why']}")
        if report.get("does_not_fit"):
            con.print(f"[red]Does not fit:[/] {report['does_not_fit']}")
    for trap in report.get("traps", []):
        con.print(f"[yellow]warning[/] [{trap['code']}] {trap['message']}")
    if est:
        dl = est.breakdown.get("deadline")
        if dl:
            trained = (f"by the deadline about {dl['fraction_trained']:.0%} of the run would be done"
                       if spec.command is not None else
                       f"by the deadline about {dl['steps_by_deadline']:,} of {spec.trainer.total_steps:,} steps "
                       f"({dl['fraction_trained']:.0%}, {dl['tokens_by_deadline']:,} tokens) would be trained")
            if dl["cut"]:
                con.print(f"[yellow]Deadline:[/] the estimate ({_hours(dl['estimate_hours'])}) is longer than "
                          f"budget.max_hours ({dl['max_hours']:g} h) and budget.cut_at_deadline is set: {trained}; "
                          "priced up to the deadline.")
            else:
                con.print(f"[red]Deadline:[/] the estimate ({_hours(dl['estimate_hours'])}) is longer than "
                          f"budget.max_hours ({dl['max_hours']:g} h): {trained}; nothing will be rented. Raise "
                          f"budget.max_hours, cut {_what_to_cut(spec)}, or set budget.cut_at_deadline: true if "
                          "the deadline is meant to cut the run.")
        max_h = spec.budget.max_hours
        if spec.budget.max_usd is None and max_h is None:
            con.print("[yellow]Budget:[/] neither budget.max_usd nor budget.max_hours is set: nothing caps the spend.")
        elif spec.budget.max_usd is None:
            cap = est.breakdown["price_per_hour"] * max_h
            con.print(f"[yellow]Budget:[/] no budget.max_usd set: only budget.max_hours ({max_h:g} h) caps the "
                      f"spend, at about {_money(cap)} at the chosen offer's price.")
        elif est.cost_usd <= spec.budget.max_usd:
            con.print(f"[green]Budget:[/] {_money(est.cost_usd)} ≤ {_money(spec.budget.max_usd)}: within budget"
                      + (" — but the plan does not fit memory (see above)." if report.get("does_not_fit")
                         else " — but not within the deadline (above)." if dl and not dl["cut"] else "."))
        else:
            con.print(f"[red]Budget:[/] {_money(est.cost_usd)} > {_money(spec.budget.max_usd)}: over budget; "
                      f"nothing will be rented. Raise budget.max_usd, cut {_what_to_cut(spec)}, or allow cheaper offers.")


ON_THIS_MACHINE = ("local", "fake")


def check_run_uri_reachable(spec, plan, source: str) -> None:
    """The run URI is the only channel between controller and nodes: a rented node cannot reach
    this machine's disk (it would fail to read job.yaml after provisioning was paid for)."""
    if not spec.run_uri.startswith("file://"):
        return
    remote = sorted({o.provider for o in plan.offers if o.provider not in ON_THIS_MACHINE})
    if remote:
        from orchestrator.contract.errors import SpecError

        raise SpecError(f"{source}: checkpoint.uri {spec.checkpoint.uri!r} is on this machine's disk, which "
                        f"nodes rented on {', '.join(remote)} cannot reach; use an s3:// run URI "
                        "(e.g. checkpoint.uri: s3://my-bucket/dtrun/{name}); nothing rented")


def verdict_exit_code(spec: JobSpec, plan: Plan, report: dict[str, Any], strict: bool,
                      force: bool = False) -> int:
    """4 when the plan does not fit memory (unless ``force``), 2 for traps under ``strict``,
    4 with no offer, 3 over budget, else 0."""
    if report.get("does_not_fit") and not force:
        return EXIT_NO_FIT
    traps = [t for t in report.get("traps", []) if not (force and t.get("code") == "does-not-fit")]
    if strict and traps:
        return EXIT_INVALID
    if plan.chosen is None:
        # Offers exist, but only from providers without credentials: a provider refusal (5).
        return EXIT_PROVIDER if plan.unusable else EXIT_NO_OFFER
    if not plan.within_budget:
        return EXIT_OVER_BUDGET
    return EXIT_OK


def cmd_dry_run(job: Path, json_out: bool, strict: bool = False, force: bool = False) -> int:
    from orchestrator.plan.estimate import make_plan
    from orchestrator.plan.spec import load_spec
    from orchestrator.run.datacheck import check_data_vocab

    from orchestrator.run.uricheck import check_offline

    spec = load_spec(job)
    check_offline(spec, str(job))  # malformed, unusable scheme, unwritable run folder, no shards: exit 6
    check_data_vocab(spec, str(job), remote=False)
    refreshed = refresh_prices(list(spec.resources.providers), stale_only=True)
    plan = make_plan(run_spec(spec), usable_only=True)
    check_run_uri_reachable(spec, plan, str(job))
    report = plan_report(spec, plan)
    report["price_refresh"] = refreshed
    code = verdict_exit_code(spec, plan, report, strict, force)
    if force and report.get("does_not_fit"):
        report["warnings"] = [FORCE_WARNING]
    if json_out:
        report["exit_code"] = code
        sys.stdout.write(json.dumps(report, default=_json_default) + "\n")
        return code
    print_plan(spec, plan, report)
    if report.get("does_not_fit"):
        if force:
            _console(stderr=True).print(f"[yellow]warning:[/] {FORCE_WARNING}")
        else:
            _console(stderr=True).print(f"[red]Refused (exit 4):[/] {report['does_not_fit']}; nothing will be "
                                        "rented (--force rents it anyway)")
    if plan.chosen is None:
        from rich.markup import escape

        exit5 = "; exit 5" if code == EXIT_PROVIDER else ""  # a refusal above (exit 4) decides the code

        if plan.would_choose is not None:
            w = plan.would_choose
            _console(stderr=True).print(
                f"[red]No usable provider (nothing rented{exit5}):[/] would choose {escape(w.key())} once its "
                f"credentials are set: {escape(plan.unusable.get(w.provider, ''))}. To explore without any "
                f"account: `dtrun simulate {escape(str(job))}` (the real controller on a fake cloud).")
        elif plan.unusable:
            why = "; ".join(plan.unusable.values())
            _console(stderr=True).print(f"[red]No usable provider (nothing rented{exit5}):[/] {escape(why)}")
        else:
            why = "; ".join(plan.refusals) or "no provider offers this GPU"
            _console(stderr=True).print(f"[red]No offer fits:[/] {escape(why)}")
    if strict and report.get("traps"):
        _console(stderr=True).print(f"[red]--strict:[/] {len(report['traps'])} known trap(s) found")
    return code


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isinf(o):
        return None
    return str(o)


def refresh_prices(clouds: list[str] | None, stale_only: bool) -> list[dict[str, Any]]:
    """Run SkyPilot's fetchers (``providers.skypilot.prices``); one line per cloud on stderr."""
    from providers.skypilot import prices as live

    if stale_only:
        results = live.refresh_stale([c for c in (clouds or live.CLOUDS) if c in live.CLOUDS])
    else:
        results = live.refresh(clouds)
        if not results:
            why = "; ".join(f"{c}: {p}" for c, p in live.usable_clouds().items() if p)
            sys.stderr.write(f"prices: no cloud with usable credentials to refresh ({why}); "
                             "prices stay the cached catalogs or the bundled snapshot\n")
    for r in results:
        sys.stderr.write(f"prices: {r.message}\n")
    return [r.to_dict() for r in results]


def cmd_prices(gpu: str | None, json_out: bool, spot: bool | None, refresh: bool = False) -> None:
    import time

    from orchestrator.contract.errors import UsageError
    from orchestrator.contract.gpus import canonical_gpu
    from providers import registry
    from providers.catalog import UNKNOWN_SPOT, all_rows

    if gpu is not None:
        g = canonical_gpu(gpu)
        if g is None:
            from orchestrator.contract.gpus import GPUS

            raise UsageError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
        gpu = g
    refreshed = refresh_prices(None, stale_only=False) if refresh else []
    caps = {}
    for name in RENTABLE:
        c = registry.get(name).capabilities()
        caps[name] = {
            "spot": {"supported": c.spot.supported, "reason": c.spot.reason},
            "multi_node": {"supported": c.multi_node.supported, "reason": c.multi_node.reason},
            "max_gpus_per_node": c.max_gpus_per_node,
        }
    rows = []
    for r in all_rows(gpu):
        kinds = []
        if spot is not True:
            kinds.append((False, r.price, r.source))
        if spot is not False and r.spot_sold and caps[r.provider]["spot"]["supported"]:
            if r.spot_price is not None:
                kinds.append((True, r.spot_price, r.source + (f"; {r.spot_note}" if r.spot_note else "")))
            else:
                kinds.append((True, r.price, f"{r.source}; {UNKNOWN_SPOT}"
                              + (f" ({r.spot_note})" if r.spot_note else "")))
        for is_spot, price, source in kinds:
            known = not is_spot or r.spot_price is not None
            rows.append({
                "provider": r.provider, "region": r.region, "gpu": r.gpu,
                "gpus_per_node": r.gpus_per_node, "spot": is_spot,
                "price_per_gpu_hour": round(price, 4), "price_source": source, "price_date": r.date,
                "price_known": known,
                "spot_bid": round(price, 4) if is_spot and known and r.fetched_at is not None else None,
                "price_fetched_at": r.fetched_at,
                "price_age_seconds": round(time.time() - r.fetched_at, 1) if r.fetched_at else None,
                "note": r.note,
            })
    if json_out:
        sys.stdout.write(json.dumps({"prices": rows, "capabilities": caps, "refresh": refreshed}) + "\n")
        return
    from rich.table import Table

    con = _console()
    t = Table(title=f"Prices{' for ' + gpu if gpu else ''} (USD per GPU-hour)", title_justify="left")
    for col in ("gpu", "provider", "region", "gpus/node", "spot", "$/GPU-h", "source"):
        t.add_column(col)
    for row in rows:
        t.add_row(row["gpu"], row["provider"], row["region"], str(row["gpus_per_node"]),
                  "spot" if row["spot"] else "on-demand", f"{row['price_per_gpu_hour']:.2f}",
                  row["price_source"] + (f" ({row['note']})" if row["note"] else ""))
    con.print(t)
    if gpu is not None and not rows:  # an empty table says nothing by itself
        from rich.markup import escape

        priced = sorted({r.gpu for r in all_rows(None)})
        con.print(escape(f"no provider lists a price for {gpu}" + (" (local CPU runs are free: providers: [local])"
                  if gpu == "cpu" else "") + f"; GPUs with prices: {', '.join(priced)}"))
    for name, c in caps.items():
        parts = []
        for k in ("spot", "multi_node"):
            parts.append(f"{k.replace('_', '-')}: {'yes' if c[k]['supported'] else 'no'}"
                         + (f" ({c[k]['reason']})" if c[k]["reason"] else ""))
        con.print(f"[bold]{name}[/]: " + "; ".join(parts) + f"; ≤{c['max_gpus_per_node']} GPUs/node")

# ---- up ------------------------------------------------------------------------------------------

def spawn_detached(store: StateStore, name: str, args: list[str]) -> int:
    """Start ``python -m orchestrator.cli.detached ARGS`` in its own session; its pid once it
    has claimed the job (or raise with its log's tail if it died first)."""
    import os
    import subprocess
    import time

    from orchestrator.contract.errors import EXIT_JOB_FAILED
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
            from orchestrator.contract.errors import DtrunError

            err = DtrunError(f"the detached controller exited ({rc}) before starting:\n{tail}")
            err.exit_code = rc if rc in (2, 3, 4, 5, 6) else EXIT_JOB_FAILED
            raise err
        time.sleep(0.1)
    return proc.pid


def check_recorded_run_uri(store, spec, new_run_uri: bool) -> None:
    """A job name already recorded with another run URI (the spec moved, or a relative URI once
    followed the working directory) would train twice into two places: refused naming both,
    unless ``--new-run-uri`` (and never while the recorded run is still going)."""
    from orchestrator.contract.errors import UsageError
    from orchestrator.run.state import TERMINAL_STATES

    row = store.get_job(spec.name)
    if row is None or row["run_uri"] == spec.run_uri:
        return
    if row["state"] not in TERMINAL_STATES:
        raise UsageError(f"{spec.name} is recorded ({row['state']}) with run URI {row['run_uri']}, but the job file "
                         f"now says {spec.run_uri}; stop it first (`dtrun down {spec.name}`) or give "
                         "checkpoint.uri the recorded URI; nothing rented")
    if not new_run_uri:
        raise UsageError(f"{spec.name} is recorded with run URI {row['run_uri']}, but the job file now says "
                         f"{spec.run_uri}: a new run would start from scratch there. Pass --new-run-uri to do "
                         "that, or set checkpoint.uri back to the recorded URI; nothing rented")


def cmd_up(job: Path, yes: bool = False, detach: bool = False, json_out: bool = False, strict: bool = False,
           force: bool = False, new_run_uri: bool = False) -> int:
    from orchestrator.cli.jobs import _ask, _err, _tty_in, job_status
    from orchestrator.contract.errors import EXIT_INTERRUPTED, ProviderRefused
    from orchestrator.plan.estimate import make_plan
    from orchestrator.plan.spec import load_spec
    from orchestrator.run.datacheck import check_data_vocab
    from orchestrator.run.state import TERMINAL_STATES, StateStore, dtrun_home

    from orchestrator.run import uricheck

    written = load_spec(job)
    uricheck.check_offline(written, str(job))  # exit 6 before any network or spend
    check_data_vocab(written, str(job))
    # What the nodes run: auto resolved (degrees, micro-batch, checkpointing); the report judges
    # the spec as written (what auto was allowed to change).
    spec = run_spec(written)
    refresh_prices(list(spec.resources.providers), stale_only=True)
    plan = make_plan(spec, usable_only=True)
    if plan.chosen is None and plan.unusable:
        # Every offer is on a provider whose credentials are missing: exit 5 before any spend,
        # naming the file to write (SkyPilot reads ~/.runpod/config.toml, not RUNPOD_API_KEY).
        raise ProviderRefused("; ".join(plan.unusable.values()) + "; nothing rented")
    report = plan_report(written, plan)
    code = verdict_exit_code(written, plan, report, strict, force)
    out = sys.stderr if json_out else sys.stdout
    if not json_out:
        print_plan(written, plan, report)
    if code == EXIT_OK and report.get("does_not_fit"):
        _err(f"warning: {FORCE_WARNING}")
    if code != EXIT_OK:
        if report.get("does_not_fit") and not force:
            _err(f"the plan does not fit memory: {report['does_not_fit']}; nothing rented "
                 "(--force rents it anyway)")
        elif plan.chosen is None:
            _err("no offer fits: " + ("; ".join(plan.refusals) or "no provider offers this GPU") + "; nothing rented")
        elif code == EXIT_INVALID:
            _err(f"--strict: {len(report.get('traps', []))} known trap(s); nothing rented")
        elif (plan.estimate and (dl := plan.estimate.breakdown.get("deadline")) and not dl["cut"]):
            _err(f"the estimate ({_hours(dl['estimate_hours'])}) is longer than budget.max_hours "
                 f"({dl['max_hours']:g} h): about {dl['fraction_trained']:.0%} of the run would be done by then; "
                 "nothing rented (budget.cut_at_deadline: true if it is meant to cut)")
        else:
            _err("the estimate is over budget.max_usd; nothing rented")
        return code
    check_run_uri_reachable(spec, plan, str(job))
    _check_credentials(plan.chosen.provider)
    # A remote node needs the object store's AWS credentials (exit 5 naming what to set).
    from orchestrator.run.nodecreds import node_storage

    node_storage(spec, plan.chosen.provider)
    # S3 credentials, a write/read/list/delete probe of the run URI, remote data shards: exit 6.
    uricheck.check_online(spec, str(job))

    store = StateStore()
    check_recorded_run_uri(store, spec, new_run_uri)
    existing = store.get_job(spec.name)
    if existing and StateStore.controller_alive(existing):
        _err(f"{spec.name} is already running under controller pid {existing['controller_pid']}; "
             f"see `dtrun status {spec.name}`, `dtrun logs {spec.name} -f`, or stop it with `dtrun down {spec.name}`")
        return EXIT_INVALID
    from orchestrator.contract import runuri

    continuing = existing is not None and existing["state"] not in TERMINAL_STATES
    if not continuing and runuri.exists(runuri.join(spec.run_uri, runuri.DONE)):
        print(f"{spec.name} already finished: {spec.run_uri} has DONE (remove it to train again); nothing rented",
              file=out)
        if json_out:
            st = job_status(store, existing) if existing else {"name": spec.name, "state": "SUCCEEDED"}
            sys.stdout.write(json.dumps(st) + "\n")
        return EXIT_OK
    if continuing:
        live = store.nodes(spec.name, live_only=True)
        print(f"continuing {spec.name} ({existing['state']}, step {existing['step'] or 0}): "
              f"re-attaching to {len(live)} live node(s); new attempts resume from the newest checkpoint", file=out)
    else:
        lc = runuri.latest_committed(spec.run_uri)
        if lc:
            print(f"{spec.run_uri} has a checkpoint at step {lc[0]}: the trainer resumes from it", file=out)

    if not yes:
        if not _tty_in():
            _err("refusing to rent without confirmation: there is no terminal to ask on; "
                 "pass --yes to start without asking")
            return EXIT_INVALID
        ans = _ask(f"Start {spec.name} on {plan.chosen.key()}? [y/N] ")
        if ans not in ("y", "yes"):
            print("not started; nothing rented")
            return EXIT_INTERRUPTED

    if not continuing:
        # Before the expensive part: can the run URI hold a checkpoint that restores? (On by
        # default for spot; `checkpoint.preflight` decides.) Raises PreflightError → one line.
        from orchestrator.run.preflight import maybe_preflight

        pf = maybe_preflight(spec)
        if pf is not None:
            print(f"restore preflight passed against {spec.run_uri} ({pf.seconds:.1f} s)", file=out)

    if detach:
        pid = spawn_detached(store, spec.name, ["--spec", str(Path(job).resolve())] + (["--force"] if force else []))
        msg = (f"{spec.name}: controller running in the background (pid {pid}); "
               f"log {dtrun_home() / 'logs' / spec.name / 'controller.log'}\n"
               f"  dtrun status {spec.name}   dtrun logs {spec.name} -f   dtrun down {spec.name}")
        print(msg, file=out)
        if json_out:
            row = store.get_job(spec.name)
            sys.stdout.write(json.dumps(job_status(store, row) if row else {"name": spec.name}) + "\n")
        return EXIT_OK
    return _foreground(spec, plan, store, str(Path(job).resolve()), json_out)


def _check_credentials(provider: str) -> None:
    """The chosen offer's provider has credentials (its standard place), else exit 5 before the
    controller starts: nothing rented, no provider SDK started."""
    from orchestrator.contract.errors import ProviderRefused
    from providers import errors as perr
    from providers import registry

    try:
        registry.get(provider).check_credentials()
    except perr.AuthError as e:
        raise ProviderRefused(f"{e}; nothing rented") from None


def _foreground(spec, plan, store: StateStore, spec_path: str, json_out: bool) -> int:
    import signal

    from orchestrator.cli.jobs import _ask, _fmt_wall, _tty_in, _tty_out, job_status
    from orchestrator.cli.live import PlainView, RichView
    from orchestrator.contract.errors import EXIT_JOB_FAILED
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import TERMINAL_STATES

    tty = _tty_out() and not json_out
    view = RichView(store, spec.name) if tty else PlainView(store, spec.name, out=sys.stderr if json_out else None)
    ctl = Controller(spec, store, plan=plan, spec_path=spec_path, on_event=view.event)
    flag = {"n": 0}

    def _sigint(signum, frame):
        flag["n"] += 1

    old = signal.signal(signal.SIGINT, _sigint)
    old_term = signal.signal(signal.SIGTERM, _sigint)
    try:
        with view:
            state = ctl.run(should_pause=lambda: flag["n"] > 0, on_tick=view.update)
        while state == "INTERRUPTED":
            choice = "t"
            if _tty_in() and not json_out:
                flag["n"] = 0
                signal.signal(signal.SIGINT, old)
                try:
                    choice = _ask("\nInterrupted. [d]etach (keep running in the background), "
                                  "[t]ear down (checkpoint, then terminate), [n]ow (terminate at once), "
                                  "[c]ontinue? ") or "t"
                except KeyboardInterrupt:
                    choice = "n"
                signal.signal(signal.SIGINT, _sigint)
            else:
                view.line("interrupted without a terminal: tearing down gracefully "
                          "(checkpoint, then terminate; interrupt again to terminate at once)")
            flag["n"] = 0
            if choice.startswith("d"):
                pid = spawn_detached(store, spec.name, ["--job", spec.name])
                print(f"{spec.name}: detached; controller pid {pid}. "
                      f"dtrun status {spec.name} / dtrun logs {spec.name} -f / dtrun down {spec.name}")
                return EXIT_OK
            if choice.startswith("t") or choice.startswith("n"):
                store.request_action(spec.name, "stop_now" if choice.startswith("n") else "stop")

            def pause() -> bool:
                if flag["n"] > 0:
                    store.request_action(spec.name, "stop_now")
                    flag["n"] = 0
                return False

            with view:
                state = ctl.run(should_pause=pause if not choice.startswith("c") else (lambda: flag["n"] > 0),
                                on_tick=view.update)
    finally:
        signal.signal(signal.SIGINT, old)
        signal.signal(signal.SIGTERM, old_term)
        if ctl.started and ctl.state not in TERMINAL_STATES:
            store.release_controller(spec.name)
    s = ctl.summary()
    job = store.get_job(spec.name) or {}
    summary = (f"{state}: wall {_fmt_wall(s['wall_s'])}, cost ${s['cost_usd']:.4f}, {s['attempts']} attempt(s), "
               f"{s['steps_lost']} steps lost to preemptions, step {s['step']}/{s['steps']}")
    if json_out:
        sys.stdout.write(json.dumps(job_status(store, job)) + "\n")
        sys.stderr.write(summary + "\n")
    else:
        print(summary)
        if state != "SUCCEEDED" and job.get("reason"):
            print(f"reason: {job['reason']}")
    return EXIT_OK if state == "SUCCEEDED" else EXIT_JOB_FAILED

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def schema() -> None:
    """Print the job spec's JSON schema (for editor completion)."""
    import json

    from orchestrator.plan.spec import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))


@app.command()
def prices(
    gpu: Annotated[Optional[str], typer.Argument(help="Only this GPU type (e.g. H100).")] = None,
    json_out: JsonOpt = False,
    spot: Annotated[Optional[bool], typer.Option("--spot/--on-demand", help="Only spot or only on-demand.")] = None,
    refresh: Annotated[bool, typer.Option(
        "--refresh", help="Fetch live prices (SkyPilot's fetchers) for the clouds with usable credentials first.")] = False,
) -> None:
    """Print the price table: provider, region, GPU, spot, $/GPU-hour and where each price came from."""
    cmd_prices(gpu, json_out, spot, refresh)


@app.command()
def up(
    job: JobArg,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Estimate and plan only; rent nothing.")] = False,
    json_out: JsonOpt = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Run the controller in the background.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Known traps are errors (exit 2), not warnings.")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Rent even when the plan does not fit the GPU's memory (exit 4 otherwise); warns.")] = False,
    new_run_uri: Annotated[bool, typer.Option(
        "--new-run-uri", help="The job is recorded with another run URI: start over at the spec's one.")] = False,
) -> None:
    """Estimate, confirm, then run the job to the end (or only estimate, with --dry-run)."""
    if dry_run:
        raise typer.Exit(cmd_dry_run(job, json_out, strict, force))
    raise typer.Exit(cmd_up(job, yes=yes, detach=detach, json_out=json_out, strict=strict, force=force,
                            new_run_uri=new_run_uri))

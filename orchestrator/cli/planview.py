"""The plan view: what ``dtrun up`` and its ``--dry-run`` show of a plan before anything is rented.

:func:`plan_report` is the dry run's JSON object (the plan, the memory plan, which offers fit,
the known traps); :func:`print_plan` prints it for a person: the ranked offers with their price
sources as footnotes, the choice, the breakdown of hours and money, memory, traps, the deadline
and the budget verdict. :func:`verdict_exit_code` and :func:`refusal` say what refuses a plan.
Rich is imported when something is printed; the plan itself comes from
``orchestrator.run.prepare``."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from orchestrator.contract.errors import (
    EXIT_INVALID,
    EXIT_NO_FIT,
    EXIT_NO_OFFER,
    EXIT_OK,
    EXIT_OVER_BUDGET,
    EXIT_PROVIDER,
)
from orchestrator.contract.gpus import gpu_matches

if TYPE_CHECKING:  # the plan imports pydantic and the presets: only when a command runs
    from orchestrator.plan.estimate import Plan
    from orchestrator.plan.spec import JobSpec

ON_THIS_MACHINE = ("local", "fake")
"""Providers whose nodes run on this machine: nothing is rented, an offer has no price."""


def rich_console(stderr: bool = False):
    """Rich on a terminal; without one (CI, a pipe) plain text wide enough not to truncate."""
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    return Console(stderr=stderr, highlight=False, soft_wrap=False,
                   width=None if tty else 200, no_color=not tty)


def fmt_money(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "∞"
    return f"${x:,.2f}"


def fmt_hours(h: float) -> str:
    """Hours, always in hours (a column of "0.76 h" next to "45.4 min" reads wrong)."""
    if math.isinf(h):
        return "∞"
    return f"{h:,.1f} h" if h >= 10 else f"{h:.2f} h" if h >= 0.1 or h == 0 else f"{h:.3f} h"


def fmt_flops(x: float) -> str:
    """A peak rate readable for a CPU (50 GFLOP/s, not "0 TFLOP/s") and for a GPU."""
    return f"{x / 1e12:,.0f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:,.0f} GFLOP/s"


def fmt_count(n: float) -> str:
    """A count of tokens or parameters in three significant figures with K/M/B/T: 154K, 8B,
    1.41T (not "0.000154B" or "1.41e+03B")."""
    if math.isinf(n):
        return "∞"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div * 0.9995:  # 999,950 is "1M", not "1e+03K"
            v = n / div
            return f"{v:,.0f}{unit}" if abs(v) >= 99.95 else f"{float(f'{v:.3g}'):g}{unit}"
    return f"{n:,.0f}"


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
    if spec.trainer.parallel != "auto" and gpu_matches(spec.resources.gpu, gpu):
        mine = planner.evaluate_spec_parallel(spec, gpu=gpu)  # what the nodes will run: the degrees you wrote
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
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    con = console or rich_console()
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
                      "-" if free else f"{o.price_per_hour:.2f}", fmt_hours(e.hours),
                      "-" if free else fmt_money(e.cost_usd), "yes" if ok else "NO: mem", f"[{nums[i - 1]}]",
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
            con.print(f"  hours          {fmt_hours(spec.budget.hours or 0)} (budget.hours)")
        elif spec.command is not None:
            src = b["hours_source"]
            if b["params"] and b["tokens"] and not src.startswith("command.hours"):
                src = (f"6 × {fmt_count(b['params'])} params × {fmt_count(b['tokens'])} tokens / "
                       f"({b['gpus']} × {fmt_flops(b['peak_flops_per_gpu'])} × MFU {b['mfu']:.2f})")
            con.print(f"  compute        {fmt_hours(b['compute_hours'])}  = {src}")
        elif b.get("step_floor_seconds") and b["step_seconds"] <= b["step_floor_seconds"]:
            con.print(f"  compute        {fmt_hours(b['compute_hours'])}  = {b['steps']:,} steps × {b['step_seconds'] * 1e3:.1f} ms, "
                      f"the per-step floor (launching the step's kernels: operators × ~10 µs; the FLOPs alone "
                      f"would take {fmt_hours(b['steps'] * b['flops_step_seconds'] / 3600)})")
        else:
            con.print(f"  compute        {fmt_hours(b['compute_hours'])}  = 6 × {fmt_count(b['active_params'])} params "
                      f"× {fmt_count(b['tokens'])} tokens / ({b['gpus']} × {fmt_flops(b['peak_flops_per_gpu'])} "
                      f"× MFU {b['mfu']:.2f})")
        if b.get("pipeline") and b["hours_source"] != "budget.hours":
            pp = b["pipeline"]
            floor = b.get("step_floor_seconds") and b["step_seconds"] <= b["step_floor_seconds"]
            con.print(f"  pipeline bubble: {pp['bubble']:.1%} ({pp['schedule']}, {pp['microbatches']} microbatches, "
                      f"pp {pp['pp']}; {'under the per-step floor' if floor else 'in the compute above'})")
        if b["hours_source"] != "budget.hours":
            su = b.get("startup") or {}
            con.print(f"  start-up       {fmt_hours(b['startup_hours'])}  (per start: provisioning "
                      f"{su.get('provisioning_minutes', 0):g} + setup {su.get('setup_minutes', 0):g}"
                      f" ({'prebuilt image' if su.get('prebuilt_image') else 'installs torch'})"
                      f" + first step {su.get('first_step_minutes', 0):g} + compile {su.get('compile_minutes', 0):g}"
                      " min; figures and sources: providers/data/prices.yaml)")
            if spec.command is not None:  # its saves are inside its own hours; no step count to show
                con.print(f"  checkpoints    (your script's own, every ~{spec.command.checkpoint_every_minutes:g} min "
                          "(command.checkpoint_every_minutes); their time is inside the hours above)")
            else:
                con.print(f"  checkpoints    {fmt_hours(b['checkpoint_hours'])}  (every {b['checkpoint_every_steps']} steps)")
        if b["preemptions_per_hour"]:
            con.print(f"  preemptions    {fmt_hours(b['preemption_overhead_hours'])}  "
                      f"(~{b['expected_preemptions']:.1f} at {b['preemptions_per_hour']:g}/h: restart + half an interval each)")
        if is_free(shown):
            con.print(f"  total          {fmt_hours(est.hours)} (nothing rented: no money spent)")
        elif (b.get("deadline") or {}).get("cut"):  # no buffer: the deadline caps hours and money
            con.print(f"  total          {fmt_hours(est.hours)} → [bold]{fmt_money(est.cost_usd)}[/] ({b['buffer_basis']})")
        else:
            con.print(f"  total          {fmt_hours(est.hours)} → expected {fmt_money(est.expected_usd)}, "
                      f"with {b.get('buffer_basis') or f'{est.buffer:.0%} buffer'} [bold]{fmt_money(est.cost_usd)}[/]")
    sc = plan.spot_choice
    if sc and sc.get("won"):
        con.print(f"[bold]Spot or on-demand:[/] {escape(sc['why'])}")
        for label, side in (("best spot", sc.get("spot")), ("best on-demand", sc.get("on_demand"))):
            if side:
                bid = f", bid ${side['spot_bid']:.2f}/GPU-h" if side.get("spot_bid") else ""
                pre = (f", ~{side['expected_preemptions']:.1f} preemptions at {side['preemptions_per_hour']:g}/h = "
                       f"{fmt_hours(side['preemption_overhead_hours'])} overhead" if side.get("preemptions_per_hour") else "")
                con.print(f"  {label:15}{side['offer']} ${side['price_per_gpu_hour']:.2f}/GPU-h{bid}: expected "
                          f"{fmt_money(side['expected_usd'])} over {fmt_hours(side['hours'])}{pre}")
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
                con.print(f"[yellow]Deadline:[/] the estimate ({fmt_hours(dl['estimate_hours'])}) is longer than "
                          f"budget.max_hours ({dl['max_hours']:g} h) and budget.cut_at_deadline is set: {trained}; "
                          "priced up to the deadline.")
            else:
                con.print(f"[red]Deadline:[/] the estimate ({fmt_hours(dl['estimate_hours'])}) is longer than "
                          f"budget.max_hours ({dl['max_hours']:g} h): {trained}; nothing will be rented. Raise "
                          f"budget.max_hours, cut {_what_to_cut(spec)}, or set budget.cut_at_deadline: true if "
                          "the deadline is meant to cut the run.")
        max_h = spec.budget.max_hours
        if spec.budget.max_usd is None and max_h is None:
            con.print("[yellow]Budget:[/] neither budget.max_usd nor budget.max_hours is set: nothing caps the spend.")
        elif spec.budget.max_usd is None:
            cap = est.breakdown["price_per_hour"] * max_h
            con.print(f"[yellow]Budget:[/] no budget.max_usd set: only budget.max_hours ({max_h:g} h) caps the "
                      f"spend, at about {fmt_money(cap)} at the chosen offer's price.")
        elif est.cost_usd <= spec.budget.max_usd:
            con.print(f"[green]Budget:[/] {fmt_money(est.cost_usd)} ≤ {fmt_money(spec.budget.max_usd)}: within budget"
                      + (" — but the plan does not fit memory (see above)." if report.get("does_not_fit")
                         else " — but not within the deadline (above)." if dl and not dl["cut"] else "."))
        else:
            con.print(f"[red]Budget:[/] {fmt_money(est.cost_usd)} > {fmt_money(spec.budget.max_usd)}: over budget; "
                      f"nothing will be rented. Raise budget.max_usd, cut {_what_to_cut(spec)}, or allow cheaper offers.")


def verdict_exit_code(spec: JobSpec, plan: Plan, report: dict[str, Any], strict: bool,
                      force: bool = False) -> int:
    """The plan's verdict, the first that applies (docs/commands.md, "When several things are
    wrong"): 4 when the plan does not fit memory (unless ``force``), 2 for traps under ``strict``,
    3 over budget (or over budget.max_hours) — also when only offers that need credentials are
    priced: the verdict the user asked for comes before what is not set up yet —, 5 when every
    offer needs credentials, 4 with no offer, else 0."""
    if report.get("does_not_fit") and not force:
        return EXIT_NO_FIT
    traps = [t for t in report.get("traps", []) if not (force and t.get("code") == "does-not-fit")]
    if strict and traps:
        return EXIT_INVALID
    _shown, est = plan.shown
    if est is not None and not est.within_budget:
        return EXIT_OVER_BUDGET
    if plan.chosen is None:
        # Offers exist, but only from providers without credentials: a provider refusal (5).
        return EXIT_PROVIDER if plan.unusable else EXIT_NO_OFFER
    return EXIT_OK


def refusal(plan: Plan, report: dict[str, Any], code: int, force: bool) -> str:
    """Why ``dtrun up`` rents nothing for a verdict other than 0: one line for stderr."""
    if report.get("does_not_fit") and not force:
        return (f"the plan does not fit memory: {report['does_not_fit']}; nothing rented "
                "(--force rents it anyway)")
    if code == EXIT_INVALID:
        return f"--strict: {len(report.get('traps', []))} known trap(s); nothing rented"
    if plan.chosen is None and code != EXIT_OVER_BUDGET:
        return "no offer fits: " + ("; ".join(plan.refusals) or "no provider offers this GPU") + "; nothing rented"
    _shown, est = plan.shown
    dl = est.breakdown.get("deadline") if est else None
    if dl and not dl["cut"]:
        return (f"the estimate ({fmt_hours(dl['estimate_hours'])}) is longer than budget.max_hours "
                f"({dl['max_hours']:g} h): about {dl['fraction_trained']:.0%} of the run would be done by then; "
                "nothing rented (budget.cut_at_deadline: true if it is meant to cut)")
    over = (f" ({fmt_money(est.cost_usd)} > {fmt_money(est.budget_usd)})"
            if est is not None and est.budget_usd is not None else "")
    return f"the estimate is over budget.max_usd{over}; nothing rented"


def print_refusals(plan: Plan, report: dict[str, Any], code: int, strict: bool, force: bool, job: str) -> None:
    """The dry run's notes on stderr under the plan: what refuses it, or the --force warning."""
    from rich.markup import escape

    err = rich_console(stderr=True)
    if report.get("does_not_fit"):
        if force:
            err.print(f"[yellow]warning:[/] {FORCE_WARNING}")
        else:
            err.print(f"[red]Refused (exit 4):[/] {report['does_not_fit']}; nothing will be "
                      "rented (--force rents it anyway)")
    if plan.chosen is None:
        exit5 = "; exit 5" if code == EXIT_PROVIDER else ""  # a refusal above (exit 4) decides the code
        if plan.would_choose is not None:
            w = plan.would_choose
            err.print(f"[red]No usable provider (nothing rented{exit5}):[/] would choose {escape(w.key())} once its "
                      f"credentials are set: {escape(plan.unusable.get(w.provider, ''))}. To explore without any "
                      f"account: `dtrun simulate {escape(job)}` (the real controller on a fake cloud).")
        elif plan.unusable:
            why = "; ".join(plan.unusable.values())
            err.print(f"[red]No usable provider (nothing rented{exit5}):[/] {escape(why)}")
        else:
            why = "; ".join(plan.refusals) or "no provider offers this GPU"
            err.print(f"[red]No offer fits:[/] {escape(why)}")
    if strict and report.get("traps"):
        err.print(f"[red]--strict:[/] {len(report['traps'])} known trap(s) found")


def json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isinf(o):
        return None
    return str(o)


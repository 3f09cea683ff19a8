"""``dtrun simulate``: print what the real controller does against the fake cloud on a virtual
clock, N times (the simulation lives in ``orchestrator.run.simulate``)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

from orchestrator.cli.options import JobArg, JsonOpt
from orchestrator.contract.errors import EXIT_OK


def cmd_simulate(job: Any, preemptions_per_hour: float | None, runs: int, seed: int, json_out: bool,
                 **opts: Any) -> int:
    from orchestrator.cli import remote
    from orchestrator.plan.spec import load_spec
    from orchestrator.run.simulate import simulate_job

    if remote.target():  # the server runs the same simulation (runs capped there); printed here
        return print_simulation(*remote.simulate(job, preemptions_per_hour, runs, seed, **opts), json_out)
    spec, out = simulate_job(load_spec(job), preemptions_per_hour, runs, seed, **opts)
    return print_simulation(spec.name, out, json_out)


def print_simulation(name: str, out: dict[str, Any], json_out: bool) -> int:
    """The report of ``simulate_job`` (embedded or the server's): JSON, or the lines below."""
    import typer

    from orchestrator.cli.planview import fmt_money as usd

    note = out.get("note")
    if json_out:
        typer.echo(json.dumps(out, sort_keys=True, default=float))
        return EXIT_OK
    p = out
    if note:
        typer.echo(note)
    typer.echo(f"{name}: {p['runs']} simulated runs on {p['offer']} ({usd(p['price_per_hour'])}/h), "
               f"{p['preemptions_per_hour']:g} preemptions/h"
               + (f" ({p['nodes']} nodes × {p['preemptions_per_node_hour']:g}/h each; one lost node ends the "
                  "attempt)" if p.get("nodes", 1) > 1 else "")
               + f", checkpoint every {p['checkpoint_every_steps']} steps "
               f"({p['elapsed_s']:.1f} s)")
    typer.echo(f"  outcome     {', '.join(f'{k} {v}' for k, v in sorted(p['states'].items()))}")
    for reason, n in (p.get("failed_reason_runs") or {}).items():
        typer.echo(f"  failed      {n} run(s): {reason}")
    typer.echo(f"  wall        mean {p['wall_hours_mean']:.2f} h   p95 {p['wall_hours_p95']:.2f} h")
    typer.echo(f"  cost        mean {usd(p['cost_usd_mean'])}   p95 {usd(p['cost_usd_p95'])}   max {usd(p['cost_usd_max'])}")
    ratio = p["expected_vs_simulated_mean"]
    ratio_s = f" (x{ratio:.2f} of the simulated mean)" if ratio is not None else ""
    typer.echo(f"  estimate    expected {usd(p['expected_usd'])}{ratio_s}   with {p.get('estimate_basis') or 'buffer'} {usd(p['estimate_usd'])} "
               f"({'covers' if p['estimate_covers_p95'] else 'BELOW'} the p95)")
    typer.echo(f"  attempts    mean {p['attempts_mean']:.2f}   max {p['attempts_max']}   "
               f"preemptions mean {p['preemptions_mean']:.2f} (with notice {p['soft_preemptions_mean']:.2f}, "
               f"work saved by it {p['soft_preemptions_saved_mean']:.2f})   no capacity {p['no_capacity_mean']:.2f}")
    typer.echo(f"  offers      {', '.join(p['offers_sold'])} (failover in this order)")
    su = p.get("startup") or {}
    if su:
        typer.echo(f"  start-up    {su['total_minutes']:.1f} min per start on {su['provider']} "
                   f"({'prebuilt image' if su['prebuilt_image'] else 'installs torch every start'}; "
                   "figures: providers/data/prices.yaml)")
    typer.echo(f"  work lost   mean {p['work_lost_steps_mean']:.0f} steps ({p['work_lost_hours_mean'] * 60:.1f} min)")
    typer.echo(f"  goodput     mean {p['goodput_mean']:.1%}   p5 {p['goodput_p5']:.1%}   "
               f"(after start-up: {p['training_goodput_mean']:.1%})")
    budget = f" of budget {usd(p['budget_usd'])}" if p["budget_usd"] is not None else " (no budget set)"
    typer.echo(f"  budget      exceeded in {p['budget_exceeded_runs']} run(s){budget}")
    typer.echo(f"  orphans     {p['orphan_instance_seconds']:.0f} instance-seconds billed after a job ended")
    yd = p.get("young_daly")
    if p.get("young_daly_every_steps"):
        if yd:
            typer.echo(f"  Young/Daly  every {yd['checkpoint_every_steps']} steps (you set {p['checkpoint_every_user']}): "
                       f"cost mean {usd(yd['cost_usd_mean'])} p95 {usd(yd['cost_usd_p95'])}, "
                       f"goodput {yd['goodput_mean']:.1%}")
        else:
            typer.echo(f"  Young/Daly  every {p['young_daly_every_steps']} steps: the interval simulated")
    return EXIT_OK

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def simulate(
    job: JobArg,
    preemptions_per_hour: Annotated[Optional[float], typer.Option(help="Spot preemption rate to simulate.")] = None,
    runs: Annotated[int, typer.Option(help="Simulated runs.")] = 200,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    no_capacity: Annotated[float, typer.Option(
        help="Probability a launch finds no capacity (the controller fails over to the next offer).")] = 0.0,
    notice_seconds: Annotated[Optional[float], typer.Option(
        help="Preemption notice (grace) in seconds; default: each provider's figure in the price snapshot.")] = None,
    soft_fraction: Annotated[Optional[float], typer.Option(
        help="Share of preemptions that come with the notice (soft); the rest are hard.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Run the real controller against the fake cloud on a virtual clock, N times: the distribution
    of wall time, cost, attempts, work lost and goodput, before renting anything."""
    raise typer.Exit(cmd_simulate(job, preemptions_per_hour, runs, seed, json_out, no_capacity=no_capacity,
                                  notice_seconds=notice_seconds, soft_fraction=soft_fraction))

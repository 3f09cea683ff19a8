"""The ``dtrun`` command line.

Thin wrappers only: each command imports its implementation when it runs, so ``dtrun --help``
and the dry run never import torch, sky or boto3. Errors become one line and an exit code here
(see ``orchestrator.contract.errors``), never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from orchestrator.contract.errors import EXIT_INTERRUPTED, DtrunError

app = typer.Typer(
    name="dtrun",
    help="Train on rented GPUs without surprises: estimate first, rent the cheapest fit, "
    "survive preemption, never leave a node billing.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

JobArg = Annotated[Path, typer.Argument(help="The job spec (job.yaml).", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]


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
) -> None:
    """Print the price table: provider, region, GPU, spot, $/GPU-hour and where each price came from."""
    from orchestrator.cli.up import cmd_prices

    cmd_prices(gpu, json_out, spot)


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
) -> None:
    """Estimate, confirm, then run the job to the end (or only estimate, with --dry-run)."""
    from orchestrator.cli.up import cmd_dry_run

    if dry_run:
        raise typer.Exit(cmd_dry_run(job, json_out, strict, force))
    from orchestrator.cli.jobs import cmd_up

    raise typer.Exit(cmd_up(job, yes=yes, detach=detach, json_out=json_out, strict=strict, force=force))


@app.command()
def status(
    job: Annotated[Optional[str], typer.Argument(help="Job name (default: every job).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Show a job's state, step, spend, attempts and nodes."""
    from orchestrator.cli.jobs import cmd_status

    raise typer.Exit(cmd_status(job, json_out))


@app.command("ls")
def ls_(json_out: JsonOpt = False) -> None:
    """List jobs."""
    from orchestrator.cli.jobs import cmd_ls

    raise typer.Exit(cmd_ls(json_out))


@app.command()
def logs(
    job: Annotated[str, typer.Argument(help="Job name.")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
    attempt: Annotated[int | None, typer.Option("--attempt", "-a", help="Only this attempt's node output.")] = None,
) -> None:
    """Print the job's controller events and the nodes' output (local log files, or the
    provider's logs for a remote node: SkyPilot's job log of the attempt's cluster)."""
    from orchestrator.cli.jobs import cmd_logs

    raise typer.Exit(cmd_logs(job, follow, attempt))


@app.command()
def down(
    job: Annotated[str, typer.Argument(help="Job name.")],
    now: Annotated[bool, typer.Option("--now", help="Skip the final checkpoint; terminate at once.")] = False,
) -> None:
    """Stop a job: STOP → final checkpoint → terminate every node (confirmed)."""
    from orchestrator.cli.jobs import cmd_down

    raise typer.Exit(cmd_down(job, now))


@app.command()
def export(
    job: JobArg,
    skypilot: Annotated[bool, typer.Option("--skypilot", help="Print the SkyPilot task YAML.")] = False,
) -> None:
    """Print the job as another tool's config (no secrets included)."""
    from orchestrator.cli.export import cmd_export

    raise typer.Exit(cmd_export(job, skypilot=skypilot))


@app.command()
def gc(
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Terminate without asking.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Find provider instances with dtrun's name prefix that no live job owns, and terminate them."""
    from orchestrator.cli.money import cmd_gc

    raise typer.Exit(cmd_gc(yes=yes, json_out=json_out))


@app.command()
def cost(
    job: Annotated[Optional[str], typer.Argument(help="Job name (default: every job).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Spend per job and per attempt, beside the estimate."""
    from orchestrator.cli.money import cmd_cost

    raise typer.Exit(cmd_cost(job, json_out))


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
    from orchestrator.cli.simulate import cmd_simulate

    raise typer.Exit(cmd_simulate(job, preemptions_per_hour, runs, seed, json_out, no_capacity=no_capacity,
                                  notice_seconds=notice_seconds, soft_fraction=soft_fraction))


@app.command()
def profile(
    job: JobArg,
    steps: Annotated[int, typer.Option(help="Steps to profile.")] = 10,
    json_out: JsonOpt = False,
) -> None:
    """A short run under torch.profiler: where the time goes, tokens/s, MFU and a verdict."""
    from orchestrator.cli.profile import cmd_profile

    raise typer.Exit(cmd_profile(job, steps, json_out))


data_app = typer.Typer(help="Prepare training data: token shards, a validation split, a manifest.",
                       no_args_is_help=True, rich_markup_mode=None)
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(
    source: Annotated[str, typer.Argument(help="Text/JSONL/Parquet file, folder or glob; a datasets folder "
                                         "(save_to_disk) or hf:NAME[:SPLIT].", show_default=False)],
    out: Annotated[str, typer.Option("--out", help="Output folder or URI (s3://…).", show_default=False)],
    tokenizer: Annotated[str, typer.Option(help="gpt2 (tiktoken), a tokenizer.json path, or a cached HF repo id.")] = "gpt2",
    val_tokens: Annotated[int, typer.Option(help="Tokens held out for validation.")] = 1_000_000,
    shard_tokens: Annotated[int, typer.Option(help="Tokens per shard file.")] = 100_000_000,
    workers: Annotated[Optional[int], typer.Option(help="Tokenizer processes (default: every core).")] = None,
    text_field: Annotated[str, typer.Option(help="JSONL field / Parquet column holding the text.")] = "text",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Tokenize a corpus into llm.c shards with a validation split and a manifest (resumable)."""
    from orchestrator.cli.data import cmd_prepare

    raise typer.Exit(cmd_prepare(source, out, tokenizer, val_tokens, shard_tokens, workers, text_field, quiet))


@data_app.command("tokenizer")
def data_tokenizer(
    source: Annotated[str, typer.Argument(help="Text files (folder, file or glob).", show_default=False)],
    out: Annotated[str, typer.Option("--out", help="Where to write tokenizer.json.", show_default=False)],
    vocab_size: Annotated[int, typer.Option(help="Vocabulary size.")] = 4096,
) -> None:
    """Train a byte-level BPE tokenizer on a corpus (seconds for a few MB); use it with --tokenizer."""
    from orchestrator.cli.data import cmd_tokenizer

    raise typer.Exit(cmd_tokenizer(source, vocab_size, out))


@app.command()
def weights(
    job: Annotated[str, typer.Argument(help="Job name (or its job.yaml).", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Output folder.", show_default=False)],
    step: Annotated[Optional[int], typer.Option(help="Checkpoint step (default: newest COMMITTED).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="safetensors (dtrun names) or hf (transformers).")] = "safetensors",
) -> None:
    """Write the model's weights (no optimizer state) from a checkpoint, tensor by tensor."""
    from orchestrator.cli.weights import cmd_weights

    raise typer.Exit(cmd_weights(job, out, step, fmt))


@app.command()
def sample(
    job: Annotated[str, typer.Argument(help="Job name (or its job.yaml).", show_default=False)],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "",
    tokens: Annotated[int, typer.Option(help="Tokens to generate per sample.")] = 64,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).")] = 0.8,
    step: Annotated[Optional[int], typer.Option(help="Checkpoint step (default: newest COMMITTED).")] = None,
    num: Annotated[int, typer.Option("--num", "-n", help="Samples.")] = 3,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
) -> None:
    """Generate a few lines of text from a checkpoint with the data's tokenizer (CPU or GPU)."""
    from orchestrator.cli.sample import cmd_sample

    raise typer.Exit(cmd_sample(job, prompt, tokens, temperature, step, num, seed))


@app.command()
def report(
    job: Annotated[str, typer.Argument(help="Job name.", show_default=False)],
    out: Annotated[Optional[Path], typer.Option("--out", help="HTML file (default: ~/.dtrun/reports/JOB/report.html).")] = None,
) -> None:
    """One self-contained HTML report (and PNGs): loss curves, throughput, spend, attempts."""
    from orchestrator.cli.report import cmd_report

    raise typer.Exit(cmd_report(job, out))


def _click_errors() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(Exit, ClickException, Abort) classes: click's, and typer's own (typer ≥ 0.20 vendors click
    as ``typer._click`` and raises those, which click's classes do not catch)."""
    import click

    exits: list[type] = [click.exceptions.Exit]
    usage: list[type] = [click.ClickException]
    aborts: list[type] = [click.exceptions.Abort]
    try:
        from typer import _click as tc
    except ImportError:
        tc = None
    if tc is not None:
        usage.append(tc.exceptions.ClickException)
        for name, into in (("Exit", exits), ("Abort", aborts)):
            cls = getattr(tc.exceptions, name, None)
            if cls is not None:
                into.append(cls)
    for name, into in (("Exit", exits), ("Abort", aborts)):
        cls = getattr(typer, name, None)
        if isinstance(cls, type):
            into.append(cls)
    return tuple(exits), tuple(usage), tuple(aborts)


def main(argv: list[str] | None = None) -> int:
    exits, usage, aborts = _click_errors()
    try:
        rv = app(args=argv, standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except exits as e:
        return e.exit_code
    except usage as e:
        e.show()
        return e.exit_code
    except aborts:
        typer.echo("aborted", err=True)
        return EXIT_INTERRUPTED
    except DtrunError as e:
        typer.echo(f"dtrun: {e}", err=True)
        return e.exit_code
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except Exception as e:  # an unexpected bug: one line by default, the traceback on request
        import os
        import traceback

        if os.environ.get("DTRUN_DEBUG"):
            traceback.print_exc()
        typer.echo(f"dtrun: internal error: {type(e).__name__}: {e} (set DTRUN_DEBUG=1 for the traceback)", err=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())

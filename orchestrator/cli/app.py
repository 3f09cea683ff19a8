"""The ``dtrun`` command line: the typer app that joins the command modules, and ``main``.

Each command lives in the module of its noun (``orchestrator/cli/<noun>.py``: its typer
declarations at the bottom, its implementation above) and imports heavy code when it runs, so
``dtrun --help`` and the dry run never import torch, sky or boto3. Errors become one line and an exit code here
(see ``orchestrator.contract.errors``), never a traceback.
"""

from __future__ import annotations

import sys

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

# One module per command noun, each with its own typer app, joined here without a group name so
# `dtrun up`, `dtrun gc`, … stay top-level (`dtrun data …` is the one group). The order is --help's.
from orchestrator.cli import (  # noqa: E402
    check,
    data,
    export,
    init,
    jobs,
    money,
    profile,
    report,
    sample,
    simulate,
    up,
    weights,
)

for _noun in (init, check, up, jobs, export, money, simulate, profile, data, weights, sample, report):
    app.add_typer(_noun.app)


def version() -> str:
    """dtrun's version: the installed distribution's, else pyproject.toml's (a source checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("dtrun")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
        m = re.search(r'^version = "([^"]+)"', text, re.M)
        return m.group(1) if m else "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"dtrun {version()}")
        raise typer.Exit(0)


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                      help="Print dtrun's version and exit."),
) -> None:
    """Train on rented GPUs without surprises: estimate first, rent the cheapest fit, survive
    preemption, never leave a node billing."""


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

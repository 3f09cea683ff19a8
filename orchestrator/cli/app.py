"""The ``dtrun`` command line: the typer app that joins the command modules, and ``main``.

Each command lives in the module of its noun (``orchestrator/cli/<noun>.py``: its typer
declarations at the bottom, its implementation above) and imports heavy code when it runs, so
``dtrun --help`` and the dry run never import torch, sky or boto3. Errors become one line and an exit code here
(see ``orchestrator.contract.errors``), never a traceback.
"""

from __future__ import annotations

import os
import sys

# pydantic scans every installed package's entry points for its plugins (observability hooks
# such as logfire) when the first model is built: ~35 ms of the dry run's ~350 ms, for plugins
# dtrun does not use. Off unless the user set the variable.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

import typer  # noqa: E402 - after the variable: typer imports pydantic
from typer.core import TyperGroup  # noqa: E402

from orchestrator.contract.errors import EXIT_INTERRUPTED, DtrunError  # noqa: E402


def first_sentence(help_text: str) -> str:
    """A command's help up to the end of its first sentence, whole: what ``--help`` lists beside
    the command's name (click would cut it at the line's width with "...")."""
    import inspect

    para = " ".join(inspect.cleandoc(help_text).split("\n\n")[0].split())
    depth = 0  # a full stop inside brackets ("(e.g. H100)") ends no sentence
    for i, ch in enumerate(para):
        depth += (ch in "([") - (ch in ")]")
        if ch == "." and depth <= 0 and (i + 1 == len(para) or para[i + 1] == " "):
            return para[: i + 1]
    return para


class _Group(TyperGroup):
    """The root group: every command (and every group's command) listed in ``--help`` with its
    first sentence whole, wrapped onto the next lines as needed, never cut off."""

    def main(self, *args, **kwargs):  # type: ignore[override]
        _whole_short_help(self)
        return super().main(*args, **kwargs)


def _whole_short_help(group) -> None:
    for sub in (getattr(group, "commands", None) or {}).values():
        if not sub.short_help and sub.help:
            sub.short_help = first_sentence(sub.help)
        _whole_short_help(sub)


app = typer.Typer(
    cls=_Group,
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
    dashboard,
    data,
    export,
    init,
    jobs,
    money,
    prices,
    profile,
    report,
    sample,
    server,
    simulate,
    up,
    weights,
)

for _noun in (init, check, up, prices, jobs, export, money, simulate, profile, data, weights, sample, report, dashboard,
              server):
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
    """(Exit, ClickException, Abort) classes: typer's own (typer ≥ 0.20 vendors click as
    ``typer._click`` and raises those) and click's, when something imported click (only then
    can its classes be raised: importing it just to catch them cost the fast paths ~30 ms)."""
    exits: list[type] = []
    usage: list[type] = []
    aborts: list[type] = []
    for mod in (sys.modules.get("typer._click.exceptions"), sys.modules.get("click.exceptions")):
        if mod is None:
            continue
        usage.append(mod.ClickException)
        for name, into in (("Exit", exits), ("Abort", aborts)):
            cls = getattr(mod, name, None)
            if cls is not None:
                into.append(cls)
    for name, into in (("Exit", exits), ("Abort", aborts)):
        cls = getattr(typer, name, None)
        if isinstance(cls, type):
            into.append(cls)
    return tuple(exits), tuple(usage), tuple(aborts)


def main(argv: list[str] | None = None) -> int:
    try:
        rv = app(args=argv, standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - sorted here: click's classes are known only once raised
        return _handle(e)
    finally:
        if argv is None:  # the process's own command line (`dtrun`, `python -m orchestrator.cli`), about to exit
            _spare_the_exit_collection()


def _spare_the_exit_collection() -> None:
    """Move every object still alive into the collector's permanent generation: the interpreter's
    shutdown then skips a last full collection over what pydantic, rich and typer built (~70 ms of
    CPU, a fifth of the dry run's). Files are closed and atexit/weakref.finalize callbacks run as
    usual; only finalizers of objects in reference cycles are left to the exit."""
    import gc

    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()


def _handle(e: Exception) -> int:
    exits, usage, aborts = _click_errors()
    if isinstance(e, exits):
        return e.exit_code  # type: ignore[attr-defined]
    if isinstance(e, usage) and type(e).__name__ == "NoArgsIsHelpError":  # `dtrun data`: the help itself
        e.show()  # type: ignore[attr-defined]
        return e.exit_code  # type: ignore[attr-defined]
    if isinstance(e, usage):  # one line like every other refusal, naming the option and where help is
        ctx = getattr(e, "ctx", None)
        names, c = [], ctx
        while c is not None and c.parent is not None:  # the root's name is the program's
            names.insert(0, c.info_name)
            c = c.parent
        hint = "" if ctx is None else f" (see `{' '.join(['dtrun', *names, '--help'])}`)"
        typer.echo(f"dtrun: {' '.join(e.format_message().split())}{hint}", err=True)  # type: ignore[attr-defined]
        return e.exit_code  # type: ignore[attr-defined]
    if isinstance(e, aborts):
        typer.echo("aborted", err=True)
        return EXIT_INTERRUPTED
    if isinstance(e, DtrunError):
        typer.echo(f"dtrun: {e}", err=True)
        return e.exit_code
    # an unexpected bug: one line by default, the traceback on request
    import traceback

    if os.environ.get("DTRUN_DEBUG"):
        traceback.print_exception(e)
    typer.echo(f"dtrun: internal error: {type(e).__name__}: {e} (set DTRUN_DEBUG=1 for the traceback)", err=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())

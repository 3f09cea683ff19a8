"""``dtrun report JOB [--out FILE]``: parse, call ``orchestrator.run.report``, print the path.
Works while the job runs (a snapshot) and after it ended. Exit 6: no such job."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from orchestrator.contract.errors import EXIT_OK


def cmd_report(job: str, out: Path | None) -> int:
    from orchestrator.run.report import render
    from orchestrator.run.state import StateStore

    path = render(StateStore(), job, out)
    print(f"{path}  (loss.png, throughput.png, spend.png beside it)")
    return EXIT_OK

# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


@app.command()
def report(
    job: Annotated[str, typer.Argument(help="Job name.", show_default=False)],
    out: Annotated[Optional[Path], typer.Option("--out", help="HTML file (default: ~/.dtrun/reports/JOB/report.html).")] = None,
) -> None:
    """One self-contained HTML report (and PNGs): loss curves, throughput, spend, attempts."""
    raise typer.Exit(cmd_report(job, out))

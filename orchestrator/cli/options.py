"""Option types shared by the command modules (``Annotated`` aliases, so every command spells them alike)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

JobArg = Annotated[Path, typer.Argument(help="The job spec (job.yaml).", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]

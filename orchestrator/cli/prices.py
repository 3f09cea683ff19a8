"""``dtrun prices``: the price table (provider, region, GPU, spot, $/GPU-hour and where each price
came from) and the providers' capabilities; and :func:`refresh_prices`, SkyPilot's live fetchers,
which ``dtrun up`` and its dry run also call for stale catalogs."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any, Optional

import typer

from orchestrator.cli.options import JsonOpt


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
    from orchestrator.cli import remote
    from orchestrator.run.priceview import checked_gpu, price_view

    gpu = checked_gpu(gpu)
    if remote.target():  # the server's price view, printed as the embedded one
        (rows, caps), refreshed = remote.prices(gpu, spot, refresh), []
    else:
        refreshed = refresh_prices(None, stale_only=False) if refresh else []
        rows, caps = price_view(gpu, spot)
    if json_out:
        sys.stdout.write(json.dumps({"prices": rows, "capabilities": caps, "refresh": refreshed}) + "\n")
        return
    print_prices(gpu, rows, caps)


def console_width() -> int | None:
    """The width to print in: the terminal's (None: Rich asks it, ``COLUMNS`` included); piped,
    ``COLUMNS`` when set, else 100 (what a pager or a CI log shows)."""
    import os

    if sys.stdout.isatty():
        return None
    try:
        cols = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        cols = 0
    return cols if cols >= 40 else 100


def print_prices(gpu: str | None, rows: list[dict[str, Any]], caps: dict[str, Any]) -> None:
    """The table in the terminal's width: each price's source, a long sentence, is a numbered
    footnote under the table (as in the dry run's offers table); notes and capabilities wrap."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from orchestrator.cli.planview import footnotes
    from providers.catalog import all_rows

    tty = sys.stdout.isatty()
    con = Console(highlight=False, soft_wrap=False, width=console_width(), no_color=not tty)
    nums, notes = footnotes([row["price_source"] + (f" ({row['note']})" if row["note"] else "") for row in rows])
    t = Table(title=f"Prices{' for ' + gpu if gpu else ''} (USD per GPU-hour; src: the source, below)",
              title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True,
              show_edge=False)
    for col, j in (("gpu", "left"), ("provider", "left"), ("region", "left"), ("gpus/node", "right"),
                   ("spot", "left"), ("$/GPU-h", "right"), ("src", "right")):
        t.add_column(col, justify=j, no_wrap=True)  # type: ignore[arg-type]
    for row, n in zip(rows, nums):
        t.add_row(row["gpu"], row["provider"], row["region"], str(row["gpus_per_node"]),
                  "spot" if row["spot"] else "on-demand", f"{row['price_per_gpu_hour']:.2f}", f"[{n}]")
    if rows:
        con.print(t)
    for k, note in enumerate(notes, 1):
        con.print(escape(f"[{k}] {note}"))
    if gpu is not None and not rows:  # an empty table says nothing by itself
        priced = sorted({r.gpu for r in all_rows(None)})
        con.print(escape(f"no provider lists a price for {gpu}" + (" (local CPU runs are free: providers: [local])"
                  if gpu == "cpu" else "") + f"; GPUs with prices: {', '.join(priced)}"))
    for name, c in caps.items():
        parts = []
        for k in ("spot", "multi_node"):
            parts.append(f"{k.replace('_', '-')}: {'yes' if c[k]['supported'] else 'no'}"
                         + (f" ({c[k]['reason']})" if c[k]["reason"] else ""))
        con.print(f"[bold]{name}[/]: " + escape("; ".join(parts) + f"; ≤{c['max_gpus_per_node']} GPUs/node"))


# ---- the command line (joined into `dtrun` by orchestrator.cli.app) ----------------------------------

app = typer.Typer()


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


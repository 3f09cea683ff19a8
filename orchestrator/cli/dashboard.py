"""``dtrun dashboard [--host] [--port]``: the dashboard over this machine's state store, in a
browser. Binds 127.0.0.1 unless told; prints the URL with a fresh random token (every page and
endpoint answers 401 without it). ^C stops it. See ``orchestrator.dashboard``."""

from __future__ import annotations

from typing import Annotated

import typer

from orchestrator.contract.errors import EXIT_INVALID, EXIT_OK

app = typer.Typer()


@app.command()
def dashboard(
    host: Annotated[str, typer.Option("--host", help="Address to bind (default: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="TCP port.")] = 8765,
) -> None:
    """Runs, spend against budget, loss curves and preemptions in a browser (live)."""
    try:
        from orchestrator.dashboard.app import serve
    except ImportError as e:  # the `server` extra (fastapi, uvicorn) is not installed
        print(f"dtrun dashboard needs the `server` extra: pip install 'dtrun[server]' ({e})")
        raise typer.Exit(EXIT_INVALID) from None

    serve(host=host, port=port, on_url=lambda u: print(f"dtrun dashboard: {u}  (^C to stop)", flush=True))
    raise typer.Exit(EXIT_OK)

"""The dashboard's HTTP side: a FastAPI ``APIRouter`` over a data source, and ``dtrun dashboard``'s app.

``make_router(source_for)`` — ``source_for(request) -> DataSource`` authenticates the request
(raises ``HTTPException(401)``) and returns the source the caller may see; ``dtrun server``
passes one that resolves the team from its API token, ``dtrun dashboard`` passes
``token_check(source, token)``. Routes (relative to where the router is mounted):

``GET /``                      the runs page          ``GET /runs/{name}``            one run
``GET /api/runs``              the runs as JSON        ``GET /api/runs/{name}``        one run as JSON
``POST /api/runs/{name}/stop`` what ``dtrun down`` does   ``GET /static/{file}``      uPlot, dash.js
``GET /team``                  the team's month        ``GET /api/team``               the same as JSON

``dtrun dashboard``'s token comes as ``?token=``, or ``Authorization: Bearer``, and the pages'
links carry it (``link_token``); ``dtrun server`` keeps its API token out of URLs (a cookie set by
its sign-in form, or the header) and passes ``link_token`` returning "". Pages poll the JSON every
``pages.POLL_MS`` (short polling, not server-sent events: one stateless GET per page per poll
works the same behind any proxy and across server replicas, holds no connection or thread per
viewer, and reconnects for free; a 2 s delay is well inside what a training run needs).
"""

from __future__ import annotations

import hmac
import secrets
from pathlib import Path
from typing import Callable

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from orchestrator.dashboard import pages
from orchestrator.dashboard.source import DataSource, EmbeddedSource

STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css", "dash.js": "text/javascript"}


def request_token(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.query_params.get("token", "")


def token_check(source: DataSource, token: str) -> Callable[[Request], DataSource]:
    """``source_for`` for one fixed token (``dtrun dashboard``): constant-time compare, 401 otherwise."""
    want = token.encode()

    def source_for(request: Request) -> DataSource:
        if not hmac.compare_digest(request_token(request).encode(), want):
            raise HTTPException(401, "a valid token is needed (?token=… or Authorization: Bearer …)")
        return source
    return source_for


def make_router(source_for: Callable[[Request], DataSource], prefix: str = "",
                link_token: Callable[[Request], str] = request_token) -> APIRouter:
    r = APIRouter(prefix=prefix)

    def base(request: Request) -> str:
        return (request.scope.get("root_path", "") or "").rstrip("/") + prefix + "/"

    def one(src: DataSource, name: str) -> dict:
        d = src.run(name)
        if d is None:
            raise HTTPException(404, f"no run named {name!r}")
        return d

    @r.get("/", response_class=HTMLResponse)
    def runs_html(request: Request) -> HTMLResponse:
        src = source_for(request)
        return HTMLResponse(pages.runs_page(src.runs(), link_token(request), base(request)))

    @r.get("/runs/{name}", response_class=HTMLResponse)
    def run_html(name: str, request: Request) -> HTMLResponse:
        src = source_for(request)
        return HTMLResponse(pages.run_page(one(src, name), link_token(request), base(request)))

    @r.get("/team", response_class=HTMLResponse)
    def team_html(request: Request) -> HTMLResponse:
        src = source_for(request)
        return HTMLResponse(pages.team_page(src.team(), link_token(request), base(request)))

    @r.get("/api/team")
    def team_json(request: Request) -> JSONResponse:
        return JSONResponse(source_for(request).team())

    @r.get("/api/runs")
    def runs_json(request: Request) -> JSONResponse:
        return JSONResponse({"runs": source_for(request).runs()})

    @r.get("/api/runs/{name}")
    def run_json(name: str, request: Request) -> JSONResponse:
        return JSONResponse(one(source_for(request), name))

    @r.post("/api/runs/{name}/stop")
    def stop(name: str, request: Request) -> JSONResponse:
        src = source_for(request)
        one(src, name)
        return JSONResponse({"message": src.stop(name)})

    @r.get("/static/{file}")
    def static(file: str, request: Request) -> FileResponse:
        source_for(request)
        if file not in STATIC_FILES:
            raise HTTPException(404, "no such file")
        return FileResponse(STATIC / file, media_type=STATIC_FILES[file])

    return r


def make_app(source: DataSource, token: str) -> FastAPI:
    app = FastAPI(title="dtrun dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(make_router(token_check(source, token)))
    return app


def serve(host: str = "127.0.0.1", port: int = 8765, state_path: str | None = None,
          on_url: Callable[[str], None] = print) -> None:
    """``dtrun dashboard``: a fresh random token per start, the URL printed, then serve until ^C."""
    import uvicorn

    token = secrets.token_urlsafe(24)
    app = make_app(EmbeddedSource(state_path), token)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning")
    server = uvicorn.Server(config)
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    on_url(f"http://{shown}:{server.config.port}/?token={token}")
    server.run()

"""The server's HTTP API (FastAPI).

Why FastAPI: request bodies are validated by pydantic, so the job body is checked by the very
model that checks a job file (``orchestrator.plan.spec.JobSpec``, 422 naming the field); it is
well kept and ASGI (uvicorn serves it, with TLS when asked); and its ``TestClient`` drives the real
app in tests without a socket.

Every endpoint needs ``Authorization: Bearer <token>`` (401 without, one line of JSON); a client
sending bad tokens is refused with 429 for a while; another team's job is 404, the same answer as
no job at all. Errors are ``{"error": "<one line>"}``; nothing answers with a traceback, and the log
names the request, never a token or a credential. Team secrets never appear in a response.

``POST /v1/up`` is the dry run computed here (``orchestrator.run.prepare``: the same plan record
the CLI shows with its own plan view and exit codes) plus the team's month
(``orchestrator.server.budget``); with ``confirm: true`` and nothing refused, the job is submitted
(queued for a controller replica).

``/v1/prices``, ``/v1/simulate`` and ``/v1/gc`` (team-scoped) are in ``orchestrator.server.api_extra``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.engine import Engine
from starlette.exceptions import HTTPException as StarletteHTTPException

from orchestrator.contract.errors import EXIT_OK, EXIT_OVER_BUDGET, DtrunError, SpecError
from orchestrator.server import budget
from orchestrator.server.auth import AuthError, BadTokenLimiter, authenticate
from orchestrator.server.db import session_scope
from orchestrator.server.models import Attempt, Event, Job, Team, User

log = logging.getLogger("dtrun.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


class UpBody(BaseModel):
    spec: dict[str, Any] = Field(description="the job, as the job file's mapping (validated by JobSpec)")
    confirm: bool = False


class DownBody(BaseModel):
    now: bool = False


def _one_line(s: str) -> str:
    return " ".join(str(s).split())[:2000]


def _job_view(j: Job) -> dict[str, Any]:
    return {"name": j.name, "state": j.state, "reason": j.reason, "requested_action": j.requested_action,
            "created": j.created, "updated": j.updated, "spend_usd": j.spend_usd, "attempt": j.attempt,
            "price_per_hour": j.price_per_hour, "estimate_usd": budget.job_estimate_usd(j)}


def create_app(engine: Engine, *, get: Callable[[str], Any] | None = None,
               limiter: BadTokenLimiter | None = None, store: Any = None) -> FastAPI:
    """The API over ``engine``'s database. ``get``: the provider by name for planning (default
    ``providers.registry.get``). ``store``: the controllers' state store the dashboard and
    ``/v1/gc`` read — ``dtrun server`` passes its replicas' ``CtlStore`` (the server database);
    without one, this machine's ``$DTRUN_HOME/state.db`` (an API beside an in-process replica
    on that file)."""
    app = FastAPI(title="dtrun server", docs_url=None, redoc_url=None, openapi_url=None)
    limiter = limiter or BadTokenLimiter()
    app.state.engine, app.state.limiter = engine, limiter

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return JSONResponse({"error": _one_line(e.message), **e.extra}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        parts = []
        for err in e.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
        return JSONResponse({"error": _one_line("; ".join(parts) or "invalid request")}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        msg = e.detail if isinstance(e.detail, str) else "request refused"
        return JSONResponse({"error": _one_line(msg)}, status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # the type only: an exception's text may carry a value from the request or a credential
        log.error("internal error on %s %s: %s", request.method, request.url.path, type(e).__name__)
        return JSONResponse({"error": "internal error (logged on the server)"}, status_code=500)

    def caller(request: Request) -> tuple[int, int]:
        """(user id, team id) of the token, or 401/429."""
        client = request.client.host if request.client else "?"
        if limiter.blocked(client):
            raise ApiError(429, "too many bad tokens from this client; try again later")
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else None
        try:
            with session_scope(engine) as s:
                u = authenticate(s, token)
                return u.id, u.team_id
        except AuthError as e:
            if header:  # a token was tried (no token at all is not a guess)
                limiter.record_bad(client)
            raise ApiError(401, str(e)) from None

    def team_job(s, team_id: int, name: str) -> Job:
        j = s.scalar(select(Job).where(Job.team_id == team_id, Job.name == name))
        if j is None:
            raise ApiError(404, f"no job named {name!r}")
        return j

    @app.get("/v1/whoami")
    def whoami(who=Depends(caller)):
        with session_scope(engine) as s:
            u = s.get(User, who[0])
            return {"user": u.name, "role": u.role, "team": u.team.name}

    @app.post("/v1/up")
    def up(body: UpBody, who=Depends(caller)):
        from orchestrator.plan.spec import parse_spec
        from orchestrator.run.prepare import prepare

        try:
            written = parse_spec(body.spec, source="spec")
            prepared = prepare(written, get=get)
        except SpecError as e:
            raise ApiError(422, str(e), exit_code=e.exit_code) from None
        except DtrunError as e:
            raise ApiError(422, str(e), exit_code=e.exit_code) from None
        record = prepared.to_dict()
        est = prepared.estimate.cost_usd if prepared.estimate is not None else 0.0
        with session_scope(engine) as s:
            team = s.get(Team, who[1])
            month = budget.team_month(s, team)
            why = budget.refusal(month, est)
            if why:
                raise ApiError(409, why, exit_code=EXIT_OVER_BUDGET, team_month=month)
            out = {"exit_code": EXIT_OK, "prepared": record, "team_month": month, "submitted": False}
            if body.confirm:
                if prepared.chosen is None:
                    raise ApiError(409, "no offer was chosen: nothing to submit", prepared=record)
                from orchestrator.server.jobs import ServerStateError, submit_job

                try:
                    j = submit_job(s, team, s.get(User, who[0]), written.name, body.spec, record)
                except ServerStateError as e:
                    raise ApiError(409, str(e)) from None
                out.update(submitted=True, job=_job_view(j))
            return out

    @app.get("/v1/jobs")
    def jobs(who=Depends(caller)):
        with session_scope(engine) as s:
            rows = s.scalars(select(Job).where(Job.team_id == who[1]).order_by(Job.id)).all()
            return {"jobs": [_job_view(j) for j in rows]}

    @app.get("/v1/jobs/{name}")
    def status(name: str, who=Depends(caller)):
        with session_scope(engine) as s:
            return _job_view(team_job(s, who[1], name))

    @app.get("/v1/jobs/{name}/logs")
    def logs(name: str, after: int = 0, limit: int = 500, who=Depends(caller)):
        """The job's events after id ``after`` (follow: poll with the last id seen)."""
        limit = max(1, min(limit, 5000))
        with session_scope(engine) as s:
            j = team_job(s, who[1], name)
            evs = s.scalars(select(Event).where(Event.job_id == j.id, Event.id > after)
                            .order_by(Event.id).limit(limit)).all()
            return {"job": j.name, "state": j.state,
                    "events": [{"id": e.id, "time": e.time, "kind": e.kind, "text": e.text} for e in evs]}

    @app.get("/v1/jobs/{name}/cost")
    def cost(name: str, who=Depends(caller)):
        with session_scope(engine) as s:
            j = team_job(s, who[1], name)
            atts = s.scalars(select(Attempt).where(Attempt.job_id == j.id).order_by(Attempt.n)).all()
            return {"name": j.name, "state": j.state, "spend_usd": j.spend_usd,
                    "estimate_usd": budget.job_estimate_usd(j), "price_per_hour": j.price_per_hour,
                    "attempts": [{"attempt": a.n, "provider": a.provider, "state": a.state, "outcome": a.outcome,
                                  "reason": a.reason, "launched_at": a.launched_at, "ended_at": a.ended_at,
                                  "price_per_hour": a.price_per_hour, "seconds": a.seconds, "usd": a.spend_usd}
                                 for a in atts]}

    @app.post("/v1/jobs/{name}/down")
    def down(name: str, body: DownBody | None = None, who=Depends(caller)):
        from orchestrator.server.jobs import request_stop

        with session_scope(engine) as s:
            j = team_job(s, who[1], name)
            request_stop(s, j, now=bool(body and body.now))
            return _job_view(j)

    @app.get("/v1/cost/team")
    def team_cost(who=Depends(caller)):
        with session_scope(engine) as s:
            return budget.team_month(s, s.get(Team, who[1]))

    from orchestrator.server.api_extra import add_extra_routes

    add_extra_routes(app, engine, caller, get, ApiError, store)  # /v1/prices, /v1/simulate, /v1/gc

    from orchestrator.server.dashboard_source import mount_dashboard

    mount_dashboard(app, engine, store=store)  # the dashboard pages under /dashboard, scoped to the caller's team
    return app

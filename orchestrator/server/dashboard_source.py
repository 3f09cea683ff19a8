"""The dashboard inside ``dtrun server``: a ``DataSource`` over the server's database scoped to the
caller's team, the sign-in that resolves the team from an API token, and ``mount_dashboard``.

Where each number comes from:

- the server database (what the API answers): the runs of the team, ``spent_usd`` (``jobs.spend_usd``,
  the ``spend_usd`` of ``GET /v1/jobs``), the server state (``server_state``: queued, running,
  stopping, …), the job's budget (the submitted spec's ``budget.max_usd``), the member who submitted
  it, the server's events (queued, stop requested, state changes), and the team page's month
  (``orchestrator.server.budget.team_month``: the numbers of ``GET /v1/cost/team``);
- the controllers' state store (``$DTRUN_HOME/state.db`` of the server process, where every
  replica's controller writes): the finer state (``RUNNING`` / ``RECOVERING`` / …), step/total,
  loss, tokens/s, the attempts (offer, spot, outcome, reason, steps lost), the nodes and the
  controller's events;
- the run URI (through the same reader as ``dtrun report``): the loss and tokens/s curves
  (``metrics.jsonl``) and, where the log is on this machine, the log tail.

A job queued but not yet claimed by a controller has no row in the store: it shows the server's
state (upper-cased) and no progress.

Access: ``Authorization: Bearer <token>`` (a script) or the ``dtrun_dashboard`` cookie that the
sign-in form (``/dashboard/login``) sets: HttpOnly, SameSite=Strict (a page of another site cannot
make the browser send it, so it cannot press Stop), Secure under TLS. A token in the URL is not
accepted: uvicorn's access log writes URLs. Bad tokens count towards the API's ``BadTokenLimiter``
(429). Another team's run is 404 with the same message as no run at all.
"""

from __future__ import annotations

import threading
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import defer

from orchestrator.dashboard import pages
from orchestrator.dashboard.app import make_router
from orchestrator.dashboard.source import detail, run_row, team_view
from orchestrator.run.state import StateStore
from orchestrator.server import budget
from orchestrator.server.auth import AuthError, BadTokenLimiter, authenticate
from orchestrator.server.db import session_scope
from orchestrator.server.models import TERMINAL, Event, Job, Team, User

COOKIE = "dtrun_dashboard"
PREFIX = "/dashboard"
COOKIE_MAX_AGE_S = 12 * 3600
NO_TOKEN = (f"sign in at {PREFIX}/login (or send Authorization: Bearer <token>); "
            f"a token in the URL is not accepted")


def _budget_of(spec: dict | None) -> float | None:
    try:
        v = ((spec or {}).get("budget") or {}).get("max_usd")
        return None if v is None else float(v)
    except (AttributeError, TypeError, ValueError):
        return None


def _steps_of(spec: dict | None) -> int | None:
    try:
        v = ((spec or {}).get("trainer") or {}).get("steps")
        return None if v is None else int(v)
    except (AttributeError, TypeError, ValueError):
        return None


class ServerSource:
    """The dashboard's data for one team: the server database plus the controllers' state store."""

    def __init__(self, engine: Engine, team_id: int, store: StateStore, user_id: int | None = None) -> None:
        self.engine, self.team_id, self.store, self.user_id = engine, team_id, store, user_id

    # ---- one row ------------------------------------------------------------------------------
    def _row(self, j: Job, ev: Event | None, member: str, ctl: dict | None) -> dict:
        atts = self.store.attempts(j.name) if ctl else []
        last = {"type": ev.kind, "message": ev.text, "time": ev.time} if ev is not None else None
        if ctl:
            sev = self.store.events(j.name, limit=1)
            if sev and (last is None or sev[-1]["time"] >= last["time"]):
                last = sev[-1]
        job = {"name": j.name, "state": (ctl or {}).get("state") or j.state.upper(),
               "reason": j.reason or (ctl or {}).get("reason"),
               "step": (ctl or {}).get("step"), "steps": (ctl or {}).get("steps") or _steps_of(j.spec),
               "tokens_per_s": (ctl or {}).get("tokens_per_s"), "loss": (ctl or {}).get("loss"),
               "budget_usd": _budget_of(j.spec) or (ctl or {}).get("budget_usd"),
               "steps_lost": (ctl or {}).get("steps_lost"), "updated": j.updated, "created": j.created}
        row = run_row(job, atts, j.spend_usd or 0.0, last, member)
        row.update(server_state=j.state, requested_action=j.requested_action)
        return row

    def _members(self, s) -> dict[int, str]:
        return {u.id: u.name for u in s.scalars(select(User).where(User.team_id == self.team_id))}

    def _job(self, s, name: str) -> Job | None:
        return s.scalar(select(Job).where(Job.team_id == self.team_id, Job.name == name))

    # ---- DataSource ---------------------------------------------------------------------------
    def runs(self) -> list[dict]:
        with session_scope(self.engine) as s:
            jobs = s.scalars(select(Job).options(defer(Job.plan))  # the plan record: large, not shown here
                             .where(Job.team_id == self.team_id).order_by(Job.id)).all()
            newest = (select(func.max(Event.id)).join(Job, Job.id == Event.job_id)
                      .where(Job.team_id == self.team_id).group_by(Event.job_id))
            last = {e.job_id: e for e in s.scalars(select(Event).where(Event.id.in_(newest)))}
            members = self._members(s)
        ctl = {c["name"]: c for c in self.store.list_jobs()}  # one read, not one per job
        return [self._row(j, last.get(j.id), members.get(j.user_id, "?"), ctl.get(j.name)) for j in jobs]

    def run(self, name: str) -> dict | None:
        with session_scope(self.engine) as s:
            j = self._job(s, name)
            if j is None:
                return None
            evs = list(reversed(s.scalars(select(Event).where(Event.job_id == j.id)
                                          .order_by(Event.id.desc()).limit(50)).all()))
            member = self._members(s).get(j.user_id, "?")
        row = self._row(j, evs[-1] if evs else None, member, self.store.get_job(name))
        server_events = [{"id": f"s{e.id}", "time": e.time, "type": e.kind, "message": e.text} for e in evs]
        if self.store.get_job(name) is not None:
            d = detail(self.store, name)
            events = sorted(d["events"] + server_events, key=lambda e: e["time"])[-50:]
        else:  # queued, no controller has it yet
            d = {"val_loss": None, "last_committed_step": None, "train": [], "val": [],
                 "spend_curve": {"hours": [], "usd": []}, "timeline": [], "nodes": [], "log_tail": "",
                 "quote_usd_per_hour": None, "booked_usd_per_hour": j.price_per_hour}
            events = server_events
        return {**d, **row, "events": events, "estimate_usd": budget.job_estimate_usd(j) or d.get("estimate_usd"),
                "booked_usd_per_hour": d.get("booked_usd_per_hour") or j.price_per_hour,
                "stoppable": j.state not in TERMINAL}

    def stop(self, name: str) -> str:
        """What ``POST /v1/jobs/{name}/down`` does (``jobs.request_stop``): the owning replica passes
        it to the job's controller, which checkpoints and terminates."""
        from orchestrator.server.jobs import request_stop

        with session_scope(self.engine) as s:
            j = self._job(s, name)
            if j is None:
                raise KeyError(name)
            if j.state in TERMINAL:
                return f"{name} is already {j.state}; nothing is running"
            request_stop(s, j)
            return f"{name}: asked the server's controller to checkpoint and stop (as `dtrun down {name}`)"

    def team(self) -> dict:
        with session_scope(self.engine) as s:
            team = s.get(Team, self.team_id)
            month = budget.team_month(s, team)
            members = self._members(s)
            who = dict(s.execute(select(Job.name, Job.user_id).where(Job.team_id == self.team_id)).all())
        runs = [{"name": r["name"], "state": r["state"], "member": members.get(who.get(r["name"]), "?"),
                 "spent_usd": r["spend_usd"] or 0.0, "estimate_usd": r["estimate_usd"],
                 "active": r["state"] not in TERMINAL} for r in month["jobs"]]
        out = team_view(team.name, team.monthly_usd, month["month_start"], runs)
        # the API's own sums (GET /v1/cost/team), not re-added here
        out.update(spent_usd=month["spent_usd"], committed_usd=month["committed_usd"], left_usd=month["left_usd"])
        return out


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else None


def _token(request: Request) -> str | None:
    return _bearer(request) or request.cookies.get(COOKIE)


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    return not origin or urlsplit(origin).netloc == request.headers.get("host", "")


def _client(request: Request) -> str:
    return request.client.host if request.client else "?"


def _user(engine: Engine, limiter: BadTokenLimiter, request: Request, token: str | None) -> tuple[int, int]:
    """(user id, team id) of ``token``; 429 while the client is rate-limited, 401 otherwise."""
    client = _client(request)
    if limiter.blocked(client):
        raise HTTPException(429, "too many bad tokens from this client; try again later")
    try:
        with session_scope(engine) as s:
            u = authenticate(s, token)
            return u.id, u.team_id
    except AuthError:
        if token:
            limiter.record_bad(client)
        raise HTTPException(401, NO_TOKEN) from None


def source_for_factory(engine: Engine, get_store: Callable[[], StateStore], limiter: BadTokenLimiter):
    """``source_for(request)`` for ``make_router``: the caller's team's ``ServerSource``."""

    def source_for(request: Request) -> ServerSource:
        user_id, team_id = _user(engine, limiter, request, _token(request))
        if request.method not in ("GET", "HEAD") and not _bearer(request) and not _same_origin(request):
            # a cookie-authenticated change from another site's page (SameSite=Strict already keeps
            # the cookie off such requests in current browsers; this is the second lock)
            raise HTTPException(403, "a request from another site's page is refused")
        return ServerSource(engine, team_id, get_store(), user_id)
    return source_for


def login_router(engine: Engine, limiter: BadTokenLimiter) -> APIRouter:
    r = APIRouter(prefix=PREFIX)

    @r.get("/login", response_class=HTMLResponse)
    def login_form() -> HTMLResponse:
        return HTMLResponse(pages.login_page("", f"{PREFIX}/login"))

    @r.post("/login")
    async def login(request: Request) -> Any:
        raw = await request.body()
        form = parse_qs(raw[:4096].decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0].strip()
        try:
            _user(engine, limiter, request, token)
        except HTTPException as e:
            msg = "that token is not valid" if e.status_code == 401 else str(e.detail)
            return HTMLResponse(pages.login_page(msg, f"{PREFIX}/login"), status_code=e.status_code)
        resp = RedirectResponse(f"{PREFIX}/", status_code=303)
        resp.set_cookie(COOKIE, token, max_age=COOKIE_MAX_AGE_S, path=PREFIX, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return resp

    @r.post("/logout")
    def logout() -> Any:
        resp = RedirectResponse(f"{PREFIX}/login", status_code=303)
        resp.delete_cookie(COOKIE, path=PREFIX)
        return resp

    return r


def mount_dashboard(app: FastAPI, engine: Engine, store_path: str | None = None, store: Any = None) -> None:
    """Serve the dashboard under ``/dashboard`` of the API app (``create_app``), over the store the
    server's controller replicas write: ``store`` (``dtrun server``: the ``CtlStore`` in the server
    database), else the file ``store_path`` (default ``$DTRUN_HOME/state.db``)."""
    limiter = getattr(app.state, "limiter", None) or BadTokenLimiter()
    opened: list[StateStore] = []
    lock = threading.Lock()

    def get_store() -> StateStore:  # opened on the first dashboard request, not when the app is made
        with lock:
            if not opened:
                opened.append(store if store is not None else StateStore(store_path))
            return opened[0]

    app.include_router(login_router(engine, limiter))
    app.include_router(make_router(source_for_factory(engine, get_store, limiter), prefix=PREFIX,
                                   link_token=lambda request: ""))

"""``dtrun server import``: bring an embedded ``~/.dtrun`` (``orchestrator.run.state``'s SQLite
store) into a server's database, for one team — each ended job with its state and reason, its
attempts (outcome, times, price, booked spend: the ``spend`` rows) and its events, so the team's
month (``orchestrator.server.budget``) counts what it already spent.

Idempotent: a job is keyed by its name (unique on a server); one already there is skipped, so a
second run imports nothing new. A job still active in the embedded store (a controller on the
laptop may still be running it) is skipped and named: importing it would give it two
controllers; import it again once it ended (``dtrun down`` stops it). The source is only read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.contract.errors import NotFoundError
from orchestrator.run.state import TERMINAL_STATES, StateStore
from orchestrator.server.jobs import add_event
from orchestrator.server.models import Attempt, Job, Lease, Team, User

# the embedded controller's states → the server's (as orchestrator.server.replica writes them)
_STATE = {"SUCCEEDED": "finished", "FAILED": "failed", "CANCELLED": "stopped", "OVER_BUDGET": "stopped"}


def open_home(home: Path) -> StateStore:
    path = Path(home) / "state.db"
    if not path.is_file():
        raise NotFoundError(f"--home: no embedded state store at {path}")
    return StateStore(path)


def pick_user(s: Session, team: Team, user: str | None) -> User:
    """The named user of the team, else its first admin, else its first user."""
    users = list(s.scalars(select(User).where(User.team_id == team.id).order_by(User.id)))
    if user is not None:
        for u in users:
            if u.name == user:
                return u
        raise NotFoundError(f"--user: no user {user!r} in team {team.name!r}")
    if not users:
        raise NotFoundError(f"--user: team {team.name!r} has no users; make one with `dtrun server admin user`")
    return next((u for u in users if u.role == "admin"), users[0])


def _spec(job: dict) -> dict:
    try:
        spec = yaml.safe_load(job["spec_yaml"])
    except yaml.YAMLError:
        spec = None
    return spec if isinstance(spec, dict) else {"name": job["name"]}


def _plan(job: dict) -> dict | None:
    try:
        est = json.loads(job["estimate_json"]) if job.get("estimate_json") else None
    except ValueError:
        est = None
    return {"plan": {"estimate": est}, "imported": True} if isinstance(est, dict) else None


def import_store(s: Session, store: StateStore, team: Team, user: User, source: str) -> dict[str, Any]:
    """Import ``store``'s ended jobs into ``team`` (inside the caller's transaction)."""
    out: dict[str, Any] = {"imported": [], "skipped": [], "attempts": 0, "events": 0, "spend_usd": 0.0}
    taken = set(s.scalars(select(Job.name)))
    for row in store.list_jobs():
        name = row["name"]
        if name in taken:
            out["skipped"].append((name, "already on the server"))
            continue
        if row["state"] not in TERMINAL_STATES:
            out["skipped"].append((name, f"still {row['state']} in the embedded store: import it once it "
                                         f"ended (`dtrun down {name}` stops it)"))
            continue
        spend = {r["attempt"]: r for r in store.spend_by_attempt(name)}
        total = sum(r["usd"] for r in spend.values())
        atts = store.attempts(name)
        job = Job(team_id=team.id, user_id=user.id, name=name, spec=_spec(row), plan=_plan(row),
                  state=_STATE.get(row["state"], "failed"), reason=row.get("reason"), created=row["created"],
                  updated=row["updated"], spend_usd=total,
                  booked_until=max((r["billed_until"] for r in spend.values()), default=None),
                  attempt=max((a["n"] for a in atts), default=0), price_per_hour=0.0)
        s.add(job)
        s.flush()
        s.add(Lease(job_id=job.id, replica=None, expires_at=0.0, epoch=0))
        for a in atts:
            sp = spend.get(a["n"]) or {}
            s.add(Attempt(job_id=job.id, n=a["n"], provider=a["provider"], state=a["state"], outcome=a.get("outcome"),
                          reason=a.get("reason"), created=a["created"], launched_at=a.get("launched_at"),
                          ended_at=a.get("ended_at"), price_per_hour=sp.get("price_per_hour"),
                          seconds=float(sp.get("seconds") or 0.0), spend_usd=float(sp.get("usd") or 0.0)))
        events = store.events(name)
        for e in events:
            s.add(_event(job, e))
        add_event(s, job, "import", f"imported from {source} ({row['state']}, {len(atts)} attempts, ${total:.2f})")
        taken.add(name)
        out["imported"].append(name)
        out["attempts"] += len(atts)
        out["events"] += len(events)
        out["spend_usd"] += total
    return out


def _event(job: Job, e: dict):
    from orchestrator.server.models import Event

    return Event(job_id=job.id, time=e["time"], kind=str(e["type"])[:40], text=e["message"])

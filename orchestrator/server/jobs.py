"""What the API calls to change the server's state: submit a job, ask it to stop, log an event.

Each takes an open session (``orchestrator.server.db.session_scope``) and leaves the commit to it.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.contract.errors import DtrunError
from orchestrator.server.models import TERMINAL, Event, Job, Lease, Team, User


class ServerStateError(DtrunError):
    """A request the server's state refuses (a job name taken, a job not found)."""


def submit_job(session: Session, team: Team, user: User, name: str, spec: dict, plan: dict | None) -> Job:
    """A new ``queued`` job with a free lease row (any replica may claim it)."""
    if session.scalar(select(Job).where(Job.team_id == team.id, Job.name == name)) is not None:
        raise ServerStateError(f"name: a job named {name!r} already exists in team {team.name!r}")
    if session.scalar(select(Job.id).where(Job.name == name)) is not None:
        # the controllers' state store (orchestrator.run.state) and the instance names key by job name
        raise ServerStateError(f"name: a job named {name!r} already exists in another team "
                               f"(job names are unique on this server)")
    job = Job(team_id=team.id, user_id=user.id, name=name, spec=spec, plan=plan, state="queued")
    session.add(job)
    session.flush()
    session.add(Lease(job_id=job.id, replica=None, expires_at=0.0, epoch=0))
    add_event(session, job, "state", "queued")
    return job


def request_stop(session: Session, job: Job, now: bool = False) -> None:
    """Ask the job's owning replica to stop it (``stop_now``: without the last checkpoint)."""
    if job.state in TERMINAL:
        return
    job.requested_action = "stop_now" if now else "stop"
    add_event(session, job, "request", job.requested_action)


def add_event(session: Session, job: Job, kind: str, text: str = "") -> None:
    session.add(Event(job_id=job.id, kind=kind, text=text))

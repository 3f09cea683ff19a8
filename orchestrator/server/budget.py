"""A team's budget in dollars: what is left of its ``monthly_usd`` this (UTC) month.

Spent this month: the spend booked on the team's jobs created or updated since the month began.
Committed: what the team's running (and queued) jobs are still expected to spend — each job's
buffered estimate (its plan's ``estimate.cost_usd``) less what it has booked so far, never below
zero. A new job is refused when its buffered estimate is more than ``monthly_usd - spent -
committed`` (exit 3, over budget: the same code the CLI's dry run uses for a job's own budget).
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from orchestrator.server.models import TERMINAL, Job, Team


def month_start(now: float | None = None) -> float:
    t = dt.datetime.fromtimestamp(now, dt.timezone.utc) if now else dt.datetime.now(dt.timezone.utc)
    return dt.datetime(t.year, t.month, 1, tzinfo=dt.timezone.utc).timestamp()


def job_estimate_usd(job: Job) -> float:
    """The buffered estimate the job was admitted with (0 when it has no plan)."""
    try:
        return float(((job.plan or {}).get("plan") or {}).get("estimate", {}).get("cost_usd") or 0.0)
    except (AttributeError, TypeError, ValueError):
        return 0.0


def team_month(s: Session, team: Team, now: float | None = None) -> dict:
    """The team's month: budget, spent, committed (running jobs' expected remaining), left."""
    start = month_start(now)
    jobs = s.scalars(select(Job).where(Job.team_id == team.id,
                                       or_(Job.created >= start, Job.updated >= start,
                                           Job.state.not_in(TERMINAL)))).all()
    spent = sum(j.spend_usd or 0.0 for j in jobs)
    committed = sum(max(0.0, job_estimate_usd(j) - (j.spend_usd or 0.0)) for j in jobs if j.state not in TERMINAL)
    left = None if team.monthly_usd is None else team.monthly_usd - spent - committed
    return {"team": team.name, "month_start": start, "monthly_usd": team.monthly_usd,
            "spent_usd": round(spent, 6), "committed_usd": round(committed, 6),
            "left_usd": None if left is None else round(left, 6),
            "jobs": [{"name": j.name, "state": j.state, "spend_usd": j.spend_usd,
                      "estimate_usd": job_estimate_usd(j)} for j in jobs]}


def refusal(month: dict, estimate_usd: float) -> str | None:
    """Why a job with this buffered estimate does not fit the team's month, else None."""
    left = month["left_usd"]
    if left is None or estimate_usd <= left:
        return None
    return (f"budget: the job's estimate ${estimate_usd:,.2f} (with buffer) is more than the ${max(left, 0):,.2f} "
            f"left of team {month['team']!r}'s ${month['monthly_usd']:,.2f} this month "
            f"(spent ${month['spent_usd']:,.2f}, running jobs still expected to spend ${month['committed_usd']:,.2f})")

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


def cap_check(s: Session, team: Team, now: float, tick_s: float, grace_s: float) -> tuple[str, str] | None:
    """The running guard of the team's cap: ``("stop" | "hard", reason)`` when the team's booked
    spend this month, carried on to ``now`` at each running job's rate (``jobs.price_per_hour``:
    what it bills now, written by its owner's last tick), plus that rate over the next tick and a
    graceful stop (``tick_s + grace_s``) would reach ``monthly_usd`` ("hard": even the next tick
    alone would: terminate without the checkpoint). None when it fits (or the team has no cap).
    The same arithmetic as a job's own guard (``orchestrator.run.guard``), over the team's jobs
    whichever replica owns them."""
    cap = team.monthly_usd
    if cap is None:
        return None
    start = month_start(now)
    jobs = s.scalars(select(Job).where(Job.team_id == team.id,
                                       or_(Job.created >= start, Job.updated >= start,
                                           Job.state.not_in(TERMINAL)))).all()
    spent, rate = 0.0, 0.0
    for j in jobs:
        spent += j.spend_usd or 0.0
        if j.state not in TERMINAL and j.price_per_hour:
            rate += j.price_per_hour
            if j.booked_until is not None:
                spent += j.price_per_hour * max(0.0, now - j.booked_until) / 3600.0
    if rate <= 0:
        return None
    head = (f"team budget: team {team.name!r} has ${spent:.2f} spent this month at ${rate:.2f}/h over its "
            f"running jobs")
    if spent + rate * tick_s / 3600.0 >= cap:
        return "hard", f"{head}; the next tick would cross its monthly_usd ${cap:.2f}: stopping now"
    if spent + rate * (tick_s + grace_s) / 3600.0 >= cap:
        return "stop", (f"{head}; the next tick and a graceful stop would cross its monthly_usd "
                        f"${cap:.2f}: stopping with a checkpoint")
    return None

"""Job leases: each job is owned by at most one controller replica at a time.

A replica claims a job whose lease is free or expired, renews every tick, and loses it when it
stops renewing for ``ttl`` seconds. Each claim increments the row's ``epoch`` (a fencing token):
every write a replica makes for a job it owns (booking spend, recording a launch) goes through
:func:`fenced`, which re-reads the lease row *with a row lock* in the same transaction and refuses
when the epoch has moved on — so a replica that paused past its lease (GC, SIGSTOP, a network
partition) and wakes believing it still owns the job books nothing and launches nothing.

Locking. PostgreSQL: ``SELECT ... FOR UPDATE SKIP LOCKED`` on the lease rows, so replicas claiming
at the same time each take different jobs without waiting on each other; :func:`fenced` takes
``FOR UPDATE`` (waits) on the one row. SQLite has no row locks: the engine begins every
transaction with ``BEGIN IMMEDIATE`` (``orchestrator.server.db``), so one writer at a time holds
the whole database — correct, and slower; fine for one machine's replicas, not for many.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from orchestrator.server.models import TERMINAL, Job, Lease

TTL_S = 15.0  # a lease not renewed for this long is free for another replica


class LeaseLost(Exception):
    """This replica no longer owns the job (its epoch is stale)."""


def _locked(stmt, session: Session, skip_locked: bool = False):
    if session.get_bind().dialect.name == "postgresql":
        return stmt.with_for_update(skip_locked=skip_locked)
    return stmt  # SQLite: the transaction holds the database's write lock already


def claim(session: Session, replica: str, now: float, limit: int = 10, ttl: float = TTL_S) -> dict[int, int]:
    """Take up to ``limit`` jobs whose lease is free or expired: {job id: epoch claimed}."""
    stmt = (select(Lease).join(Job, Job.id == Lease.job_id)
            .where(Job.state.not_in(TERMINAL), or_(Lease.replica.is_(None), Lease.expires_at < now))
            .order_by(Lease.job_id).limit(limit))
    got = {}
    for lease in session.scalars(_locked(stmt, session, skip_locked=True)):
        lease.replica, lease.expires_at, lease.epoch = replica, now + ttl, lease.epoch + 1
        got[lease.job_id] = lease.epoch
    return got


def renew(session: Session, replica: str, owned: dict[int, int], now: float, ttl: float = TTL_S) -> dict[int, int]:
    """Extend each lease still ours; returns the ones kept (an expired one taken by another
    replica is dropped)."""
    if not owned:
        return {}
    stmt = select(Lease).where(Lease.job_id.in_(owned)).order_by(Lease.job_id)
    kept = {}
    for lease in session.scalars(_locked(stmt, session)):
        if lease.replica == replica and lease.epoch == owned[lease.job_id]:
            lease.expires_at = now + ttl
            kept[lease.job_id] = lease.epoch
    return kept


def release(session: Session, replica: str, job_id: int, epoch: int) -> None:
    """Give a lease up (the job ended, or the replica shuts down cleanly)."""
    lease = session.scalar(_locked(select(Lease).where(Lease.job_id == job_id), session))
    if lease is not None and lease.replica == replica and lease.epoch == epoch:
        lease.replica, lease.expires_at = None, 0.0


@contextlib.contextmanager
def fenced(session: Session, replica: str, job_id: int, epoch: int) -> Iterator[Job]:
    """The job, for a write that only its current owner may make (inside the caller's
    transaction); raises :class:`LeaseLost` when the lease is no longer ``(replica, epoch)``."""
    lease = session.scalar(_locked(select(Lease).where(Lease.job_id == job_id), session))
    if lease is None or lease.replica != replica or lease.epoch != epoch:
        raise LeaseLost(f"job {job_id}: lease epoch {epoch} of {replica} is no longer current")
    yield session.get(Job, job_id)

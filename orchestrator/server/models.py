"""The server's tables (SQLAlchemy 2.0 declarative).

``teams`` own ``users``, ``jobs`` and ``team_secrets``; a user holds ``api_tokens`` (only the
SHA-256 of each token is stored). A job's ``lease`` row names the controller replica owning it,
until when, and a fencing ``epoch`` that grows with every change of owner: a replica books spend
or launches only while the epoch it claimed is still the row's (``orchestrator.server.leases``).
"""

from __future__ import annotations

import time

from sqlalchemy import JSON, Float, LargeBinary, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

ROLES = ("admin", "member")
JOB_STATES = ("queued", "running", "stopping", "finished", "failed", "stopped")
TERMINAL = ("finished", "failed", "stopped")


def _now() -> float:
    return time.time()


class Base(DeclarativeBase):
    pass


class Team(Base):
    __tablename__ = "teams"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    monthly_usd: Mapped[float | None] = mapped_column(Float)
    users: Mapped[list[User]] = relationship(back_populates="team")


class User(Base):
    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("team_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id"))
    name: Mapped[str] = mapped_column(String(100))
    role: Mapped[str] = mapped_column(String(10), default="member")  # admin | member
    team: Mapped[Team] = relationship(back_populates="users")


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    sha256: Mapped[str] = mapped_column(String(64), unique=True)  # hex digest; never the token
    created: Mapped[float] = mapped_column(Float, default=_now)
    last_used: Mapped[float | None] = mapped_column(Float)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("team_id", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id"))
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict] = mapped_column(JSON)
    plan: Mapped[dict | None] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(20), default="queued", index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    requested_action: Mapped[str | None] = mapped_column(String(20))  # stop | stop_now
    created: Mapped[float] = mapped_column(Float, default=_now)
    updated: Mapped[float] = mapped_column(Float, default=_now, onupdate=_now)
    spend_usd: Mapped[float] = mapped_column(Float, default=0.0)  # booked so far
    booked_until: Mapped[float | None] = mapped_column(Float)  # spend is booked up to this time
    # the node of the current attempt (so a new owner re-attaches instead of launching again)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    node_handle: Mapped[dict | None] = mapped_column(JSON)
    price_per_hour: Mapped[float | None] = mapped_column(Float)


class Event(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), index=True)
    time: Mapped[float] = mapped_column(Float, default=_now)
    kind: Mapped[str] = mapped_column(String(40))
    text: Mapped[str] = mapped_column(Text, default="")


class Lease(Base):
    __tablename__ = "leases"
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    replica: Mapped[str | None] = mapped_column(String(100))
    expires_at: Mapped[float] = mapped_column(Float, default=0.0)
    epoch: Mapped[int] = mapped_column(Integer, default=0)


class TeamSecret(Base):
    __tablename__ = "team_secrets"
    __table_args__ = (UniqueConstraint("team_id", "kind"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    team_id: Mapped[int] = mapped_column(ForeignKey("teams.id"))
    kind: Mapped[str] = mapped_column(String(40))  # e.g. aws, runpod, lambda
    ciphertext: Mapped[bytes] = mapped_column(LargeBinary)


class Attempt(Base):
    """One attempt of a job, its outcome and its booked spend (so far: the history ``dtrun server
    import`` brings from an embedded ``~/.dtrun``; a replica's live attempts stay in the
    controllers' state store)."""

    __tablename__ = "attempts"
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    n: Mapped[int] = mapped_column(Integer, primary_key=True)
    provider: Mapped[str] = mapped_column(String(40))
    state: Mapped[str] = mapped_column(String(20))
    outcome: Mapped[str | None] = mapped_column(String(40))
    reason: Mapped[str | None] = mapped_column(Text)
    created: Mapped[float] = mapped_column(Float)
    launched_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    price_per_hour: Mapped[float | None] = mapped_column(Float)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    spend_usd: Mapped[float] = mapped_column(Float, default=0.0)


from orchestrator.server.ctlschema import declare as _declare_ctl_tables  # noqa: E402

_declare_ctl_tables(Base.metadata)  # the controllers' ctl_* tables

"""The controllers' state store in the server database: ``orchestrator.run.statedb``'s tables
(same columns, same meaning) prefixed ``ctl_`` — ``ctl_jobs``, ``ctl_attempts``, ``ctl_nodes``,
``ctl_events``, ``ctl_spend``, ``ctl_meta``. Created by migration 0003; declared here on the
models' metadata so ``alembic`` sees no drift. Queried by :mod:`orchestrator.server.ctlstore`.
"""

from __future__ import annotations

from sqlalchemy import Column, Float, Index, Integer, MetaData, Table, Text


def _c(name: str, type_, nullable: bool = True, **kw) -> Column:
    return Column(name, type_, nullable=nullable, **kw)


def _zero(name: str) -> Column:
    return Column(name, Integer, nullable=False, server_default="0")


def declare(metadata: MetaData) -> None:
    """The ctl_* tables on ``metadata`` (the models' ``Base.metadata``: called once by
    ``orchestrator.server.models``, so this module imports nothing of the server's)."""
    ctl_jobs = Table(
        "ctl_jobs", metadata,
        _c("name", Text, False, primary_key=True), _c("state", Text, False), _c("reason", Text),
        _c("spec_yaml", Text, False), _c("spec_path", Text), _c("run_uri", Text, False), _c("providers", Text),
        _c("created", Float, False), _c("updated", Float, False), _c("started_at", Float), _c("finished_at", Float),
        _c("deadline", Float), _c("step", Integer), _c("steps", Integer), _c("loss", Float),
        _c("tokens_per_s", Float), _c("last_committed_step", Integer), _c("progress_time", Float),
        _zero("steps_lost"), _c("estimate_json", Text), _c("budget_usd", Float),
        Column("session_first_attempt", Integer, nullable=False, server_default="1"), _zero("restarts_used"),
        _c("stop_target", Text), _c("stop_reason", Text), _c("stop_started", Float), _zero("stop_now"),
        _c("requested_action", Text), _c("controller_pid", Integer), _c("controller_host", Text),
        _c("controller_seen", Float), _c("controller_log", Text), _c("val_loss", Float),
    )
    ctl_attempts = Table(
        "ctl_attempts", metadata,
        _c("job", Text, False, primary_key=True), _c("n", Integer, False, primary_key=True, autoincrement=False),
        _c("provider", Text, False), _c("offer_json", Text, False), _c("state", Text, False), _c("outcome", Text),
        _c("reason", Text), _c("created", Float, False), _c("launched_at", Float), _c("running_at", Float),
        _c("ended_at", Float), _c("start_step", Integer), _c("end_step", Integer), _c("log_path", Text),
        _c("nodes_json", Text),
    )
    ctl_nodes = Table(
        "ctl_nodes", metadata,
        _c("id", Integer, False, primary_key=True, autoincrement=True), _c("job", Text, False),
        _c("attempt", Integer, False), _c("provider", Text, False), _c("name", Text, False),
        _c("instance_id", Text, False), _c("region", Text), _c("handle_json", Text, False), _c("state", Text, False),
        _c("created", Float, False), _c("terminate_requested", Float), _c("terminated_at", Float),
        Index("ctl_nodes_job", "job"),
    )
    ctl_events = Table(
        "ctl_events", metadata,
        _c("id", Integer, False, primary_key=True, autoincrement=True), _c("job", Text, False),
        _c("time", Float, False), _c("type", Text, False), _c("message", Text, False), _c("data_json", Text),
        Index("ctl_events_job", "job", "id"),
    )
    ctl_spend = Table(
        "ctl_spend", metadata,
        _c("job", Text, False, primary_key=True), _c("attempt", Integer, False, primary_key=True, autoincrement=False),
        _c("price_per_hour", Float, False), _c("billed_from", Float, False), _c("billed_until", Float, False),
        Column("seconds", Float, nullable=False, server_default="0"),
        Column("usd", Float, nullable=False, server_default="0"), _zero("closed"),
    )
    ctl_meta = Table("ctl_meta", metadata, _c("key", Text, False, primary_key=True), _c("value", Text, False))

    TABLES = (ctl_jobs, ctl_attempts, ctl_nodes, ctl_events, ctl_spend, ctl_meta)

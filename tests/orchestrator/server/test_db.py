"""The server's schema through its Alembic migration on SQLite and PostgreSQL, the job helpers
the API calls, and the leases' claim / renew / fencing."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, select

from orchestrator.server import leases
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.jobs import ServerStateError, request_stop, submit_job
from orchestrator.server.migrate import upgrade
from orchestrator.server.models import Event, Job, Lease, Team, User


@pytest.fixture
def engine(db_url):
    e = make_engine(db_url)
    upgrade(e)
    yield e
    e.dispose()


def _seed(engine, n_jobs=3):
    with session_scope(engine) as s:
        team = Team(name="ml", monthly_usd=500.0)
        s.add(team)
        s.flush()
        user = User(team_id=team.id, name="ada", role="admin")
        s.add(user)
        s.flush()
        return [submit_job(s, team, user, f"job{i}", {"name": f"job{i}"}, {"usd": 1.0}).id for i in range(n_jobs)]


def test_migration_creates_every_table_and_runs_twice(engine):
    upgrade(engine)  # already at head: nothing to do, no error
    names = set(inspect(engine).get_table_names())
    assert {"teams", "users", "api_tokens", "jobs", "events", "leases", "team_secrets", "alembic_version"} <= names


def test_submit_refuses_a_taken_name_and_stop_is_recorded(engine):
    ids = _seed(engine, 1)
    with pytest.raises(ServerStateError, match="name: a job named 'job0' already exists"):
        with session_scope(engine) as s:
            team, user = s.scalars(select(Team)).one(), s.scalars(select(User)).one()
            submit_job(s, team, user, "job0", {}, None)
    with pytest.raises(ServerStateError, match="name: a job named 'job0' already exists in another team"):
        with session_scope(engine) as s:
            other = Team(name="other")
            s.add(other)
            s.flush()
            bob = User(team_id=other.id, name="bob")
            s.add(bob)
            s.flush()
            submit_job(s, other, bob, "job0", {}, None)
    with session_scope(engine) as s:
        request_stop(s, s.get(Job, ids[0]))
    with session_scope(engine) as s:
        assert s.get(Job, ids[0]).requested_action == "stop"
        assert [e.kind for e in s.scalars(select(Event).order_by(Event.id))] == ["state", "request"]


def test_two_replicas_never_hold_one_job_and_a_stale_epoch_is_fenced(engine):
    ids = _seed(engine, 3)
    with session_scope(engine) as s:
        a = leases.claim(s, "A", now=100.0, limit=2)
    with session_scope(engine) as s:
        b = leases.claim(s, "B", now=101.0, limit=10)
    assert len(a) == 2 and len(b) == 1 and not set(a) & set(b) and set(a) | set(b) == set(ids)
    # A stops renewing; after the TTL B takes A's jobs with a higher epoch
    with session_scope(engine) as s:
        b2 = leases.claim(s, "B", now=100.0 + leases.TTL_S + 1)
    assert set(b2) == set(a) and all(b2[j] == a[j] + 1 for j in a)
    j = next(iter(a))
    with pytest.raises(leases.LeaseLost, match="no longer current"):
        with session_scope(engine) as s, leases.fenced(s, "A", j, a[j]) as job:
            job.spend_usd += 1.0  # never reached
    with session_scope(engine) as s:
        assert leases.renew(s, "A", a, now=120.0) == {}
        with leases.fenced(s, "B", j, b2[j]) as job:
            job.spend_usd += 1.0
    with session_scope(engine) as s:
        assert s.get(Job, j).spend_usd == 1.0
        assert s.get(Lease, j).replica == "B"


def test_postgresql_claims_at_the_same_moment_skip_each_others_locked_rows(pg_url):
    """Two replicas claiming while the other's transaction is still open: on PostgreSQL the second
    skips the rows the first locked (no wait, no double claim)."""
    engine = make_engine(pg_url)
    upgrade(engine)
    ids = _seed(engine, 4)
    with session_scope(engine) as a:
        got_a = leases.claim(a, "A", now=100.0, limit=2)
        with session_scope(engine) as b:  # A has not committed: its two rows stay locked
            got_b = leases.claim(b, "B", now=100.0, limit=4)
    assert len(got_a) == 2 and len(got_b) == 2 and set(got_a) | set(got_b) == set(ids)
    with session_scope(engine) as s:
        assert {lease.replica for lease in s.scalars(select(Lease))} == {"A", "B"}
    engine.dispose()


def test_the_migrations_build_exactly_what_the_models_declare(engine):
    """No drift between models.py and migrations/ (a column added to one and not the other fails)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from orchestrator.server.models import Base

    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []

"""The server's database: an engine from a URL and a session helper.

Default: SQLite at ``$DTRUN_HOME/server.db`` (one writer at a time: see
``orchestrator.server.leases``); PostgreSQL with ``postgresql+psycopg://user@/db?host=/socket/dir``.
The schema is created by the Alembic migrations (:func:`orchestrator.server.migrate.upgrade`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.run.statedb import dtrun_home


def default_url() -> str:
    return os.environ.get("DTRUN_SERVER_DB") or f"sqlite:///{dtrun_home() / 'server.db'}"


def make_engine(url: str | None = None) -> Engine:
    url = url or default_url()
    if url.startswith("sqlite"):
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            os.makedirs(os.path.dirname(os.path.abspath(url[len("sqlite:///"):])), exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):
            # BEGIN IMMEDIATE: take the write lock at the start, so two replicas never both read a
            # lease as free (SQLite's single-writer stand-in for SELECT ... FOR UPDATE)
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True)


_sessions: dict[int, sessionmaker] = {}


@contextlib.contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One transaction: commits on success, rolls back on an exception."""
    maker = _sessions.setdefault(id(engine), sessionmaker(engine, expire_on_commit=False))
    with maker() as s:
        with s.begin():
            yield s

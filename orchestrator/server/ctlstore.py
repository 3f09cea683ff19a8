"""The controllers' state store in the server database: :class:`CtlStore` is a
``orchestrator.run.state.StateStore`` (same methods, same queries, same return shapes) whose rows
live in the ``ctl_*`` tables of the server's database (``orchestrator.server.ctlschema``, migration
0003) over the server's SQLAlchemy engine (``orchestrator.server.db.make_engine``: SQLite or
PostgreSQL). Every replica of ``dtrun server``, on any machine, opens one over the same database,
so a replica adopting a job finds the attempts, nodes (provider handles), events and spend rows
the previous owner recorded: it re-attaches instead of launching again, and books on from the
spend row's ``billed_until`` (no gap, no double count). The embedded CLI keeps its SQLite file.

Sharing the SQL. ``StateStore``'s methods run unchanged: their connection is :class:`_Conn`, which
turns each statement into a SQLAlchemy ``text()`` — table names prefixed ``ctl_``, ``?`` into
named binds; on PostgreSQL ``INSERT OR IGNORE`` becomes ``INSERT ... ON CONFLICT DO NOTHING`` and
an insert that needs its new id says ``RETURNING id``.

Locking under several replicas. Each write is one transaction (``engine.begin()``). Where the
SQLite store relies on ``BEGIN IMMEDIATE`` to read-then-write atomically (``book_spend``,
``claim_controller``, ``request_action`` / ``pop_action``, ``create_job``), the read takes a row
lock here (``SELECT ... FOR UPDATE``, ``StateStore._FOR_UPDATE``) on PostgreSQL; on a SQLite server
database the engine begins every transaction with ``BEGIN IMMEDIATE`` already. Two bookings of
one attempt's spend from two replicas therefore serialize, and the second books only past the
first's ``billed_until``. Unique keys back the rest: ``(job, n)`` of an attempt, ``(job, attempt)``
of a spend row (opened once: ``ON CONFLICT DO NOTHING``), the ``owner_id`` row of ``ctl_meta``.

Ownership. The job's lease (``orchestrator.server.leases``) decides which replica runs it; the
store's controller columns only tell the orphan sweep a job is being run. A replica's controller
is recorded with host ``server:<host>``, so it is judged alive by its last ``touch_controller``
(within 120 s), never by a pid on the sweeper's machine: no replica's orphan sweep ends a live
node another replica recorded. :meth:`CtlStore.adopt` hands the row to a replica that just took
the lease (an expired owner's recent touch would otherwise read as "busy").

``owner_id``: one per server database (``ctl_meta``), so every replica's nodes carry the same
owner and the sweeps of all replicas agree on which instances are ours.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Iterable

from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine

from orchestrator.run.state import HOST, StateStore, StateStoreError

SERVER_HOST = "server:"
"""Prefix of ``controller_host`` for a controller run by a server replica."""

_TABLE = re.compile(r"\b(FROM|INTO|UPDATE)\s+(jobs|attempts|nodes|events|spend|meta)\b")


class _Row(dict):
    """A result row as ``sqlite3.Row`` is used: by column name and by position."""

    def __getitem__(self, k: Any) -> Any:
        return list(self.values())[k] if isinstance(k, int) else super().__getitem__(k)


class _Result:
    def __init__(self, rows: list[_Row], lastrowid: int | None = None) -> None:
        self.rows, self.lastrowid = rows, lastrowid

    def fetchone(self) -> _Row | None:
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list[_Row]:
        return self.rows


class _Conn:
    """What ``StateStore``'s methods call ``c.execute(sql, args)`` on, over one SQLAlchemy connection."""

    def __init__(self, conn: Any, pg: bool) -> None:
        self.conn, self.pg = conn, pg

    def execute(self, sql: str, args: Iterable[Any] = ()) -> _Result:
        stmt, params, returning = translate(sql, args, self.pg)
        res = self.conn.execute(text(stmt), params)
        if returning:
            return _Result([], int(res.scalar_one()))
        if not res.returns_rows:
            return _Result([])
        return _Result([_Row(m) for m in res.mappings().all()])


def translate(sql: str, args: Iterable[Any], pg: bool) -> tuple[str, dict[str, Any], bool]:
    """One ``StateStore`` statement as ``text()`` SQL for the ``ctl_*`` tables, its binds, and
    whether it returns the new row's id."""
    sql = _TABLE.sub(lambda m: f"{m[1]} ctl_{m[2]}", sql)
    if pg and sql.startswith("INSERT OR IGNORE"):
        sql = "INSERT" + sql[len("INSERT OR IGNORE"):] + " ON CONFLICT DO NOTHING"
    returning = sql.startswith("INSERT INTO ctl_nodes")
    if returning:
        sql += " RETURNING id"
    vals = [int(v) if isinstance(v, bool) else v for v in args]
    parts = sql.split("?")
    if len(parts) - 1 != len(vals):
        raise ValueError(f"{len(parts) - 1} placeholders, {len(vals)} values: {sql}")
    out = parts[0] + "".join(f":p{i}{p}" for i, p in enumerate(parts[1:]))
    return out, {f"p{i}": v for i, v in enumerate(vals)}, returning


class CtlStore(StateStore):
    """``StateStore`` over the server database's ``ctl_*`` tables (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.path = f"{engine.url.render_as_string(hide_password=True)} (ctl_* tables)"
        self._pg = engine.dialect.name == "postgresql"
        self._FOR_UPDATE = " FOR UPDATE" if self._pg else ""
        self._lock = threading.RLock()
        insp = inspect(engine)
        self._cols = {t: {c["name"] for c in insp.get_columns(f"ctl_{t}")} if insp.has_table(f"ctl_{t}") else set()
                      for t in ("jobs", "attempts", "nodes")}
        if not self._cols["jobs"]:
            raise StateStoreError(f"the server database {self.path} has no ctl_jobs table: "
                                  f"run `dtrun server migrate` (or start `dtrun server`, which migrates)")

    class _CtlTx:
        def __init__(self, store: "CtlStore") -> None:
            self.s = store

        def __enter__(self) -> _Conn:
            self.s._lock.acquire()
            try:
                self.cm = self.s.engine.begin()
                return _Conn(self.cm.__enter__(), self.s._pg)
            except BaseException:
                self.s._lock.release()
                raise

        def __exit__(self, et, ev, tb) -> None:
            try:
                self.cm.__exit__(et, ev, tb)
            finally:
                self.s._lock.release()

    def _write(self) -> "CtlStore._CtlTx":  # type: ignore[override]
        return CtlStore._CtlTx(self)

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[dict]:
        with self._write() as c:  # one short transaction: reads a committed snapshot
            return [dict(r) for r in c.execute(sql, args).fetchall()]

    def close(self) -> None:
        """Nothing to close: the engine is the server's."""

    def claim_controller(self, name: str, pid: int | None = None, host: str = HOST,
                         log: str | None = None) -> bool:
        return super().claim_controller(name, pid, host if host.startswith(SERVER_HOST) else SERVER_HOST + host, log)

    def adopt(self, name: str, pid: int | None = None) -> None:
        """Record this replica as the job's controller, whoever was recorded before (the caller
        holds the job's lease: the previous owner's lease expired)."""
        with self._write() as c:
            c.execute("UPDATE jobs SET controller_pid=?, controller_host=?, controller_seen=? WHERE name=?",
                      (os.getpid() if pid is None else pid, SERVER_HOST + HOST, time.time(), name))

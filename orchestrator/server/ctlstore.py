"""The controllers' state store in the server database: :class:`CtlStore` is a
``orchestrator.run.state.StateStore`` (same methods, same queries, same return shapes) whose rows
live in the ``ctl_*`` tables of the server's database (``orchestrator.server.ctlschema``, migration
0003) over the server's SQLAlchemy engine (``orchestrator.server.db.make_engine``: SQLite or
PostgreSQL). Every replica of ``dtrun server``, on any machine, opens one over the same database,
so a replica adopting a job finds the attempts, nodes (provider handles), events and spend rows
the previous owner recorded: it re-attaches instead of launching again, and books on from the
spend row's ``billed_until`` (no gap, no double count). The embedded CLI keeps its SQLite file.

Sharing the SQL. ``StateStore``'s methods run unchanged: their connection is :class:`_Conn`, which
runs each statement on the store's own SQLAlchemy connection (``exec_driver_sql``) — table names
prefixed ``ctl_``, ``?`` as the driver's placeholder; on PostgreSQL ``INSERT OR IGNORE`` becomes ``INSERT ... ON CONFLICT DO NOTHING`` and
an insert that needs its new id says ``RETURNING id``.

Locking under several replicas. Each write is one transaction on the store's connection (on
PostgreSQL a write of one statement is sent alone in autocommit: atomic, one round trip; see
:class:`_Conn`; ``book_spend`` is one statement there, its read under ``FOR UPDATE``). Where the
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

import contextlib
import os
import re
import threading
import time
from typing import Any, Iterable

from sqlalchemy import inspect
from sqlalchemy.engine import Engine

from orchestrator.run.state import HOST, StateStore, StateStoreError

SERVER_HOST = "server:"
"""Prefix of ``controller_host`` for a controller run by a server replica."""

_TABLE = re.compile(r"\b(FROM|INTO|UPDATE)\s+(jobs|attempts|nodes|events|spend|meta)\b")


def _tables(sql: str) -> frozenset[str]:
    return frozenset(m[2] for m in _TABLE.finditer(sql))


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
    """What ``StateStore``'s methods call ``c.execute(sql, args)`` on, over one SQLAlchemy connection.

    ``lazy`` (PostgreSQL writes): the transaction is begun only when needed. A write statement that
    comes first is held, not sent; a second statement (or one whose result is needed: a read, an
    insert returning its id) begins the transaction on ``conn`` and sends the held one first. A
    write transaction of that one statement alone is sent at the end by :meth:`finish` on the
    autocommit connection: one round trip, not BEGIN + statement + COMMIT — one statement is atomic
    on its own. An exception inside the ``with`` drops the held statement (the rollback)."""

    def __init__(self, conn: Any, pg: bool, lazy: Any = None) -> None:
        self.conn, self.pg = conn, pg
        self.wrote: set[str] = set()  # tables this transaction wrote (the read cache forgets them)
        self.lazy = lazy  # () -> (write connection, autocommit connection), when the transaction is begun lazily
        self.held: tuple | None = None
        self.tx: Any = None

    def execute(self, sql: str, args: Iterable[Any] = ()) -> _Result:
        if not sql.startswith("SELECT"):
            self.wrote |= _tables(sql)
        stmt, params, returning = translate(sql, args, self.pg)
        if self.lazy is not None and self.tx is None:
            if self.held is None and not returning and not sql.startswith("SELECT"):
                self.held = (stmt, params)
                return _Result([])
            self.conn = self.lazy()[0]
            self.tx = self.conn.begin()
            if self.held is not None:
                self.conn.exec_driver_sql(*self.held)
                self.held = None
        return self._run(self.conn, stmt, params, returning)

    @staticmethod
    def _run(conn: Any, stmt: str, params: tuple, returning: bool) -> _Result:
        res = conn.exec_driver_sql(stmt, params)
        if returning:
            return _Result([], int(res.scalar_one()))
        if not res.returns_rows:
            return _Result([])
        return _Result([_Row(m) for m in res.mappings().all()])

    def finish(self) -> None:
        """The held statement alone (no transaction was begun): sent now, in autocommit."""
        if self.held is not None:
            held, self.held = self.held, None
            self.lazy()[1].exec_driver_sql(*held)


def translate(sql: str, args: Iterable[Any], pg: bool) -> tuple[str, tuple, bool]:
    """One ``StateStore`` statement as the driver's SQL for the ``ctl_*`` tables, its values, and
    whether it returns the new row's id."""
    sql = _TABLE.sub(lambda m: f"{m[1]} ctl_{m[2]}", sql)
    if pg and sql.startswith("INSERT OR IGNORE"):
        sql = "INSERT" + sql[len("INSERT OR IGNORE"):] + " ON CONFLICT DO NOTHING"
    returning = sql.startswith("INSERT INTO ctl_nodes")
    if returning:
        sql += " RETURNING id"
    vals = tuple(int(v) if isinstance(v, bool) else v for v in args)
    if sql.count("?") != len(vals) or "%" in sql:
        raise ValueError(f"{sql.count('?')} placeholders, {len(vals)} values: {sql}")
    return (sql.replace("?", "%s") if pg else sql), vals, returning


class CtlStore(StateStore):
    """``StateStore`` over the server database's ``ctl_*`` tables (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.path = f"{engine.url.render_as_string(hide_password=True)} (ctl_* tables)"
        self._pg = engine.dialect.name == "postgresql"
        self._FOR_UPDATE = " FOR UPDATE" if self._pg else ""
        self._lock = threading.RLock()
        self._memo: dict[tuple, list[dict]] | None = None
        self._touched: dict[str, float] = {}  # job → when this store last wrote its controller_seen
        insp = inspect(engine)
        self._cols = {t: {c["name"] for c in insp.get_columns(f"ctl_{t}")} if insp.has_table(f"ctl_{t}") else set()
                      for t in ("jobs", "attempts", "nodes")}
        if not self._cols["jobs"]:
            raise StateStoreError(f"the server database {self.path} has no ctl_jobs table: "
                                  f"run `dtrun server migrate` (or start `dtrun server`, which migrates)")

    def _connection(self, reads: bool = False) -> Any:
        """The store's own connection (held: no pool checkout per statement), made again after an
        error; on PostgreSQL reads use a second one in autocommit (one round trip, no BEGIN)."""
        key = "_rc" if reads and self._pg else "_wc"
        conn = getattr(self, key, None)
        if conn is None or conn.closed or conn.invalidated:
            conn = self.engine.connect()
            if key == "_rc":
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            setattr(self, key, conn)
        return conn

    def _drop(self) -> None:
        for key in ("_rc", "_wc"):
            conn = getattr(self, key, None)
            setattr(self, key, None)
            if conn is not None:
                try:
                    conn.close()
                except Exception:  # already broken: nothing to give back
                    pass

    class _CtlTx:
        def __init__(self, store: "CtlStore") -> None:
            self.s = store

        def __enter__(self) -> _Conn:
            self.s._lock.acquire()
            try:
                if self.s._pg:  # begun lazily (see _Conn): a lone write is one autocommit round trip
                    self.c = _Conn(None, True, lazy=lambda: (self.s._connection(), self.s._connection(reads=True)))
                else:
                    conn = self.s._connection()
                    self.c = _Conn(conn, False)
                    self.c.tx = conn.begin()
                return self.c
            except BaseException:
                self.s._drop()
                self.s._lock.release()
                raise

        def __exit__(self, et, ev, tb) -> None:
            try:
                if et is None:
                    self.c.finish()
                    if self.c.tx is not None:
                        self.c.tx.commit()
                elif self.c.tx is not None:
                    self.c.tx.rollback()
            except BaseException:
                self.s._drop()
                raise
            finally:
                self.s._forget(self.c.wrote)
                self.s._lock.release()

    def _write(self) -> "CtlStore._CtlTx":  # type: ignore[override]
        return CtlStore._CtlTx(self)

    @contextlib.contextmanager
    def one_tick(self) -> Any:
        """Inside: a read repeated with no write to its tables in between is answered from memory
        (one job's tick reads its row ~7 times). Only for one replica's tick of a job it holds the
        lease of: no one else writes that job's rows meanwhile."""
        with self._lock:
            self._memo = {}
        try:
            yield self
        finally:
            with self._lock:
                self._memo = None

    def _forget(self, tables: set[str]) -> None:
        if self._memo and tables:
            for key in [k for k in self._memo if k[2] & tables]:
                del self._memo[key]

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[dict]:
        with self._lock:
            if self._memo is None:
                return self._query(sql, args)
            key = (sql, tuple(args), _tables(sql))
            if key not in self._memo:
                self._memo[key] = self._query(sql, args)
            return [dict(r) for r in self._memo[key]]  # copies: callers pop and add keys

    def _query(self, sql: str, args: Iterable[Any]) -> list[dict]:
        if not self._pg:  # SQLite: a short transaction like a write (the engine begins IMMEDIATE)
            with self._write() as c:
                return [dict(r) for r in c.execute(sql, args).fetchall()]
        with self._lock:
            try:
                return [dict(r) for r in _Conn(self._connection(reads=True), True).execute(sql, args).fetchall()]
            except BaseException:
                self._drop()
                raise

    def close(self) -> None:
        """Give the store's connections back (the engine is the server's: left open)."""
        with self._lock:
            self._drop()

    TOUCH_EVERY_S = 30.0
    """``touch_controller`` writes ``controller_seen`` at most this often per job (a quarter of the
    120 s in which ``controller_alive`` judges a server replica's controller alive): the controller
    touches every tick (5 s), most of those writes changed nothing anyone reads."""

    def touch_controller(self, name: str) -> None:
        now = time.time()
        if now - self._touched.get(name, float("-inf")) < self.TOUCH_EVERY_S:
            return
        super().touch_controller(name)
        self._touched[name] = now

    def pop_action(self, name: str) -> str | None:
        """As ``StateStore.pop_action``, but the row is read first without a lock (within a tick:
        from memory): nothing requested, nothing to take — no locking transaction. A request
        that lands after the read is in the row still: taken at the next tick."""
        if (self.get_job(name) or {}).get("requested_action") is None:
            return None
        return super().pop_action(name)

    _BOOK_PG = (
        "WITH old AS (SELECT price_per_hour, billed_until, closed FROM ctl_spend WHERE job=%s AND attempt=%s "
        "FOR UPDATE) "
        "UPDATE ctl_spend AS s SET billed_until=GREATEST(%s::float8, old.billed_until), "
        "seconds=s.seconds+GREATEST(0.0::float8, %s::float8-old.billed_until), "
        "usd=s.usd+old.price_per_hour*GREATEST(0.0::float8, %s::float8-old.billed_until)/3600.0::float8, closed=%s "
        "FROM old WHERE s.job=%s AND s.attempt=%s AND (old.closed=0 OR %s) "
        "RETURNING old.price_per_hour*GREATEST(0.0::float8, %s::float8-old.billed_until)/3600.0::float8 AS usd")

    def book_spend(self, job: str, attempt: int, until: float, close: bool = False,
                   reopen: bool = False) -> float:
        """As ``StateStore.book_spend`` (same arithmetic: ``price * max(0, until - billed_until) /
        3600`` in double precision, from the row's ``billed_until`` read under its row lock), on
        PostgreSQL in one statement — the row is locked by the statement's ``FOR UPDATE``, so two
        replicas' bookings serialize and the second books only past the first's ``billed_until``:
        one round trip instead of four (BEGIN, SELECT ... FOR UPDATE, UPDATE, COMMIT)."""
        if not self._pg:
            return super().book_spend(job, attempt, until, close, reopen)
        u = float(until)
        with self._lock:
            try:
                conn = self._connection(reads=True)  # autocommit: the statement is its own transaction
                row = conn.exec_driver_sql(self._BOOK_PG, (job, attempt, u, u, u, 1 if close else 0, job, attempt,
                                                           bool(reopen), u)).fetchone()
            except BaseException:
                self._drop()
                raise
            finally:
                self._forget({"spend"})
        return float(row[0]) if row is not None else 0.0

    def spend_total(self, job: str) -> float:
        """The sum of the job's spend rows' ``usd`` (in attempt order), from the same read as
        :meth:`spend_by_attempt`: within a tick one query answers both and :meth:`open_spend_rows`."""
        return float(sum(r["usd"] for r in self.spend_by_attempt(job)))

    def open_spend_rows(self, job: str) -> list[dict]:
        return [r for r in self.spend_by_attempt(job) if not r["closed"]]

    def claim_controller(self, name: str, pid: int | None = None, host: str = HOST,
                         log: str | None = None) -> bool:
        ok = super().claim_controller(name, pid, host if host.startswith(SERVER_HOST) else SERVER_HOST + host, log)
        if ok:
            self._touched[name] = time.time()
        return ok

    def release_controller(self, name: str, pid: int | None = None) -> None:
        self._touched.pop(name, None)
        super().release_controller(name, pid)

    def adopt(self, name: str, pid: int | None = None) -> None:
        """Record this replica as the job's controller, whoever was recorded before (the caller
        holds the job's lease: the previous owner's lease expired)."""
        with self._write() as c:
            c.execute("UPDATE jobs SET controller_pid=?, controller_host=?, controller_seen=? WHERE name=?",
                      (os.getpid() if pid is None else pid, SERVER_HOST + HOST, time.time(), name))
        self._touched[name] = time.time()

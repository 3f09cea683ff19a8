"""The state store: every job's state, attempts, nodes, events and spend, in one SQLite file
(``orchestrator.run.statedb``: where it lives, its tables, opening it). Every write is one short
``BEGIN IMMEDIATE`` transaction, so several processes (a controller, ``dtrun status``, ``dtrun
down``) may use it at once. Nothing secret is ever stored here: no provider keys, no AWS keys,
no node env.

API (what other modules use; every method is safe to call from several processes)
---------------------------------------------------------------------------------
``StateStore(path=None)``                    open (create) the store; ``path=":memory:"`` for tests
``create_job(name, spec_yaml, run_uri, …)``  insert or reset a job row (returns the row)
``get_job(name) -> dict | None``; ``list_jobs() -> list[dict]``; ``update_job(name, **cols)``
``set_state(name, state, reason=None, t=None)`` commit a transition (+ a ``state`` event)
``request_action(name, action)``; ``pop_action(name)``
``claim_controller(name, pid, host) -> bool``; ``touch_controller(name)``; ``release_controller(name)``;
``controller_alive(job_row) -> bool``
``new_attempt(job, n, offer: dict, provider, t)``; ``update_attempt(job, n, **cols)``;
``attempts(job) -> list[dict]``; ``get_attempt(job, n)``
``add_node(job, attempt, handle: dict, t) -> id``; ``update_node(id, **cols)``;
``nodes(job, live_only=False)``; ``live_nodes()`` (every job: not confirmed terminated)
``add_event(job, type, message, data=None, t=None)``; ``events(job, after_id=0, limit=None)``
``book_spend(job, attempt, price_per_hour, until)`` (books from the attempt's billed_until);
``spend_total(job) -> float``; ``spend_by_attempt(job) -> list[dict]``
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable

# dtrun_home: where dtrun keeps its files; many callers import it from here
from orchestrator.run.statedb import StateStoreError, columns, connect, default_path, dtrun_home  # noqa: F401
from orchestrator.run.statedb import owner_id as _owner_id

ACTIVE_STATES = ("PENDING", "PROVISIONING", "RUNNING", "RECOVERING", "STOPPING")
TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED", "OVER_BUDGET")
STATES = ACTIVE_STATES + TERMINAL_STATES

_JOB_COLS: set[str] = set()
_ATTEMPT_COLS: set[str] = set()
_NODE_COLS: set[str] = set()


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours counts as dead.
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":
                return False
    except OSError:
        pass
    return True


HOST = socket.gethostname()


class StateStore:
    """SQLite-backed job state (see the module docstring for the API)."""

    _FOR_UPDATE = ""
    """Appended to a read inside a write transaction (``BEGIN IMMEDIATE`` already holds the file's
    write lock; ``orchestrator.server.ctlstore`` sets `` FOR UPDATE``: a row lock)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = str(path) if path is not None else str(default_path())
        try:
            self._open()
        except (sqlite3.DatabaseError, OSError) as e:
            raise StateStoreError(
                f"cannot open the state store {self.path}: {type(e).__name__}: {e} "
                f"(move it aside to start afresh, or set DTRUN_HOME to another directory; "
                f"jobs recorded in it are then unknown to dtrun — `dtrun gc` finds their instances)") from None

    def _open(self) -> None:
        self._lock = threading.RLock()
        self._conn = connect(self.path)
        global _JOB_COLS, _ATTEMPT_COLS, _NODE_COLS
        if not _JOB_COLS:
            _JOB_COLS = columns(self._conn, "jobs")
            _ATTEMPT_COLS = columns(self._conn, "attempts")
            _NODE_COLS = columns(self._conn, "nodes")
        self._cols = {"jobs": _JOB_COLS, "attempts": _ATTEMPT_COLS, "nodes": _NODE_COLS}

    # ---- plumbing ------------------------------------------------------------------------
    class _Tx:
        def __init__(self, store: "StateStore") -> None:
            self.s = store

        def __enter__(self) -> sqlite3.Connection:
            self.s._lock.acquire()
            try:
                self.s._conn.execute("BEGIN IMMEDIATE")
            except BaseException:
                self.s._lock.release()
                raise
            return self.s._conn

        def __exit__(self, et, ev, tb) -> None:
            try:
                self.s._conn.execute("COMMIT" if et is None else "ROLLBACK")
            finally:
                self.s._lock.release()

    def _write(self) -> "StateStore._Tx":
        return StateStore._Tx(self)

    def _read(self, sql: str, args: Iterable[Any] = ()) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._conn.execute(sql, tuple(args)).fetchall()]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @property
    def owner_id(self) -> str:
        """This store's stable owner id (made once, kept in the store): every node it launches
        carries it, and its orphan sweep touches only instances that carry it."""
        if getattr(self, "_owner", None) is None:
            with self._write() as conn:
                self._owner = _owner_id(conn)
        return self._owner

    @staticmethod
    def _sets(cols: dict[str, Any], allowed: set[str]) -> tuple[str, list[Any]]:
        bad = set(cols) - allowed
        if bad:
            raise KeyError(f"unknown column(s): {', '.join(sorted(bad))}")
        return ", ".join(f"{k}=?" for k in cols), list(cols.values())

    # ---- jobs ----------------------------------------------------------------------------
    def create_job(self, name: str, spec_yaml: str, run_uri: str, *, spec_path: str | None = None,
                   providers: list[str] | None = None, budget_usd: float | None = None,
                   steps: int | None = None, estimate: dict | None = None, t: float | None = None) -> dict:
        """Insert the job, or reset an existing (finished) row for a new session keeping its
        attempts, spend and events (attempt numbers continue)."""
        t = time.time() if t is None else t
        with self._write() as c:
            row = c.execute("SELECT name FROM jobs WHERE name=?" + self._FOR_UPDATE, (name,)).fetchone()
            nxt = (c.execute("SELECT COALESCE(MAX(n), 0) FROM attempts WHERE job=?", (name,)).fetchone()[0]) + 1
            vals = dict(state="PENDING", reason=None, spec_yaml=spec_yaml, spec_path=spec_path, run_uri=run_uri,
                        providers=json.dumps(providers or []), updated=t, finished_at=None, deadline=None,
                        steps=steps, estimate_json=json.dumps(estimate) if estimate is not None else None,
                        budget_usd=budget_usd, session_first_attempt=nxt, restarts_used=0, stop_target=None,
                        stop_reason=None, stop_started=None, stop_now=0, requested_action=None, started_at=None)
            if row is None:
                vals.update(name=name, created=t)
                cols = ", ".join(vals)
                c.execute(f"INSERT INTO jobs ({cols}) VALUES ({', '.join('?' * len(vals))})", list(vals.values()))
            else:
                sets, args = self._sets(vals, self._cols["jobs"])
                c.execute(f"UPDATE jobs SET {sets} WHERE name=?", args + [name])
        return self.get_job(name)  # type: ignore[return-value]

    def get_job(self, name: str) -> dict | None:
        rows = self._read("SELECT * FROM jobs WHERE name=?", (name,))
        return rows[0] if rows else None

    def list_jobs(self) -> list[dict]:
        return self._read("SELECT * FROM jobs ORDER BY created")

    def update_job(self, name: str, **cols: Any) -> None:
        if not cols:
            return
        cols.setdefault("updated", time.time())
        sets, args = self._sets(cols, self._cols["jobs"])
        with self._write() as c:
            c.execute(f"UPDATE jobs SET {sets} WHERE name=?", args + [name])

    def set_state(self, name: str, state: str, reason: str | None = None, t: float | None = None,
                  **cols: Any) -> None:
        """Commit a transition (and an event) before the caller acts on it."""
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        t = time.time() if t is None else t
        cols.update(state=state, reason=reason, updated=t)
        if state in TERMINAL_STATES:
            cols.setdefault("finished_at", t)
        sets, args = self._sets(cols, self._cols["jobs"])
        msg = state + (f": {reason}" if reason else "")
        with self._write() as c:
            c.execute(f"UPDATE jobs SET {sets} WHERE name=?", args + [name])
            c.execute("INSERT INTO events (job, time, type, message, data_json) VALUES (?,?,?,?,?)",
                      (name, t, "state", msg, json.dumps({"state": state})))

    def request_action(self, name: str, action: str) -> None:
        if action not in ("stop", "stop_now"):
            raise ValueError(action)
        with self._write() as c:
            cur = c.execute("SELECT requested_action FROM jobs WHERE name=?" + self._FOR_UPDATE, (name,)).fetchone()
            if cur is not None and cur[0] == "stop_now":
                return  # never downgrade --now to graceful
            c.execute("UPDATE jobs SET requested_action=? WHERE name=?", (action, name))

    def pop_action(self, name: str) -> str | None:
        with self._write() as c:
            row = c.execute("SELECT requested_action FROM jobs WHERE name=?" + self._FOR_UPDATE, (name,)).fetchone()
            if row is None or row[0] is None:
                return None
            c.execute("UPDATE jobs SET requested_action=NULL WHERE name=?", (name,))
            return row[0]

    # ---- controller ownership ----------------------------------------------------------------
    @staticmethod
    def controller_alive(job: dict | None) -> bool:
        """A controller process owns this job and is still alive (same host: pid check)."""
        if not job or not job.get("controller_pid"):
            return False
        if job.get("controller_host") != HOST:
            seen = job.get("controller_seen") or 0
            return time.time() - seen < 120
        return pid_alive(job["controller_pid"])

    def claim_controller(self, name: str, pid: int | None = None, host: str = HOST,
                         log: str | None = None) -> bool:
        """Become the job's controller; False if another live controller owns it."""
        pid = os.getpid() if pid is None else pid
        with self._write() as c:
            row = c.execute("SELECT controller_pid, controller_host, controller_seen FROM jobs WHERE name=?"
                            + self._FOR_UPDATE, (name,)).fetchone()
            if row is None:
                return False
            cur = dict(row)
            if cur["controller_pid"] and cur["controller_pid"] != pid and self.controller_alive(cur):
                return False
            c.execute("UPDATE jobs SET controller_pid=?, controller_host=?, controller_seen=?, controller_log=? "
                      "WHERE name=?", (pid, host, time.time(), log, name))
            return True

    def touch_controller(self, name: str) -> None:
        with self._write() as c:
            c.execute("UPDATE jobs SET controller_seen=? WHERE name=? AND controller_pid=?",
                      (time.time(), name, os.getpid()))

    def release_controller(self, name: str, pid: int | None = None) -> None:
        pid = os.getpid() if pid is None else pid
        with self._write() as c:
            c.execute("UPDATE jobs SET controller_pid=NULL, controller_host=NULL WHERE name=? AND controller_pid=?",
                      (name, pid))

    # ---- attempts --------------------------------------------------------------------------
    def new_attempt(self, job: str, n: int, offer: dict, provider: str, t: float,
                    start_step: int | None = None, log_path: str | None = None) -> None:
        with self._write() as c:
            c.execute("INSERT INTO attempts (job, n, provider, offer_json, state, created, start_step, log_path) "
                      "VALUES (?,?,?,?,?,?,?,?)",
                      (job, n, provider, json.dumps(offer), "LAUNCHING", t, start_step, log_path))

    def update_attempt(self, job: str, n: int, **cols: Any) -> None:
        if not cols:
            return
        sets, args = self._sets(cols, self._cols["attempts"])
        with self._write() as c:
            c.execute(f"UPDATE attempts SET {sets} WHERE job=? AND n=?", args + [job, n])

    def attempts(self, job: str) -> list[dict]:
        rows = self._read("SELECT * FROM attempts WHERE job=? ORDER BY n", (job,))
        for r in rows:
            r["offer"] = json.loads(r.pop("offer_json"))
            r["cluster"] = json.loads(r.pop("nodes_json", None) or "[]")
        return rows

    def get_attempt(self, job: str, n: int) -> dict | None:
        rows = [a for a in self.attempts(job) if a["n"] == n]
        return rows[0] if rows else None

    def last_attempt_number(self, job: str) -> int:
        return self._read("SELECT COALESCE(MAX(n), 0) AS m FROM attempts WHERE job=?", (job,))[0]["m"]

    # ---- nodes -----------------------------------------------------------------------------
    def add_node(self, job: str, attempt: int, handle: dict, t: float, state: str = "PENDING") -> int:
        with self._write() as c:
            cur = c.execute(
                "INSERT INTO nodes (job, attempt, provider, name, instance_id, region, handle_json, state, created) "
                "VALUES (?,?,?,?,?,?,?,?,?)",
                (job, attempt, handle.get("provider", ""), handle.get("name", ""), str(handle.get("instance_id", "")),
                 handle.get("region", ""), json.dumps(handle), state, t))
            return int(cur.lastrowid)

    def update_node(self, node_id: int, **cols: Any) -> None:
        if not cols:
            return
        sets, args = self._sets(cols, self._cols["nodes"])
        with self._write() as c:
            c.execute(f"UPDATE nodes SET {sets} WHERE id=?", args + [node_id])

    @staticmethod
    def _node(r: dict) -> dict:
        r["handle"] = json.loads(r.pop("handle_json"))
        return r

    def nodes(self, job: str, live_only: bool = False) -> list[dict]:
        q = "SELECT * FROM nodes WHERE job=?" + (" AND terminated_at IS NULL" if live_only else "") + " ORDER BY id"
        return [self._node(r) for r in self._read(q, (job,))]

    def live_nodes(self) -> list[dict]:
        """Every node of every job not yet confirmed terminated."""
        return [self._node(r) for r in self._read("SELECT * FROM nodes WHERE terminated_at IS NULL ORDER BY id")]

    # ---- events ----------------------------------------------------------------------------
    def add_event(self, job: str, type_: str, message: str, data: dict | None = None,
                  t: float | None = None) -> None:
        t = time.time() if t is None else t
        with self._write() as c:
            c.execute("INSERT INTO events (job, time, type, message, data_json) VALUES (?,?,?,?,?)",
                      (job, t, type_, message, json.dumps(data) if data is not None else None))

    def events(self, job: str, after_id: int = 0, limit: int | None = None) -> list[dict]:
        q = "SELECT * FROM events WHERE job=? AND id>? ORDER BY id"
        args: list[Any] = [job, after_id]
        if limit:  # the newest ``limit`` events, oldest first
            q = "SELECT * FROM (SELECT * FROM events WHERE job=? AND id>? ORDER BY id DESC LIMIT ?) AS e ORDER BY id"
            args.append(limit)
        rows = self._read(q, args)
        for r in rows:
            r["data"] = json.loads(r.pop("data_json")) if r.get("data_json") else None
        return rows

    # ---- spend -----------------------------------------------------------------------------
    def open_spend(self, job: str, attempt: int, price_per_hour: float, t: float) -> None:
        """Start billing an attempt at ``t`` (its launch request: provisioning is paid)."""
        with self._write() as c:
            c.execute("INSERT OR IGNORE INTO spend (job, attempt, price_per_hour, billed_from, billed_until) "
                      "VALUES (?,?,?,?,?)", (job, attempt, price_per_hour, t, t))

    def book_spend(self, job: str, attempt: int, until: float, close: bool = False,
                   reopen: bool = False) -> float:
        """Book the attempt's spend up to ``until``; returns the USD added. ``close`` stops billing.
        A closed row books nothing more unless ``reopen`` (an instance of the attempt turned out to
        bill past the row's end — an abandoned launch's late instance, an orphan the sweep found):
        then it books on from where it ended."""
        with self._write() as c:
            row = c.execute("SELECT price_per_hour, billed_until, closed FROM spend WHERE job=? AND attempt=?"
                            + self._FOR_UPDATE, (job, attempt)).fetchone()
            if row is None or (row["closed"] and not reopen):
                return 0.0
            dt = max(0.0, until - row["billed_until"])
            usd = row["price_per_hour"] * dt / 3600.0
            c.execute("UPDATE spend SET billed_until=?, seconds=seconds+?, usd=usd+?, closed=? WHERE job=? AND attempt=?",
                      (max(until, row["billed_until"]), dt, usd, 1 if close else 0, job, attempt))
            return usd

    def spend_total(self, job: str) -> float:
        return float(self._read("SELECT COALESCE(SUM(usd), 0) AS s FROM spend WHERE job=?", (job,))[0]["s"])

    def spend_by_attempt(self, job: str) -> list[dict]:
        return self._read("SELECT * FROM spend WHERE job=? ORDER BY attempt", (job,))

    def open_spend_rows(self, job: str) -> list[dict]:
        return self._read("SELECT * FROM spend WHERE job=? AND closed=0 ORDER BY attempt", (job,))

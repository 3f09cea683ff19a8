"""The state store's SQLite file: where it lives (``$DTRUN_HOME/state.db``, default ``~/.dtrun``),
its tables, and opening it — created mode 0600 in a 0700 home, WAL journal so a CLI
(``dtrun status``) can read while a controller writes, ``busy_timeout`` so two writers wait for
each other, and the columns added since a store was first created (``ALTER TABLE`` once; older
stores keep working). The queries are ``orchestrator.run.state.StateStore``'s.

Tables
------
``jobs``      one row per job name: state, reason, the resolved spec (YAML), run URI, progress
              (step, steps, loss, tokens/s, last committed step), steps lost to preemptions, the
              plan's estimate, the controller owning it (pid, host, last seen) and a
              ``requested_action`` (``stop`` | ``stop_now``) that ``dtrun down`` writes and the
              controller reads each tick.
``attempts``  one row per launch (job, n): offer, provider, state, outcome, reason, times, the step it
              started from and the step it reached; for several nodes, ``cluster``: each node's
              record from the run URI (rank, private IP, host, state, exit code; ``nodes_json``).
``nodes``     one row per launched instance: the provider ``Handle`` (JSON; local: pid, pgid,
              log path), state, and ``terminated_at`` — set only once the provider confirmed it gone.
``events``    timestamped, typed log lines per job (``state``, ``launch``, ``preempted``, …).
``spend``     one row per attempt: price per hour actually rented, seconds billed, USD booked,
              billed from/until. Provisioning time is included (billing starts at launch).
``meta``      key/value facts about the store itself: ``owner_id``, generated once when first asked
              (``owner_id()``), which every node this store launches carries (``LaunchRequest.owner``)
              so the orphan sweep tells this store's instances from another's on a shared account.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from orchestrator.contract.errors import EXIT_JOB_FAILED, DtrunError


def dtrun_home() -> Path:
    return Path(os.environ.get("DTRUN_HOME") or Path.home() / ".dtrun").expanduser()


def default_path() -> Path:
    return dtrun_home() / "state.db"


class StateStoreError(DtrunError):
    """The state store file cannot be opened or read (corrupt, not a file, no permission)."""

    exit_code = EXIT_JOB_FAILED


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    reason TEXT,
    spec_yaml TEXT NOT NULL,
    spec_path TEXT,
    run_uri TEXT NOT NULL,
    providers TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    deadline REAL,
    step INTEGER,
    steps INTEGER,
    loss REAL,
    tokens_per_s REAL,
    last_committed_step INTEGER,
    progress_time REAL,
    steps_lost INTEGER NOT NULL DEFAULT 0,
    estimate_json TEXT,
    budget_usd REAL,
    session_first_attempt INTEGER NOT NULL DEFAULT 1,
    restarts_used INTEGER NOT NULL DEFAULT 0,
    stop_target TEXT,
    stop_reason TEXT,
    stop_started REAL,
    stop_now INTEGER NOT NULL DEFAULT 0,
    requested_action TEXT,
    controller_pid INTEGER,
    controller_host TEXT,
    controller_seen REAL,
    controller_log TEXT
);
CREATE TABLE IF NOT EXISTS attempts (
    job TEXT NOT NULL,
    n INTEGER NOT NULL,
    provider TEXT NOT NULL,
    offer_json TEXT NOT NULL,
    state TEXT NOT NULL,
    outcome TEXT,
    reason TEXT,
    created REAL NOT NULL,
    launched_at REAL,
    running_at REAL,
    ended_at REAL,
    start_step INTEGER,
    end_step INTEGER,
    log_path TEXT,
    PRIMARY KEY (job, n)
);
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    provider TEXT NOT NULL,
    name TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    region TEXT,
    handle_json TEXT NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    terminate_requested REAL,
    terminated_at REAL
);
CREATE INDEX IF NOT EXISTS nodes_job ON nodes(job);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL,
    time REAL NOT NULL,
    type TEXT NOT NULL,
    message TEXT NOT NULL,
    data_json TEXT
);
CREATE INDEX IF NOT EXISTS events_job ON events(job, id);
CREATE TABLE IF NOT EXISTS spend (
    job TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    price_per_hour REAL NOT NULL,
    billed_from REAL NOT NULL,
    billed_until REAL NOT NULL,
    seconds REAL NOT NULL DEFAULT 0,
    usd REAL NOT NULL DEFAULT 0,
    closed INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job, attempt)
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""

_ADDED_COLS = {
    "jobs": (("val_loss", "REAL"),),  # newest validation loss (progress.json's val_loss)
    "attempts": (("nodes_json", "TEXT"),),  # multi-node: each node's record (rank, IP, state)
}


def connect(path: str) -> sqlite3.Connection:
    """Open (create) the store at ``path`` (``":memory:"`` for tests) with its tables and added
    columns; rows come back as ``sqlite3.Row``. Raises ``sqlite3.DatabaseError`` / ``OSError``."""
    if path != ":memory:":
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.parent == dtrun_home():
            try:
                os.chmod(p.parent, 0o700)
            except OSError:
                pass
        if not p.exists():
            fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o600)
            os.close(fd)
        os.chmod(p, 0o600)
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout=30000")
    if path != ":memory:":
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
    conn.executescript(_SCHEMA)  # commits on its own: outside an explicit transaction
    for table, added in _ADDED_COLS.items():
        have = columns(conn, table)
        for col, decl in added:
            if col not in have:
                try:
                    conn.execute(f"ALTER TABLE {table} ADD COLUMN {col} {decl}")
                except sqlite3.OperationalError:  # another process added it first
                    pass
    if path != ":memory:":
        for suffix in ("-wal", "-shm"):
            try:
                os.chmod(path + suffix, 0o600)
            except OSError:
                pass
    return conn


def owner_id(conn: sqlite3.Connection) -> str:
    """This store's owner id: 12 hex digits made the first time it is asked and kept in ``meta``
    (two processes asking at once get the same one: the first insert wins)."""
    import uuid

    conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('owner_id', ?)", (uuid.uuid4().hex[:12],))
    return str(conn.execute("SELECT value FROM meta WHERE key = 'owner_id'").fetchone()[0])


def columns(conn: sqlite3.Connection, table: str) -> set[str]:
    """The column names of ``table`` as the file has them."""
    return {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}

"""The SQLite state store: permissions, WAL, sessions, actions, ownership, spend, and two processes
at once (a CLI reading while a controller writes; two writers)."""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import stat
import subprocess
import sys

import pytest

from orchestrator.run.state import StateStore


def test_file_is_private_and_wal(dtrun_home):
    s = StateStore()
    s.create_job("j1", "name: j1\n", "file:///tmp/x")
    path = dtrun_home / "state.db"
    assert s.path == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for extra in ("-wal", "-shm"):
        if os.path.exists(str(path) + extra):
            assert stat.S_IMODE(os.stat(str(path) + extra).st_mode) & 0o077 == 0
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_new_session_keeps_history_and_attempt_numbers(tmp_path):
    s = StateStore(tmp_path / "s.db")
    s.create_job("j", "y", "file:///r", t=1.0)
    s.new_attempt("j", 1, {"provider": "fake"}, "fake", 1.0)
    s.new_attempt("j", 2, {"provider": "fake"}, "fake", 2.0)
    s.set_state("j", "FAILED", "boom", t=3.0)
    s.update_job("j", restarts_used=2)
    row = s.create_job("j", "y2", "file:///r", t=4.0)
    assert row["state"] == "PENDING" and row["session_first_attempt"] == 3 and row["restarts_used"] == 0
    assert row["created"] == 1.0 and row["finished_at"] is None
    assert [a["n"] for a in s.attempts("j")] == [1, 2]
    assert [e["message"] for e in s.events("j")] == ["FAILED: boom"]


def test_actions_never_downgrade_and_pop_once(tmp_path):
    s = StateStore(tmp_path / "s.db")
    s.create_job("j", "y", "u")
    s.request_action("j", "stop_now")
    s.request_action("j", "stop")
    assert s.pop_action("j") == "stop_now"
    assert s.pop_action("j") is None
    with pytest.raises(ValueError):
        s.request_action("j", "explode")


def test_controller_claim(tmp_path):
    s = StateStore(tmp_path / "s.db")
    s.create_job("j", "y", "u")
    assert s.claim_controller("j")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        s.update_job("j", controller_pid=other.pid)
        assert not s.claim_controller("j")           # a live process owns it
        assert StateStore.controller_alive(s.get_job("j"))
    finally:
        other.kill()
        other.wait()
    assert not StateStore.controller_alive(s.get_job("j"))
    assert s.claim_controller("j")                   # the owner died: take over
    s.release_controller("j")
    assert s.get_job("j")["controller_pid"] is None


def test_spend_booking_and_close(tmp_path):
    s = StateStore(tmp_path / "s.db")
    s.create_job("j", "y", "u")
    s.open_spend("j", 1, 3.6, t=100.0)
    assert s.book_spend("j", 1, 200.0) == pytest.approx(0.1)
    assert s.book_spend("j", 1, 150.0) == 0.0          # time never runs backwards
    s.book_spend("j", 1, 300.0, close=True)
    assert s.book_spend("j", 1, 10_000.0) == 0.0       # closed: nothing more is billed
    assert s.spend_total("j") == pytest.approx(0.2)
    assert s.spend_by_attempt("j")[0]["seconds"] == pytest.approx(200.0)
    with pytest.raises(KeyError):
        s.update_job("j", no_such_column=1)


def _writer(path: str, name: str, n: int) -> None:
    s = StateStore(path)
    for i in range(n):
        s.set_state(name, "RUNNING", f"tick {i}", step=i)
        s.add_event(name, "tick", f"{os.getpid()} {i}")
        s.book_spend(name, 1, 1000.0 + i)


def test_two_processes_write_while_one_reads(tmp_path):
    path = str(tmp_path / "s.db")
    s = StateStore(path)
    s.create_job("j", "y", "u")
    s.open_spend("j", 1, 36.0, t=1000.0)
    ctx = mp.get_context("spawn")
    n = 150
    procs = [ctx.Process(target=_writer, args=(path, "j", n)) for _ in range(2)]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs):   # the CLI side: read while they write
        job = s.get_job("j")
        assert job is not None and job["state"] in ("PENDING", "RUNNING")
        s.events("j", limit=5)
        s.spend_total("j")
        reads += 1
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert reads > 0
    ticks = [e for e in s.events("j") if e["type"] == "tick"]
    assert len(ticks) == 2 * n
    assert s.spend_total("j") == pytest.approx(36.0 * (n - 1) / 3600.0)

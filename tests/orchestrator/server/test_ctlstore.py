"""The controllers' state store in the server database (``orchestrator.server.ctlstore.CtlStore``)
behaves as the SQLite ``StateStore`` does — the same checks run on the embedded file, on a SQLite
server database and on real PostgreSQL: attempt numbers across sessions, actions, spend booked
once, nodes, events — and two processes booking one attempt at once never double count."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from orchestrator.run.state import StateStore, StateStoreError
from orchestrator.server.ctlstore import SERVER_HOST, CtlStore
from orchestrator.server.db import make_engine
from orchestrator.server.migrate import upgrade


@pytest.fixture(params=["embedded", "sqlite", "postgresql"])
def store(request, tmp_path):
    """The embedded file, then a ``CtlStore`` on a SQLite server database and on PostgreSQL."""
    if request.param == "embedded":
        s = StateStore(tmp_path / "state.db")
        yield s
        s.close()
        return
    url = f"sqlite:///{tmp_path / 'server.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    engine = make_engine(url)
    upgrade(engine)
    yield CtlStore(engine)
    engine.dispose()


@pytest.fixture
def engine(db_url):
    e = make_engine(db_url)
    upgrade(e)
    yield e
    e.dispose()


def test_new_session_keeps_history_and_attempt_numbers(store):
    store.create_job("j", "y", "file:///r", t=1.0)
    store.new_attempt("j", 1, {"provider": "fake"}, "fake", 1.0)
    store.new_attempt("j", 2, {"provider": "fake"}, "fake", 2.0)
    store.set_state("j", "FAILED", "boom", t=3.0)
    store.update_job("j", restarts_used=2)
    row = store.create_job("j", "y2", "file:///r", t=4.0)
    assert row["state"] == "PENDING" and row["session_first_attempt"] == 3 and row["restarts_used"] == 0
    assert row["created"] == 1.0 and row["finished_at"] is None
    assert [a["n"] for a in store.attempts("j")] == [1, 2] and store.last_attempt_number("j") == 2
    assert store.get_attempt("j", 2)["offer"] == {"provider": "fake"} and store.get_attempt("j", 2)["cluster"] == []
    assert [e["message"] for e in store.events("j")] == ["FAILED: boom"]
    with pytest.raises(Exception):  # (job, n) is unique: an attempt is recorded once
        store.new_attempt("j", 2, {}, "fake", 5.0)
    assert [j["name"] for j in store.list_jobs()] == ["j"]


def test_actions_never_downgrade_and_pop_once(store):
    store.create_job("j", "y", "u")
    store.request_action("j", "stop_now")
    store.request_action("j", "stop")
    assert store.pop_action("j") == "stop_now"
    assert store.pop_action("j") is None
    with pytest.raises(ValueError):
        store.request_action("j", "explode")


def test_spend_booking_and_close(store):
    store.create_job("j", "y", "u")
    store.open_spend("j", 1, 3.6, t=100.0)
    store.open_spend("j", 1, 9.9, t=150.0)  # opened once: the second is ignored
    assert store.book_spend("j", 1, 200.0) == pytest.approx(0.1)
    assert store.book_spend("j", 1, 150.0) == 0.0          # time never runs backwards
    assert [r["attempt"] for r in store.open_spend_rows("j")] == [1]
    store.book_spend("j", 1, 300.0, close=True)
    assert store.book_spend("j", 1, 10_000.0) == 0.0       # closed: nothing more is billed
    assert store.open_spend_rows("j") == []
    assert store.book_spend("j", 1, 336.0, reopen=True) == pytest.approx(0.036)
    assert store.spend_total("j") == pytest.approx(0.236)
    assert store.spend_by_attempt("j")[0]["seconds"] == pytest.approx(236.0)
    with pytest.raises(KeyError):
        store.update_job("j", no_such_column=1)


def test_nodes_live_only_and_events_after_id(store):
    store.create_job("j", "y", "u")
    store.create_job("k", "y", "u")
    a = store.add_node("j", 1, {"provider": "fake", "name": "dtrun-j-a1", "instance_id": 7}, 1.0)
    b = store.add_node("j", 2, {"provider": "fake", "name": "dtrun-j-a2", "instance_id": 8}, 2.0, state="RUNNING")
    c = store.add_node("k", 1, {"provider": "fake", "name": "dtrun-k-a1", "instance_id": 9}, 3.0)
    assert a < b < c
    store.update_node(a, state="TERMINATED", terminated_at=5.0)
    assert [n["id"] for n in store.nodes("j")] == [a, b]
    live = store.nodes("j", live_only=True)
    assert [n["id"] for n in live] == [b] and live[0]["handle"]["instance_id"] == 8 and live[0]["instance_id"] == "8"
    assert [n["id"] for n in store.live_nodes()] == [b, c]
    for i in range(5):
        store.add_event("j", "tick", f"t{i}", {"i": i}, t=10.0 + i)
    store.add_event("k", "tick", "other job")
    evs = store.events("j")
    assert [e["message"] for e in evs] == [f"t{i}" for i in range(5)] and evs[2]["data"] == {"i": 2}
    assert [e["message"] for e in store.events("j", after_id=evs[2]["id"])] == ["t3", "t4"]
    assert [e["message"] for e in store.events("j", limit=2)] == ["t3", "t4"]


def _booker(url: str, n: int) -> None:
    engine = make_engine(url)
    s = CtlStore(engine)
    for i in range(n):  # both processes book the same times: only the first booking of each counts
        s.book_spend("j", 1, 1000.0 + i)
        s.add_event("j", "tick", f"{os.getpid()} {i}")
    engine.dispose()


def test_two_replica_processes_booking_one_attempt_never_double_count(engine, db_url):
    s = CtlStore(engine)
    s.create_job("j", "y", "u")
    s.open_spend("j", 1, 36.0, t=1000.0)
    n = 60
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_booker, args=(db_url, n)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert len(s.events("j")) == 2 * n
    assert s.spend_total("j") == pytest.approx(36.0 * (n - 1) / 3600.0)
    assert s.spend_by_attempt("j")[0]["billed_until"] == 1000.0 + n - 1


def test_one_owner_id_per_database_and_adopt(engine, db_url):
    other = make_engine(db_url)  # a second replica's engine ("another machine")
    try:
        a, b = CtlStore(engine), CtlStore(other)
        assert a.owner_id == b.owner_id and len(a.owner_id) == 12
        a.create_job("j", "y", "u")
        assert a.claim_controller("j", pid=111)
        row = b.get_job("j")
        assert row["controller_host"].startswith(SERVER_HOST) and StateStore.controller_alive(row)
        assert not b.claim_controller("j", pid=222)  # judged by its last touch, not by a pid here
        b.adopt("j", pid=222)  # b took the lease: the row is b's
        assert b.get_job("j")["controller_pid"] == 222 and b.claim_controller("j", pid=222)
    finally:
        other.dispose()


def test_an_unmigrated_database_says_how_to_fix_it(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'server.db'}")
    with pytest.raises(StateStoreError, match="dtrun server migrate"):
        CtlStore(engine)
    engine.dispose()


def test_one_tick_reads_from_memory_until_a_write_to_the_table(engine):
    s = CtlStore(engine)
    s.create_job("j", "y", "u")
    s.new_attempt("j", 1, {"provider": "fake"}, "fake", 1.0)
    with s.one_tick():
        assert s.get_job("j")["step"] is None
        s.update_job("j", step=5)
        assert s.get_job("j")["step"] == 5  # the write to jobs is seen
        assert s.attempts("j")[0]["offer"] == {"provider": "fake"}
        assert s.attempts("j")[0]["offer"] == {"provider": "fake"}  # answered from memory, intact
        s.update_attempt("j", 1, state="RUNNING")
        assert s.get_attempt("j", 1)["state"] == "RUNNING"
        s.open_spend("j", 1, 3.6, t=0.0)
        s.book_spend("j", 1, 100.0)
        assert s.spend_total("j") == pytest.approx(0.1)

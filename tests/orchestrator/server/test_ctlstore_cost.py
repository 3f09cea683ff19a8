"""What a controller tick costs in the server database (``CtlStore`` on PostgreSQL and on a SQLite
server database), and that the cheaper paths keep the store's behaviour: a write of one statement
is one round trip (no BEGIN/COMMIT) and an exception inside a write sends nothing; the controller's
touch is written at most every ``TOUCH_EVERY_S``; ``pop_action`` with nothing asked takes no lock;
``book_spend`` books exactly what the embedded SQLite store books (the same doubles)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import event

from orchestrator.run.state import StateStore
from orchestrator.server.ctlstore import CtlStore
from orchestrator.server.db import make_engine
from orchestrator.server.migrate import upgrade


@pytest.fixture
def engine(db_url):
    e = make_engine(db_url)
    upgrade(e)
    yield e
    e.dispose()


@pytest.fixture
def sent(engine):
    """Everything sent to the database: statements, and COMMITs (psycopg's BEGIN rides on them)."""
    got: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda _c, _cur, sql, *_a: got.append(sql))
    event.listen(engine, "commit", lambda _c: got.append("COMMIT"))
    return got


def test_a_lone_write_is_one_round_trip_and_an_exception_sends_nothing(engine, sent):
    s = CtlStore(engine)
    s.create_job("j", "y", "u")
    sent.clear()
    s.update_job("j", step=5)
    if engine.dialect.name == "postgresql":
        assert sent == [next(q for q in sent if q.startswith("UPDATE ctl_jobs"))]  # no BEGIN, no COMMIT
    with pytest.raises(RuntimeError):
        with s._write() as c:
            c.execute("UPDATE jobs SET step=? WHERE name=?", (7, "j"))
            raise RuntimeError("boom")
    assert s.get_job("j")["step"] == 5  # rolled back: the held statement was never sent
    s.set_state("j", "RUNNING")  # two statements: one transaction
    assert s.get_job("j")["state"] == "RUNNING" and s.events("j")[-1]["type"] == "state"


def test_touch_is_written_at_most_every_touch_every_s(engine, monkeypatch):
    s = CtlStore(engine)
    s.create_job("j", "y", "u")
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    assert s.claim_controller("j")
    assert s.get_job("j")["controller_seen"] == 1000.0
    now[0] += s.TOUCH_EVERY_S - 1
    s.touch_controller("j")
    assert s.get_job("j")["controller_seen"] == 1000.0  # not yet: nothing written
    now[0] += 1
    s.touch_controller("j")
    assert s.get_job("j")["controller_seen"] == 1000.0 + s.TOUCH_EVERY_S
    assert s.controller_alive(s.get_job("j"))


def test_pop_action_takes_no_lock_when_nothing_is_asked(engine, sent):
    s = CtlStore(engine)
    s.create_job("j", "y", "u")
    sent.clear()
    assert s.pop_action("j") is None
    assert not any("FOR UPDATE" in q or q.startswith("UPDATE") for q in sent)
    if engine.dialect.name == "postgresql":  # one autocommit read (SQLite reads are short transactions)
        assert len(sent) == 1 and sent[0].startswith("SELECT")
    s.request_action("j", "stop")
    assert s.pop_action("j") == "stop" and s.pop_action("j") is None


def test_book_spend_books_the_same_doubles_as_the_embedded_store(engine, tmp_path):
    ctl, emb = CtlStore(engine), StateStore(tmp_path / "state.db")
    bookings = [(1, 0.1), (1, 7.3), (1, 7.3), (1, 5.0), (2, 13.37), (1, 99.99), (2, 1e5 / 3)]
    for st in (ctl, emb):
        st.create_job("j", "y", "u")
        st.open_spend("j", 1, 2.718281828, t=0.0)
        st.open_spend("j", 2, 0.1234567, t=3.0)
    got = {id(st): [st.book_spend("j", a, until) for a, until in bookings] for st in (ctl, emb)}
    for st in (ctl, emb):
        st.book_spend("j", 1, 150.0, close=True)
        got[id(st)].append(st.book_spend("j", 1, 200.0))  # closed: nothing
        got[id(st)].append(st.book_spend("j", 1, 210.0, close=True, reopen=True))
    assert got[id(ctl)] == got[id(emb)]  # the same doubles, not just close
    strip = [{k: r[k] for k in ("attempt", "billed_until", "seconds", "usd", "closed")} for r in emb.spend_by_attempt("j")]
    assert [{k: r[k] for k in ("attempt", "billed_until", "seconds", "usd", "closed")}
            for r in ctl.spend_by_attempt("j")] == strip
    assert ctl.spend_total("j") == pytest.approx(emb.spend_total("j"), rel=1e-15)
    emb.close()

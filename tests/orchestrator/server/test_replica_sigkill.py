"""Replica processes SIGKILLed at random on real PostgreSQL (``make e2e``): 3 processes, 6 jobs on
the file-backed fake cloud, real clock; a random replica is killed every ~1.5 s and a fresh one
started. Each replica process has its own ``DTRUN_HOME`` (its own machine, as far as dtrun
can tell): they share only the PostgreSQL database (and the fake cloud's file). Every job
finishes, each attempt is launched once (a replica adopting a job re-attaches to the node the
dead one recorded), and the booked spend equals the bill (no gap, no double count)."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from orchestrator.server.ctlstore import CtlStore
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.jobs import submit_job
from orchestrator.server.migrate import upgrade
from orchestrator.server.models import Job, Lease, Team, User
from providers.fake import FakeOfferTemplate, FakeProvider

pytestmark = pytest.mark.e2e
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def test_sigkilled_replica_processes_on_postgresql(tmp_path, pg_url):
    cloud_file = tmp_path / "cloud.json"
    cloud = FakeProvider(cloud_file, offers=[FakeOfferTemplate("fake-east", "H100", True, 1.0)],
                         provision_seconds=0.5, autodown_seconds=None)
    engine = make_engine(pg_url)
    upgrade(engine)
    with session_scope(engine) as s:
        team = Team(name="ml")
        s.add(team)
        s.flush()
        user = User(team_id=team.id, name="ada")
        s.add(user)
        s.flush()
        for i in range(6):
            submit_job(s, team, user, f"kill{i}", {
                "name": f"kill{i}",
                "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1, "spot": True},
                "trainer": {"model": "tiny", "steps": 100, "batch_size": 8, "seq_len": 64},
                "checkpoint": {"uri": f"file://{tmp_path}/run{i}", "every_steps": 50},
                "budget": {"max_usd": 100.0},
                "recovery": {"poll_seconds": 0.2, "backoff_seconds": 0.2, "heartbeat_timeout_seconds": 30},
            }, None)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    rng = random.Random(7)
    procs: list[subprocess.Popen] = []
    born = kills = 0

    def start():
        nonlocal born
        home = tmp_path / f"home-p{born}"  # one machine per replica: nothing on disk is shared
        procs.append(subprocess.Popen([sys.executable, str(HERE / "replica_proc.py"), pg_url,
                                       str(cloud_file), f"p{born}"], env=env | {"DTRUN_HOME": str(home)}, cwd=ROOT,
                                      stderr=open(tmp_path / f"p{born}.err", "w")))
        born += 1

    try:
        for _ in range(3):
            start()
        deadline = time.time() + 240
        while time.time() < deadline:
            time.sleep(1.5)
            with session_scope(engine) as s:
                if all(j.state == "finished" for j in s.scalars(select(Job))):
                    break
            victim = procs.pop(rng.randrange(len(procs)))
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            kills += 1
            start()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    with session_scope(engine) as s:
        jobs = list(s.scalars(select(Job)))
        states = {j.name: j.state for j in jobs}
        booked = sum(j.spend_usd for j in jobs)
        epochs = [lease.epoch for lease in s.scalars(select(Lease))]
    errs = "".join((tmp_path / f"p{k}.err").read_text()[-500:] for k in range(born))
    assert states == {f"kill{i}": "finished" for i in range(6)}, errs
    assert kills > 0 and max(epochs) > 1
    names = collections.Counter(i.name for i in cloud.instances())
    assert all(n == 1 for n in names.values()), names
    assert [i for i in cloud.instances() if i.gone_at is None] == []
    assert booked > 0 and booked == pytest.approx(cloud.bill()["total_usd"], abs=0.01)
    store = CtlStore(engine)  # every attempt's spend row in the database, booked once
    assert booked == pytest.approx(sum(store.spend_total(f"kill{i}") for i in range(6)), abs=1e-9)
    assert not any((tmp_path / f"home-p{k}" / "state.db").exists() for k in range(born))  # nothing local
    reattached = [e["message"] for i in range(6) for e in store.events(f"kill{i}") if e["type"] == "reattach"]
    assert any("(1 live node(s))" in m for m in reattached), reattached  # adopted while its node ran
    engine.dispose()

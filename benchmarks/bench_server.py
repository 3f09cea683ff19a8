"""One ``dtrun server`` controller replica with N concurrent jobs on the fake cloud, over real
PostgreSQL (``initdb`` + ``pg_ctl`` on a unix socket, the test fixture's way; SQLite with
``--sqlite``): every job running (launched, provisioned, its simulated trainer writing progress to
its ``file://`` run URI each poll), then ``--rounds`` replica ticks measured:

- replica tick: wall time of one ``Replica.tick()`` (renew the leases, claim, the team cap check,
  every owned job's controller tick and its fenced write-back, the stop requests) — the goal is
  that N jobs are ticked within their 5 s poll interval;
- jobs ticked per second (N / replica tick);
- per-job tick p50/p99: the time between successive jobs' write-backs inside a replica tick (one
  job's controller tick + its write-back to the server database); the write-back alone (the
  fenced transaction on the server database) apart;
- the fake cloud's own time per replica tick (it advances every instance on every call), and the
  replica tick without it;
- database round trips per job per tick, everything this process sends to the database in a
  replica tick / N: the server tables *and* the controllers' state store, which is built as ``dtrun
  server`` builds it (``orchestrator.server.ctlstore.CtlStore`` on the same engine: its ``ctl_*``
  tables); counted on every connection of the engine: statements (``before_cursor_execute``), split
  into ``ctl_*`` and server-table ones, plus the round trips that are not statements — the
  connection pool's pre-ping at each checkout (``pool_pre_ping``), psycopg2's implicit ``BEGIN``
  of a non-autocommit transaction, each ``COMMIT``/``ROLLBACK``;
- memory: RSS growth from before the jobs were created to after the measured ticks, per job.

The clock is virtual (5 s per round), so only this process's own work is measured: no provider
latency. One process, this machine's CPUs (note how many others share them).

    .venv/bin/python benchmarks/bench_server.py [--jobs 500] [--rounds 5] [--sqlite]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

POLL_S = 5.0


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@contextlib.contextmanager
def postgresql():
    path = ROOT / "benchmarks" / "bench_dashboard.py"
    spec = importlib.util.spec_from_file_location("bench_dashboard_for_server", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with mod.postgresql() as url:
        yield url


def run(url: str, tmp: str, n_jobs: int, rounds: int) -> dict:
    from sqlalchemy import event, select

    from orchestrator.contract import runuri
    from orchestrator.plan.spec import parse_spec
    from orchestrator.run.clock import VirtualClock
    from orchestrator.server.ctlstore import CtlStore
    from orchestrator.server.auth import create_team, create_user
    from orchestrator.server.db import make_engine, session_scope
    from orchestrator.server.jobs import submit_job
    from orchestrator.server.migrate import upgrade
    from orchestrator.server.models import Job
    from orchestrator.server.replica import Replica
    from providers.fake import FakeOfferTemplate, FakeProvider

    written: dict[str, float] = {}

    def workload(inst, now):
        # the fake cloud advances every instance on every call: write each one's progress once per
        # virtual instant, so the benchmark measures the server, not N² fake-cloud file writes
        if written.get(inst.name) == now:
            return None
        written[inst.name] = now
        uri = inst.env["DTRUN_RUN_URI"]
        step = int((now - inst.ready_at) / 1.0)
        runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                          {"step": step, "steps": 10**9, "loss": 2.0, "tokens_per_s": 1.0, "time": now,
                           "attempt": int(inst.env["DTRUN_ATTEMPT"]), "last_committed_step": None})
        return None

    engine = make_engine(url)
    upgrade(engine)
    clock = VirtualClock()
    in_cloud = [0.0]

    class TimedCloud(FakeProvider):
        """The fake cloud, timing its own calls: it advances every instance (and runs the simulated
        trainers) on each call — O(N) per poll, O(N²) per round — a cost of the stand-in, not of
        the server, that a real provider's API does not have."""

        @contextlib.contextmanager
        def _now(self):
            t = time.perf_counter()
            try:
                with super()._now() as got:
                    yield got
            finally:
                in_cloud[0] += time.perf_counter() - t

    cloud = TimedCloud(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", False, 1.0)],
                       provision_seconds=5, autodown_seconds=None, workload=workload)
    rss0 = _rss_mb()
    with session_scope(engine) as s:
        team = create_team(s, "bench", monthly_usd=10**9)
        user = create_user(s, team, "ann")
        for i in range(n_jobs):
            d = {"name": f"b{i:04d}", "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1},
                 "trainer": {"model": "tiny", "steps": 10**9, "batch_size": 8, "seq_len": 64},
                 "checkpoint": {"uri": f"file://{tmp}/runs/b{i:04d}"}, "budget": {"max_usd": 10**6},
                 "recovery": {"poll_seconds": POLL_S, "heartbeat_timeout_seconds": 10**6},
                 "teardown": {"idle_minutes": 10**6}}
            parse_spec(d)
            submit_job(s, team, user, d["name"], d, None)

    marks: list[float] = []
    write_back: list[float] = []

    class TimedReplica(Replica):
        def _write_back(self, *a, **kw):
            t = time.perf_counter()
            super()._write_back(*a, **kw)
            marks.append(time.perf_counter())
            write_back.append(marks[-1] - t)

    store = CtlStore(engine)  # as `dtrun server` builds it (orchestrator.cli.server, server.runner)
    r = TimedReplica(engine, store, {"fake": cloud}, clock, replica_id="bench",
                     ttl=60.0, max_jobs=n_jobs, write_lease=False, tick_seconds=POLL_S, launch_wait_seconds=5.0)
    pg = engine.dialect.name == "postgresql"
    counts = {"ctl": 0, "server": 0, "other": 0}

    @event.listens_for(engine, "before_cursor_execute")
    def _count(_conn, _cur, sql, *_a, **_k):
        # SQLite's BEGIN IMMEDIATE (the engine's, for both kinds of transaction): neither table kind
        counts["other" if sql.startswith("BEGIN") else "ctl" if "ctl_" in sql else "server"] += 1

    @event.listens_for(engine, "checkout")
    def _ping(*_a):  # pool_pre_ping: a SELECT 1 on the DBAPI connection, no event of its own
        counts["other"] += pg

    @event.listens_for(engine, "begin")
    def _begin(conn):  # psycopg2 sends BEGIN before a non-autocommit transaction's first statement
        counts["other"] += pg and not conn.connection.dbapi_connection.autocommit

    @event.listens_for(engine, "commit")
    def _commit(_conn):
        counts["other"] += 1

    @event.listens_for(engine, "rollback")
    def _rollback(_conn):
        counts["other"] += 1

    warm = 0
    while True:  # until every job runs
        r.tick()
        clock.advance(POLL_S)
        warm += 1
        with session_scope(engine) as s:
            running = sum(1 for j in s.scalars(select(Job)) if j.state == "running")
        if (running == n_jobs and all(c.state == "RUNNING" for c in r.controllers.values())) or warm > 30:
            break
    tick_s, per_job, trips, cloud_s = [], [], [], []
    ctl_st, srv_st = [], []
    write_back.clear()
    for _ in range(rounds):
        marks.clear()
        counts.update(ctl=0, server=0, other=0)
        in_cloud[0] = 0.0
        t0 = time.perf_counter()
        r.tick()
        t1 = time.perf_counter()
        tick_s.append(t1 - t0)
        cloud_s.append(in_cloud[0])
        trips.append(sum(counts.values()) / n_jobs)
        ctl_st.append(counts["ctl"] / n_jobs)
        srv_st.append(counts["server"] / n_jobs)
        prev = t0
        for m in marks:
            per_job.append(m - prev)
            prev = m
        clock.advance(POLL_S)
    rss1 = _rss_mb()
    states = {c.state for c in r.controllers.values()}
    for c in r.controllers.values():
        c.teardown.terminate_all(sleep=lambda _s: clock.advance(1))
    store.close()
    engine.dispose()
    per_job.sort()
    return {"jobs": n_jobs, "running": running, "controller_states": sorted(states), "warmup_ticks": warm,
            "rounds": rounds, "replica_tick_s": {"p50": round(statistics.median(tick_s), 3),
                                                 "max": round(max(tick_s), 3)},
            "fake_cloud_s_per_tick": round(statistics.median(cloud_s), 3),
            "replica_tick_without_fake_cloud_s": round(statistics.median(t - c for t, c in zip(tick_s, cloud_s)), 3),
            "jobs_ticked_per_s": round(n_jobs / statistics.median(tick_s), 1),
            "within_poll_interval": max(tick_s) <= POLL_S,
            "per_job_tick_ms": {"p50": round(1000 * per_job[len(per_job) // 2], 2),
                                "p99": round(1000 * per_job[min(len(per_job) - 1, int(len(per_job) * 0.99))], 2)},
            "write_back_ms": {"p50": round(1000 * statistics.median(write_back), 2),
                              "p99": round(1000 * sorted(write_back)[int(len(write_back) * 0.99)], 2)},
            "db_round_trips_per_job_per_tick": round(statistics.median(trips), 2),
            "statements_per_job_per_tick": {"ctl_store": round(statistics.median(ctl_st), 2),
                                            "server_tables": round(statistics.median(srv_st), 2)},
            "rss_mb": {"before": round(rss0, 1), "after": round(rss1, 1),
                       "per_job_kb": round((rss1 - rss0) * 1024 / n_jobs, 1)},
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sqlite", action="store_true", help="SQLite instead of PostgreSQL")
    a = ap.parse_args()
    out = {"benchmark": "server", "poll_seconds": POLL_S, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="dtrun-bench-srv-") as tmp:
        os.environ["DTRUN_HOME"] = os.path.join(tmp, "home")
        if a.sqlite:
            out["sqlite"] = run(f"sqlite:///{tmp}/server.db", tmp, a.jobs, a.rounds)
        else:
            with postgresql() as url:
                out["postgresql"] = (run(url, tmp, a.jobs, a.rounds) if url else "not run (no initdb/pg_ctl)")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

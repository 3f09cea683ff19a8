"""The dashboard's runs page with 500 runs: server time of ``GET /`` (the HTML) and ``GET /api/runs``
(what the page polls), p50 and p99 over repeated requests, for

- the embedded source (``dtrun dashboard``): a state store with 500 jobs, each with 2 attempts
  (one preempted), 2 spend rows, 2 nodes and 5 events;
- the server source (``dtrun server``'s ``/dashboard``) over real PostgreSQL (``initdb`` + ``pg_ctl``
  on a unix socket, as tests/orchestrator/server/conftest.py does) and over SQLite: 500 jobs of one
  team (3 members), 5 server events each, plus the same controllers' state store.

Target: p99 ≤ 300 ms for each. "Server time": the request through the ASGI app in this process
(FastAPI's TestClient: routing, auth, the source's queries, rendering, the response body), no
network and no browser. Without the PostgreSQL binaries that row prints ``not run``.

    .venv/bin/python benchmarks/bench_dashboard.py [--runs 500] [--n 40]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET_MS = 300.0


def fill_store(store, n: int, run_root: str) -> None:
    t0 = time.time() - 3600
    offer = {"gpu": "H100", "gpus_per_node": 8, "nodes": 1, "region": "fake-east", "spot": True,
             "price_per_gpu_hour": 2.0, "spot_bid": 1.2}
    for i in range(n):
        name = f"run-{i:04d}"
        store.create_job(name, "name: x\n", f"file://{run_root}/{name}")
        store.update_job(name, state="RUNNING", step=100 + i, steps=10_000, loss=2.5, tokens_per_s=50_000.0,
                         budget_usd=200.0, steps_lost=12)
        for a in (1, 2):
            store.new_attempt(name, a, offer, "fake", t0 + a * 60)
            if a == 1:
                store.update_attempt(name, 1, state="ENDED", outcome="preempted", reason="spot reclaimed",
                                     start_step=0, end_step=80, ended_at=t0 + 900)
            else:
                store.update_attempt(name, 2, state="RUNNING", start_step=68)
            store.add_node(name, a, {"provider": "fake", "name": f"dtrun-{name}-a{a}", "instance_id": f"i-{i}-{a}",
                                     "region": "fake-east"}, t0 + a * 60)
            store.open_spend(name, a, 9.6, t0 + a * 60)
            store.book_spend(name, a, t0 + a * 600)
        for k in range(5):
            store.add_event(name, "state", f"event {k} of {name}", t=t0 + k)


def timed(client, path: str, n: int, headers: dict | None = None) -> dict:
    for _ in range(3):  # warm: imports, caches, first connections
        assert client.get(path, headers=headers).status_code == 200
    ms = []
    for _ in range(n):
        t = time.perf_counter()
        r = client.get(path, headers=headers)
        ms.append((time.perf_counter() - t) * 1000)
        assert r.status_code == 200
    ms.sort()
    p99 = ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]
    return {"p50_ms": round(statistics.median(ms), 1), "p99_ms": round(p99, 1), "n": n,
            "bytes": len(r.content), "met": p99 <= TARGET_MS}


def bench_embedded(tmp: Path, runs: int, n: int) -> dict:
    from fastapi.testclient import TestClient

    from orchestrator.dashboard.app import make_app
    from orchestrator.dashboard.source import EmbeddedSource
    from orchestrator.run.state import StateStore

    store = StateStore(tmp / "embedded.db")
    fill_store(store, runs, str(tmp / "runs"))
    c = TestClient(make_app(EmbeddedSource(tmp / "embedded.db"), "tok"))
    assert c.get("/?token=tok").text.count("<tr data-run=") == runs
    return {"html": timed(c, "/?token=tok", n), "api_runs": timed(c, "/api/runs?token=tok", n)}


def bench_server(tmp: Path, url: str, runs: int, n: int, tag: str) -> dict:
    from fastapi.testclient import TestClient

    from orchestrator.run.state import StateStore
    from orchestrator.server.api import create_app
    from orchestrator.server.auth import create_team, create_user, issue_token
    from orchestrator.server.db import make_engine, session_scope
    from orchestrator.server.jobs import add_event, submit_job
    from orchestrator.server.migrate import upgrade

    home = tmp / f"home-{tag}"
    os.environ["DTRUN_HOME"] = str(home)
    fill_store(StateStore(home / "state.db"), runs, str(tmp / f"runs-{tag}"))
    engine = make_engine(url)
    upgrade(engine)
    with session_scope(engine) as s:
        team = create_team(s, "bench", monthly_usd=10_000.0)
        users = [create_user(s, team, f"user{k}") for k in range(3)]
        token = issue_token(s, users[0])
        spec = {"name": "x", "budget": {"max_usd": 200.0}, "trainer": {"steps": 10_000}}
        # a plan record of the size the dry run stores (offers, rungs, estimate): ~20 KB
        plan = {"plan": {"estimate": {"cost_usd": 150.0}}, "offers": [{"offer": "x" * 180, "rank": k} for k in range(100)]}
        for i in range(runs):
            j = submit_job(s, team, users[i % 3], f"run-{i:04d}", dict(spec, name=f"run-{i:04d}"), plan)
            j.state, j.spend_usd = "running", 10.0 + i / 100
            for k in range(4):
                add_event(s, j, "state", f"server event {k}")
    c = TestClient(create_app(engine))
    h = {"Authorization": f"Bearer {token}"}
    assert c.get("/dashboard/", headers=h).text.count("<tr data-run=") == runs
    out = {"html": timed(c, "/dashboard/", n, h), "api_runs": timed(c, "/dashboard/api/runs", n, h)}
    engine.dispose()
    return out


@contextlib.contextmanager
def postgresql():
    """A throwaway cluster the test fixture's way (initdb + pg_ctl, unix socket only, as ``nobody``
    under root; its helpers loaded by path), stopped and removed after; None without the binaries."""
    import pwd
    import shutil
    import subprocess

    path = ROOT / "tests" / "orchestrator" / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("server_conftest_for_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if any(mod._pg_bin(b) is None for b in ("initdb", "pg_ctl")):
        yield None
        return
    base = tempfile.mkdtemp(prefix="dtrun-pgb-")
    os.chmod(base, 0o755)
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        os.chown(base, nobody.pw_uid, nobody.pw_gid)
    data, started = os.path.join(base, "data"), False
    try:
        subprocess.run(mod._as_user([mod._pg_bin("initdb"), "-D", data, "-A", "trust", "-U", "dtrun", "-E", "UTF8"]),
                       check=True, capture_output=True, cwd=base)
        subprocess.run(mod._as_user([mod._pg_bin("pg_ctl"), "-D", data, "-l", os.path.join(base, "log"), "-w", "-o",
                                     f"-k {base} -c listen_addresses='' -c fsync=off", "start"]),
                       check=True, capture_output=True, cwd=base)
        started = True
        import psycopg

        with psycopg.connect(f"host={base} user=dtrun dbname=postgres", autocommit=True) as con:
            con.execute("CREATE DATABASE bench")
        yield f"postgresql+psycopg://dtrun@/bench?host={base}"
    finally:
        if started:
            subprocess.run(mod._as_user([mod._pg_bin("pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop"]),
                           capture_output=True, cwd=base)
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--n", type=int, default=40)
    a = ap.parse_args()
    out: dict = {"benchmark": "dashboard", "runs": a.runs, "target_p99_ms": TARGET_MS}
    with tempfile.TemporaryDirectory(prefix="dtrun-bench-dash-") as d:
        tmp = Path(d)
        out["embedded"] = bench_embedded(tmp, a.runs, a.n)
        out["server_sqlite"] = bench_server(tmp, f"sqlite:///{tmp / 'server.db'}", a.runs, a.n, "sqlite")
        with postgresql() as url:
            out["server_postgresql"] = (bench_server(tmp, url, a.runs, a.n, "pg") if url
                                        else "not run (no initdb/pg_ctl)")
    out["met"] = all(v[k]["met"] for v in out.values() if isinstance(v, dict) for k in ("html", "api_runs"))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

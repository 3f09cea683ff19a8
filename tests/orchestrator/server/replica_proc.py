"""One controller replica as its own process, for the SIGKILL race test (not a test file):
``python replica_proc.py DB_URL CLOUD_FILE REPLICA_ID``. Its controllers' state store is the
server database's (``CtlStore``), as in ``dtrun server``: the process shares nothing with the
other replicas but the database (and the fake cloud). Ticks every 0.1 s on the real clock
against the file-backed fake cloud until killed."""

from __future__ import annotations

import sys
import time

from orchestrator.contract import runuri
from orchestrator.server.ctlstore import CtlStore
from orchestrator.server.db import make_engine
from orchestrator.server.replica import Replica
from providers.fake import FakeProvider

STEPS, STEP_S = 100, 0.05


def sim_trainer(inst, now):
    uri = inst.env["DTRUN_RUN_URI"]
    step = min(STEPS, int((now - inst.ready_at) / STEP_S))
    runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                      {"step": step, "steps": STEPS, "loss": 2.0, "tokens_per_s": 1.0, "time": now,
                       "attempt": int(inst.env["DTRUN_ATTEMPT"]), "last_committed_step": None})
    if step >= STEPS:
        runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "loss": 1.0, "tokens": step, "time": now})
        return (0, inst.ready_at + STEPS * STEP_S)
    return None


def main(db_url: str, cloud_file: str, replica_id: str) -> None:
    cloud = FakeProvider(cloud_file, workload=sim_trainer)
    engine = make_engine(db_url)
    r = Replica(engine, CtlStore(engine), {"fake": cloud}, replica_id=replica_id, ttl=1.5,
                max_jobs=3, write_lease=False)
    while True:
        r.tick()
        time.sleep(0.1)


if __name__ == "__main__":
    main(*sys.argv[1:4])

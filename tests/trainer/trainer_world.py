"""Worker for trainer tests that run several trainer jobs in one torchrun world (``run_world`` in
tests/trainer/conftest.py, protocol in tests/trainer/world_cases.py):

    torchrun --nproc-per-node=N tests/trainer/trainer_world.py CASES.json

Each case (``{"name", "out", "job": JOB.yaml, "run_uri": URI}``) runs the real trainer entry,
``trainer.train.main(["--job", JOB, "--run-uri", URI])``, which creates and destroys its own
process group as under torchrun; a case ``{"name", "out", "script": PATH}`` runs a test script
that does the same (``init_process_group("gloo")`` … ``destroy_process_group()``) as ``__main__``.
Each case rendezvouses on a fresh store (rank 0's ``init_process_group`` starts it on a free port
of 127.0.0.1, published to the other ranks through torchrun's agent store): a default process
group re-created on the same store would find the previous one's keys, since group names restart
at 0 after ``destroy_process_group``.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
from datetime import timedelta

from torch.distributed import TCPStore
from world_cases import run_cases

from trainer.train import main

_agent: list[TCPStore] = []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(case: dict, rank: int) -> int:
    if not _agent:  # torchrun's store (the agent's), before the first case changes MASTER_*
        _agent.append(TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               timeout=timedelta(seconds=300)))
    key = f"dtrun-test-world/{case['name']}/port"
    if rank == 0:
        port = _free_port()  # the trainer's init_process_group (rank 0) starts the store on it
        _agent[0].set(key, str(port))
    else:
        port = int(_agent[0].get(key))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
    if "script" in case:
        sys.argv = [case["script"]]
        runpy.run_path(case["script"], run_name="__main__")
        return 0
    return main(["--job", case["job"], "--run-uri", case["run_uri"]])


if __name__ == "__main__":
    run_cases(sys.argv[1], run)

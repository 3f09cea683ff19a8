"""The worker side of ``run_world`` (tests/trainer/conftest.py): several test cases in ONE torchrun
world, so that each rank's interpreter and torch start once for all of them, each case still with
its own output and exit code (imported by the worker scripts, which torchrun runs from this folder).

``run_cases(CASES.json, run)``: CASES.json is a list of cases, ``{"name": ..., "out": DIR, ...}``
(the rest is the worker's). For each case in turn, on every rank, ``run(case, rank)`` runs with
the rank's stdout/stderr (file descriptors 1 and 2) in ``DIR/rank{r}.log``; its return value
(None: 0) or ``exception`` and the traceback goes to ``DIR/rank{r}.rc``. A rank whose case did not
return 0 exits there (1), which ends the world: its peers may be blocked in that case's
collectives. The launcher starts a new world for the cases after it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any, Callable


def _run_case(case: dict, rank: int, run: Callable[[dict, int], Any]) -> str:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(os.path.join(case["out"], f"rank{rank}.log"), "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            code = str(run(case, rank) or 0)
        except BaseException:  # noqa: BLE001 - recorded for the test of this case
            traceback.print_exc()
            code = "exception\n" + traceback.format_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a handler the case set: torchrun may stop us now
    return code


def run_cases(cases_json: str, run: Callable[[dict, int], Any]) -> None:
    with open(cases_json) as f:
        cases = json.load(f)
    rank = int(os.environ["RANK"])
    for case in cases:
        os.makedirs(case["out"], exist_ok=True)
        code = _run_case(case, rank, run)
        with open(os.path.join(case["out"], f"rank{rank}.rc"), "w") as f:
            f.write(code)
        print(f"world_cases: rank {rank}: case {case['name']}: {code.splitlines()[0]}", flush=True)
        if code != "0":
            os._exit(1)

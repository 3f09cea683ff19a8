"""A fake-cloud job for the dashboard tests: the real controller on a virtual clock, the fake
cloud, ``SimTrainer`` writing progress and metrics through the real run-URI contract."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "run"))

from orchestrator.run.clock import VirtualClock  # noqa: E402
from orchestrator.run.controller import Controller  # noqa: E402
from orchestrator.run.state import StateStore  # noqa: E402
from providers.fake import FakeProvider  # noqa: E402
from test_controller_fake import OFFERS, SimTrainer, make_spec  # noqa: E402


class FakeWorld:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.clock = VirtualClock()
        self.sim = SimTrainer(steps=1000, step_s=10.0, every=100)
        self.cloud = FakeProvider(clock=self.clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None,
                                  workload=self.sim)
        self.db = tmp_path / "state.db"
        self.store = StateStore(self.db)

    def controller(self, **over) -> Controller:
        return Controller(make_spec(self.tmp, **over), self.store, clock=self.clock, providers={"fake": self.cloud})

    def tick_until(self, c: Controller, pred, seconds: float = 30.0, limit: int = 2000) -> None:
        for _ in range(limit):
            if pred():
                return
            self.clock.advance(seconds)
            c.tick()
        raise AssertionError("condition not reached")


@pytest.fixture
def world(tmp_path):
    return FakeWorld(tmp_path)


@pytest.fixture
def finished(world):
    """A job preempted once (attempt 1 at 25 min) that then succeeded."""
    world.cloud.script("dtrun-fakejob-a1", preempt_after=1500)
    assert world.controller().run() == "SUCCEEDED"
    write_metrics(world.store.get_job("fakejob")["run_uri"], 1000)
    return world


def write_metrics(run_uri: str, steps: int) -> None:
    """metrics.jsonl rows in the trainer's format (trainer/metrics.py): SimTrainer writes none."""
    import json
    import math

    from orchestrator.contract import runuri

    rows = [json.dumps({"step": s, "loss": 4.0 * math.exp(-s / 400) + 1.0, "tokens": s * 512,
                        "tokens_per_s": 5000.0 + s, "attempt": 1, "time": 0.0}) for s in range(10, steps + 1, 10)]
    rows += [json.dumps({"step": s, "val_loss": 4.2 * math.exp(-s / 400) + 1.1, "tokens": s * 512,
                         "attempt": 1, "time": 0.0}) for s in range(100, steps + 1, 100)]
    runuri.append_line(runuri.join(run_uri, runuri.METRICS), "\n".join(rows))

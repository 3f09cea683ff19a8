"""Preemptions do not use up a job (issue 14): ``recovery.max_attempts`` bounds failed launches and
crashes; a preemption storm is stopped by budget, deadline and ``max_preemptions_per_hour``.

The controller runs against the fake cloud on a virtual clock (no real provider can preempt on
demand offline); ``SimTrainer`` plays the trainer through the real run-URI contract."""

from __future__ import annotations

import pytest

from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.recovery import counted_attempts, preemption_storm
from orchestrator.run.state import StateStore
from providers.fake import FakeProvider
from test_controller_fake import OFFERS, SimTrainer, make_spec, running


@pytest.fixture
def world(tmp_path):
    clock = VirtualClock()
    sim = SimTrainer(steps=1000, step_s=10.0, every=100)
    cloud = FakeProvider(clock=clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None, workload=sim)
    store = StateStore(tmp_path / "state.db")

    def make(spec):
        return Controller(spec, store, clock=clock, providers={"fake": cloud})

    return dict(clock=clock, cloud=cloud, store=store, make=make)


def test_preemptions_beyond_max_attempts_do_not_fail_the_job(world, tmp_path):
    cloud = world["cloud"]
    for a in range(1, 9):  # eight preemptions, each 25 min into its attempt; max_attempts is 3
        cloud.script(f"dtrun-fakejob-a{a}", preempt_after=1500)
    c = world["make"](make_spec(tmp_path, recovery={"max_attempts": 3}))
    assert c.run() == "SUCCEEDED"
    atts = world["store"].attempts("fakejob")
    assert [a["outcome"] for a in atts] == ["preempted"] * 8 + ["succeeded"]
    assert running(cloud) == []


def test_crashes_and_failed_launches_still_count(world, tmp_path):
    cloud = world["cloud"]
    for a in range(1, 9):  # crashes interleaved with preemptions: a1 preempted, a2 crashes, ...
        cloud.script(f"dtrun-fakejob-a{a}", **({"preempt_after": 1500} if a % 2 else {"exit_after": 300, "exit_code": 1}))
    spec = make_spec(tmp_path, recovery={"max_attempts": 3, "max_restarts_on_errors": 10, "max_recovery_minutes": 600})
    c = world["make"](spec)
    assert c.run() == "FAILED"
    job = world["store"].get_job("fakejob")
    assert "recovery.max_attempts = 3" in job["reason"] and "preemptions not counted" in job["reason"]
    atts = world["store"].attempts("fakejob")
    assert [a["outcome"] for a in atts] == ["preempted", "failed"] * 3
    assert counted_attempts(atts) == 3


def test_a_preemption_storm_is_stopped_by_the_rate_limit_and_says_so(world, tmp_path):
    cloud = world["cloud"]
    for a in range(1, 30):  # every attempt preempted 5 min in: no checkpoint is ever reached
        cloud.script(f"dtrun-fakejob-a{a}", preempt_after=300)
    spec = make_spec(tmp_path, recovery={"max_attempts": 3, "max_preemptions_per_hour": 4, "backoff_seconds": 0})
    c = world["make"](spec)
    assert c.run() == "FAILED"
    job = world["store"].get_job("fakejob")
    assert job["reason"].startswith("preemption storm: 5 preemptions within the last 60 min")
    assert "max_preemptions_per_hour = 4" in job["reason"]
    assert running(cloud) == []


def test_a_preemption_storm_is_also_stopped_by_the_budget(world, tmp_path):
    cloud = world["cloud"]
    for a in range(1, 200):
        cloud.script(f"dtrun-fakejob-a{a}", preempt_after=300)
    spec = make_spec(tmp_path, budget={"max_usd": 1.0},
                     recovery={"max_attempts": 3, "max_preemptions_per_hour": None, "backoff_seconds": 0})
    c = world["make"](spec)
    assert c.run() == "OVER_BUDGET"
    assert world["store"].spend_total("fakejob") <= 1.0
    assert running(cloud) == []


def test_storm_window_counts_only_recent_preemptions():
    atts = [{"outcome": "preempted", "ended_at": t} for t in (0, 100, 4000, 4100, 4200)]
    assert preemption_storm(atts, 4300, 3) is None          # 3 in the last hour: not more than 3
    assert preemption_storm(atts, 4300, 2) is not None
    assert preemption_storm(atts, 4300, None) is None
    assert counted_attempts(atts + [{"outcome": "failed"}, {"outcome": "no_capacity"}, {"outcome": None}]) == 2

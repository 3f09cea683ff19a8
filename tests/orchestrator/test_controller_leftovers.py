"""Three controller leftovers from the issue-12 review (each a cost for users who pay by the second):

1. a controller killed while a launch was in flight must not use up ``recovery.max_attempts``
   (a controller crash is not the job's failure, like a preemption);
2. a launch the loop abandoned (``dtrun down`` while it provisions) is booked from its request at
   the offer's price while it may still create something, not dropped from the job's cost;
3. the late terminate of an abandoned launch runs off the loop thread, and the loop waits for it
   (confirmed) before closing the providers.

The provider is the fake cloud on a virtual clock (no real cloud can be killed mid-launch offline);
its ``launch`` and ``terminate`` are slowed with events to play a slow SDK.
"""

from __future__ import annotations

import threading

import pytest

from orchestrator.run import controller as ctl
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.recovery import counted_attempts
from orchestrator.run.state import StateStore
from providers import errors as perr
from providers.fake import FakeProvider
from test_controller_fake import OFFERS, SimTrainer, make_spec, running


class HangingLaunchCloud(FakeProvider):
    """The fake cloud whose first ``hang`` launches block (creating nothing) until ``release``,
    then raise — a controller killed while they were in flight never sees them return."""

    def __init__(self, clock, hang: int, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.hang = hang
        self.release = threading.Event()
        self.hanging = threading.Event()

    def launch(self, request):
        if self.hang > 0:
            self.hang -= 1
            self.hanging.set()
            self.release.wait(30.0)
            raise perr.Transient("the process that called launch is gone", provider="fake")
        return super().launch(request)


def test_a_controller_killed_mid_launch_does_not_use_up_max_attempts(tmp_path):
    clock = VirtualClock()
    sim = SimTrainer(steps=300, step_s=10.0, every=100)
    cloud = HangingLaunchCloud(clock, hang=3, offers=OFFERS, provision_seconds=60, autodown_seconds=None,
                               workload=sim)
    store = StateStore(tmp_path / "state.db")
    spec = make_spec(tmp_path, recovery={"max_attempts": 2})
    try:
        for _ in range(3):  # three controllers, each killed while its launch is in flight
            c = Controller(spec, store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.01,
                           write_lease=False)
            assert c.tick() == "PROVISIONING"
            assert c.inflight is not None and not c.inflight.done.is_set()
            clock.advance(30)
            # the process dies here: nothing more is recorded; a later `dtrun up` re-attaches
        c = Controller(spec, store, clock=clock, providers={"fake": cloud}, write_lease=False)
        assert c.run() == "SUCCEEDED", store.get_job("fakejob")["reason"]
    finally:
        cloud.release.set()
    atts = store.attempts("fakejob")
    assert [a["outcome"] for a in atts] == ["unrecorded"] * 3 + ["succeeded"]
    assert counted_attempts(atts[:3]) == 0
    assert running(cloud) == []


def test_unrecorded_attempts_are_not_counted_but_failures_still_are():
    atts = [{"outcome": "unrecorded"}, {"outcome": "preempted"}, {"outcome": "launch_error"},
            {"outcome": "failed"}, {"outcome": None}]
    assert counted_attempts(atts) == 2

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
from test_controller_fake import OFFERS, SimTrainer, make_spec, running

from orchestrator.run import launchthread, teardown
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.recovery import counted_attempts
from orchestrator.run.state import StateStore
from providers import errors as perr
from providers.fake import FakeProvider


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


class CreatesThenHangsCloud(FakeProvider):
    """A launch that creates its instance (billing from then on) and then blocks in the SDK."""

    def __init__(self, clock, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.release = threading.Event()
        self.created = threading.Event()
        self.hang = 1

    def launch(self, request):
        handle = super().launch(request)
        if self.hang > 0:
            self.hang -= 1
            self.created.set()
            self.release.wait(30.0)
        return handle


def test_what_a_killed_controllers_launch_created_is_swept_and_booked_not_counted(tmp_path):
    clock = VirtualClock()
    sim = SimTrainer(steps=300, step_s=10.0, every=100)
    cloud = CreatesThenHangsCloud(clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None, workload=sim)
    store = StateStore(tmp_path / "state.db")
    spec = make_spec(tmp_path, recovery={"max_attempts": 1})
    try:
        c = Controller(spec, store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.01,
                       write_lease=False)
        assert c.tick() == "PROVISIONING"
        assert cloud.created.wait(10.0)
        clock.advance(300)  # the controller dies; its instance bills for five minutes unrecorded
        c = Controller(spec, store, clock=clock, providers={"fake": cloud}, write_lease=False)
        assert c.run() == "SUCCEEDED", store.get_job("fakejob")["reason"]
    finally:
        cloud.release.set()
    atts = store.attempts("fakejob")
    assert [a["outcome"] for a in atts] == ["unrecorded", "succeeded"]
    assert running(cloud) == []
    # the orphan sweep of the second start terminated the first launch's instance and booked it
    assert store.spend_total("fakejob") == pytest.approx(cloud.bill()["total_usd"], abs=0.01)
    assert [r["attempt"] for r in store.spend_by_attempt("fakejob")] == [1, 2]


def test_unrecorded_attempts_are_not_counted_but_failures_still_are():
    atts = [{"outcome": "unrecorded"}, {"outcome": "preempted"}, {"outcome": "launch_error"},
            {"outcome": "failed"}, {"outcome": None}]
    assert counted_attempts(atts) == 2


# ---- 2. an abandoned launch is booked ---------------------------------------------------------------

PRICE = 60.0  # USD per GPU-hour: $1 a minute


def _spec(tmp_path):
    from test_controller_launch_thread import _spec as slow_spec

    return slow_spec(tmp_path, budget={"max_usd": 1000.0})


class NeverReturnsInTimeCloud(FakeProvider):
    """A launch stuck in the provider's SDK (SkyPilot's request queue, Modal waiting for capacity)
    that has created nothing findable when the controller gives up on it, and raises later."""

    def __init__(self, clock, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.release = threading.Event()
        self.running = threading.Event()

    def launch(self, request):
        self.running.set()
        self.release.wait(30.0)
        raise perr.Transient("gave up waiting for capacity", provider="fake")


def test_an_abandoned_launch_is_booked_from_its_request(tmp_path):
    from orchestrator.cli.money import job_cost
    from providers.fake import FakeOfferTemplate

    clock = VirtualClock()
    cloud = NeverReturnsInTimeCloud(clock, offers=[FakeOfferTemplate("fake-east", "H100", False, PRICE)],
                                    provision_seconds=60, autodown_seconds=None, terminate_seconds=0)
    store = StateStore(tmp_path / "state.db")
    c = Controller(_spec(tmp_path), store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.05,
                   write_lease=False)
    t0 = clock.now()
    burn: list[float] = []

    def on_tick(ctl):
        assert cloud.running.wait(10.0)
        burn.append(ctl.spent())
        if len(burn) == 2:
            store.request_action("slowlaunch", "stop")

    try:
        assert c.run(on_tick=on_tick) == "CANCELLED"
    finally:
        cloud.release.set()
    job = store.get_job("slowlaunch")
    booked = store.spend_total("slowlaunch")
    # From the launch request to the end of the run, at the offer's price ($1/min): the guard's
    # view while it was in flight does not drop when the controller stops waiting for it.
    assert booked == pytest.approx((job["finished_at"] - t0) / 60.0, abs=1e-6)
    assert booked >= max(burn) > 0
    att = store.attempts("slowlaunch")[0]
    assert att["outcome"] == "abandoned"
    cost = job_cost(store, job)
    assert cost["cost_usd"] == pytest.approx(booked, abs=1e-5)
    assert cost["attempts"][0]["outcome"] == "abandoned" and not cost["attempts"][0]["billing"]
    assert "upper bound" in cost["attempts"][0]["note"]  # `dtrun cost` says what the booking is
    assert any(e["type"] == "spend" and "upper bound" in e["message"] for e in store.events("slowlaunch"))
    assert cloud.running_instances() == []


# ---- 3. the late terminate runs off the loop -------------------------------------------------------

class LateReturnCloud(FakeProvider):
    """A launch that creates its instance during the controller's last listing before it abandons
    the launch (so the listing misses it: the race that left ``abandon`` to terminate on the loop
    thread), and a
    terminate that fails ``fails`` times, each call blocked until ``gate`` opens — a provider API
    rate-limiting the late terminate."""

    def __init__(self, clock, fails: int = 3, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.release = threading.Event()
        self.returned = threading.Event()
        self.running = threading.Event()
        self.gate = threading.Event()
        self.fails = fails
        self.terminate_threads: list[str] = []
        self.terminate_waiting = threading.Event()
        self.first_list: float | None = None
        self.abandon_after = float("inf")  # the controller's stop grace: the tick that abandons

    def launch(self, request):
        self.running.set()
        self.release.wait(30.0)
        try:
            return super().launch(request)
        finally:
            self.returned.set()

    def list_owned(self, prefix=None):
        owned = super().list_owned(prefix) if prefix is not None else super().list_owned()
        now = self.clock()
        if self.running.is_set() and self.first_list is None:
            self.first_list = now  # the controller's first listing after the cancel
        if (self.first_list is not None and not self.release.is_set()
                and now - self.first_list >= self.abandon_after):
            self.release.set()  # the launch returns right after the listing was taken
            assert self.returned.wait(10.0)
        return owned

    def terminate(self, handle):
        self.terminate_threads.append(threading.current_thread().name)
        if self.fails > 0:
            self.fails -= 1
            self.terminate_waiting.set()
            self.gate.wait(2.0)
            raise perr.Transient("429 Too Many Requests", provider="fake")
        return super().terminate(handle)


def test_the_late_terminate_runs_off_the_loop_and_the_loop_keeps_ticking(tmp_path):
    from providers.fake import FakeOfferTemplate

    clock = VirtualClock()
    cloud = LateReturnCloud(clock, offers=[FakeOfferTemplate("fake-east", "H100", False, PRICE)],
                            provision_seconds=60, autodown_seconds=None, terminate_seconds=0)
    store = StateStore(tmp_path / "state.db")
    c = Controller(_spec(tmp_path), store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.05,
                   write_lease=False)
    cloud.abandon_after = c.stop_grace
    loop = threading.current_thread().name
    ticks_while_terminating = []

    def on_tick(ctl):
        assert cloud.running.wait(10.0)
        if ctl.state != "STOPPING":
            store.request_action("slowlaunch", "stop")
        if cloud.terminate_waiting.is_set() and not cloud.gate.is_set():
            ticks_while_terminating.append(clock.now())
            if len(ticks_while_terminating) >= 3:
                cloud.gate.set()

    try:
        assert c.run(on_tick=on_tick) == "CANCELLED"
    finally:
        cloud.release.set()
        cloud.gate.set()
    assert cloud.terminate_threads and loop not in cloud.terminate_threads, cloud.terminate_threads
    assert len(ticks_while_terminating) >= 3  # the loop ticked while the terminate was retried
    # Nothing left billing, and the job was not recorded finished before the terminate confirmed.
    assert cloud.running_instances() == []
    bill = cloud.bill()
    (row,) = bill["rows"]
    job = store.get_job("slowlaunch")
    assert job["finished_at"] >= row["end"]
    # Booked from the launch request to the confirmed terminate: the bill (from creation), plus at
    # most the time the launch ran before it created the instance.
    booked = store.spend_total("slowlaunch")
    t0 = store.attempts("slowlaunch")[0]["created"]
    assert row["start"] > t0
    assert booked == pytest.approx(bill["total_usd"] + PRICE * (row["start"] - t0) / 3600, abs=1e-6)
    assert store.attempts("slowlaunch")[0]["outcome"] == "abandoned"


class ReturnsAfterTheRunCloud(FakeProvider):
    """A launch still in the SDK when the run ends, which returns (creating its instance) just
    after; a slow terminate API; ``close`` records whether anything still billed then."""

    def __init__(self, clock, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.release = threading.Event()
        self.running = threading.Event()
        self.returned = threading.Event()
        self.live_at_close: list[int] = []

    def launch(self, request):
        self.running.set()
        self.release.wait(30.0)
        try:
            return super().launch(request)
        finally:
            self.returned.set()

    def terminate(self, handle):
        threading.Event().wait(0.5)  # a slow API call
        return super().terminate(handle)

    def close(self) -> None:
        self.live_at_close.append(len(self.running_instances()))


def test_close_waits_for_the_late_terminate_and_the_booking_covers_it(tmp_path):
    cloud, store, _ = _late_run(tmp_path)  # the stuck launch returns ten minutes after the run
    assert cloud.live_at_close == [0], "the providers were closed while the late instance still billed"
    assert cloud.running_instances() == []
    bill = cloud.bill()
    (row,) = bill["rows"]
    t0 = store.attempts("slowlaunch")[0]["created"]
    # booked from the launch request to the confirmed terminate (extended past the run's end)
    assert store.spend_total("slowlaunch") == pytest.approx(PRICE * (row["end"] - t0) / 3600, abs=1e-6)


class LateTerminateTroubleCloud(ReturnsAfterTheRunCloud):
    """As above, but the late terminate's first ``fail`` calls are not confirmed (then it works),
    or each terminate call takes ``slow`` real seconds."""

    def __init__(self, clock, fail: int = 0, slow: float = 0.0, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.fail, self.slow = fail, slow

    def terminate(self, handle):
        if self.slow:
            threading.Event().wait(self.slow)
        if self.fail > 0:
            self.fail -= 1
            raise perr.TerminateNotConfirmed("still shutting down", provider="fake")
        return super(ReturnsAfterTheRunCloud, self).terminate(handle)


def _late_run(tmp_path, cloud_cls=None, **cloud_kw):
    """The run whose launch returns ten minutes after it was recorded CANCELLED (fake cloud of
    ``cloud_cls``, default ReturnsAfterTheRunCloud). Returns (cloud, store, events)."""
    from providers.fake import FakeOfferTemplate

    clock = VirtualClock()
    cloud = (cloud_cls or ReturnsAfterTheRunCloud)(
        clock, offers=[FakeOfferTemplate("fake-east", "H100", False, PRICE)], provision_seconds=60,
        autodown_seconds=None, terminate_seconds=0, **cloud_kw)
    store = StateStore(tmp_path / "state.db")
    events: list[tuple[str, str]] = []

    def on_event(type_, message):
        events.append((type_, message))
        if type_ == "state" and message.startswith("CANCELLED"):
            clock.advance(600)
            cloud.release.set()
            assert cloud.returned.wait(10.0)

    c = Controller(_spec(tmp_path), store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.05,
                   write_lease=False, on_event=on_event)

    def on_tick(_c):
        assert cloud.running.wait(10.0)
        store.request_action("slowlaunch", "stop")

    try:
        assert c.run(on_tick=on_tick) == "CANCELLED"
    finally:
        cloud.release.set()
    return cloud, store, events


def test_a_late_terminate_that_gives_up_after_the_run_is_swept_not_left_billing(tmp_path, monkeypatch):
    # Review finding: the launch returned after the run was recorded CANCELLED and its late
    # terminate gave up: the orphan sweep had already run (in _finish), so the instance kept
    # billing with no warning.
    monkeypatch.setattr(launchthread, "ABANDON_TERMINATE_TRIES", 2)
    cloud, store, events = _late_run(tmp_path, LateTerminateTroubleCloud, fail=2)
    assert cloud.running_instances() == [], events[-5:]
    assert any(t == "orphan" for t, _ in events), events[-5:]
    assert store.spend_total("slowlaunch") > 0


def test_providers_stay_open_while_a_late_terminate_is_still_retried(tmp_path, monkeypatch):
    # Review finding: after the bounded wait the providers were closed (SkyPilot: its API server
    # stopped) under a terminate still in flight, with no word to the user.
    monkeypatch.setattr(teardown, "ABANDON_CLOSE_WAIT_S", 0.2)
    cloud, store, events = _late_run(tmp_path, LateTerminateTroubleCloud, slow=1.5)
    assert cloud.live_at_close == [], "closed under a terminate in flight"
    assert any(t == "warning" and "dtrun gc" in m for t, m in events), events[-5:]

"""Launches run off the controller's loop (any provider): while ``provider.launch`` is in flight
the budget guard, the deadline, ``recovery.max_recovery_minutes`` and ``dtrun down`` still act,
and cancelling the launch terminates what it created (found by its deterministic name).

The provider is the fake cloud (no real cloud can run offline) with a launch that creates its
instance — billing from then on — and then blocks for a virtual 10 minutes, like a slow
``sky.launch``. Before launches ran in a thread, the loop waited those 10 minutes and the bill
ran past the budget.
"""

from __future__ import annotations

import threading

import pytest

from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.plan.spec import parse_spec
from orchestrator.run.state import StateStore
from providers.fake import FakeOfferTemplate, FakeProvider

BLOCK_S = 600.0
PRICE = 60.0  # USD per GPU-hour: $1 a minute


class SlowLaunchCloud(FakeProvider):
    """The fake cloud whose ``launch`` creates the instance, then blocks until the (virtual)
    clock is ``BLOCK_S`` past the request. If nothing moves the clock (a controller stuck inside
    ``launch``), after a real 2 s it moves the clock itself, as 10 minutes of provisioning would."""

    def __init__(self, clock: VirtualClock, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.vclock = clock
        self.created = threading.Event()
        self.returned = threading.Event()
        self.release = threading.Event()
        self.until = 0.0
        clock.on_advance.append(self._tick)

    def _tick(self, t: float) -> None:
        if self.until and t >= self.until:
            self.release.set()

    def launch(self, request):
        t0 = self.vclock.now()
        self.until = t0 + BLOCK_S
        handle = super().launch(request)
        self.created.set()
        if not self.release.wait(2.0):
            self.vclock.advance(max(0.0, self.until - self.vclock.now()))
        self.returned.set()
        return handle


def _spec(tmp_path, **over):
    d = {
        "name": "slowlaunch",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1, "spot": False},
        "trainer": {"model": "tiny", "steps": 1000, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 100},
        "budget": {"max_usd": 5.0},
        "recovery": {"poll_seconds": 30, "backoff_seconds": 10, "heartbeat_timeout_seconds": 300},
    }
    d.update(over)
    return parse_spec(d)


@pytest.fixture
def world(tmp_path):
    clock = VirtualClock()
    cloud = SlowLaunchCloud(clock, offers=[FakeOfferTemplate("fake-east", "H100", False, PRICE)],
                            provision_seconds=60, autodown_seconds=None, terminate_seconds=0)
    store = StateStore(tmp_path / "state.db")
    yield dict(clock=clock, cloud=cloud, store=store, tmp=tmp_path)
    cloud.release.set()


def _wait_created(cloud):
    def on_tick(_c):
        assert cloud.created.wait(10.0), "the launch never created its instance"
    return on_tick


def test_budget_guard_stops_a_job_whose_launch_is_still_in_flight(world):
    clock, cloud, store = world["clock"], world["cloud"], world["store"]
    spec = _spec(world["tmp"])
    c = Controller(spec, store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.05,
                   write_lease=False)
    t0 = clock.now()
    assert c.run(on_tick=_wait_created(cloud)) == "OVER_BUDGET"
    guard = [e for e in store.events("slowlaunch") if e["type"] == "guard"]
    assert guard, "the budget guard never acted"
    # $5 at $1/min with a 30 s tick and a 120 s stop window: the guard acts at the first tick
    # whose projection crosses (t0 + 150 s), within one tick, long before the launch returns.
    crossing = t0 + (5.0 - (30 + 120) / 60.0) * 60.0
    assert guard[0]["time"] <= crossing + 30
    assert guard[0]["time"] < t0 + BLOCK_S
    # Nothing left billing: the instance the launch created was found and terminated (confirmed).
    assert cloud.running_instances() == []
    bill = cloud.bill()
    assert len(bill["rows"]) == 1 and not bill["rows"][0]["live"]
    assert bill["total_usd"] <= 5.0
    assert bill["rows"][0]["end"] < t0 + BLOCK_S
    # What dtrun booked is what the cloud billed (from the launch request to the confirmed end).
    assert store.spend_total("slowlaunch") == pytest.approx(bill["total_usd"], abs=0.02)
    nodes = store.nodes("slowlaunch")
    assert len(nodes) == 1 and nodes[0]["terminated_at"] is not None
    # The launch call returns later; the worker leaves nothing behind.
    cloud.release.set()
    assert cloud.returned.wait(10.0)
    assert cloud.running_instances() == []


def test_down_during_an_in_flight_launch_cancels_it(world):
    clock, cloud, store = world["clock"], world["cloud"], world["store"]
    spec = _spec(world["tmp"], budget={"max_usd": 1000.0})
    c = Controller(spec, store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.05,
                   write_lease=False)
    t0 = clock.now()
    asked = []

    def on_tick(ctl):
        assert cloud.created.wait(10.0)
        if not asked and clock.now() >= t0 + 60:
            store.request_action("slowlaunch", "stop")
            asked.append(clock.now())

    assert c.run(on_tick=on_tick) == "CANCELLED"
    assert cloud.running_instances() == []
    end = cloud.bill()["rows"][0]["end"]
    assert end <= asked[0] + 30  # within one tick of `dtrun down`
    assert any(e["type"] == "cancel" and "launch in flight" in e["message"] for e in store.events("slowlaunch"))


def test_a_launch_longer_than_max_recovery_minutes_is_cancelled(world):
    clock, cloud, store = world["clock"], world["cloud"], world["store"]
    spec = _spec(world["tmp"], budget={"max_usd": 1000.0},
                 recovery={"poll_seconds": 30, "backoff_seconds": 10, "heartbeat_timeout_seconds": 300,
                           "max_recovery_minutes": 3})
    c = Controller(spec, store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.05,
                   write_lease=False)
    t0 = clock.now()
    assert c.run(on_tick=_wait_created(cloud)) == "FAILED"
    job = store.get_job("slowlaunch")
    assert "max_recovery_minutes" in job["reason"]
    assert cloud.running_instances() == []
    assert cloud.bill()["rows"][0]["end"] <= t0 + 3 * 60 + 2 * 30  # the bound, within a tick or two


class StuckBeforeCreateCloud(FakeProvider):
    """A launch that creates nothing for a long (real) while — SkyPilot's optimizer and request
    queue, Modal's image build — and records whether ``close()`` came while it still ran."""

    def __init__(self, clock: VirtualClock, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.release = threading.Event()
        self.running = threading.Event()
        self.returned = threading.Event()
        self.closed_while_launching: list[bool] = []

    def launch(self, request):
        self.running.set()
        self.release.wait(30.0)
        try:
            return super().launch(request)
        finally:
            self.running.clear()
            self.returned.set()

    def close(self) -> None:
        self.closed_while_launching.append(self.running.is_set())


def test_close_waits_for_an_abandoned_launch(tmp_path):
    """`dtrun down` while a launch has created nothing yet: after the stop grace the controller
    abandons the launch (its worker ends whatever it returns). The provider must not be closed
    under it (SkyPilot's close stops the API server the launch is talking to)."""
    clock = VirtualClock()
    cloud = StuckBeforeCreateCloud(clock, offers=[FakeOfferTemplate("fake-east", "H100", False, PRICE)],
                                   provision_seconds=60, autodown_seconds=None, terminate_seconds=0)
    store = StateStore(tmp_path / "state.db")
    spec = _spec(tmp_path, budget={"max_usd": 1000.0})
    c = Controller(spec, store, clock=clock, providers={"fake": cloud}, launch_wait_seconds=0.05,
                   write_lease=False)

    def on_tick(_c):
        assert cloud.running.wait(10.0)
        store.request_action("slowlaunch", "stop")

    try:
        assert c.run(on_tick=on_tick) == "CANCELLED"
        assert not any(cloud.closed_while_launching), "provider closed under a launch still running"
    finally:
        cloud.release.set()
    assert cloud.returned.wait(10.0)
    for t in threading.enumerate():
        if t.name.startswith("dtrun-launch-"):
            t.join(10.0)
    assert cloud.running_instances() == []  # the worker ended what the late launch created


class ClosingCloud(FakeProvider):
    def __init__(self, clock: VirtualClock, **kw) -> None:
        super().__init__(clock=clock, **kw)
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_close_runs_when_start_fails_after_using_the_providers(tmp_path):
    """``Controller.run`` whose start fails after the orphan sweep already used the providers (here
    the run URI cannot be written): the providers are closed all the same (SkyPilot: the API server
    the sweep started is stopped), not only when the loop ran."""
    clock = VirtualClock()
    cloud = ClosingCloud(clock, offers=[FakeOfferTemplate("fake-east", "H100", False, PRICE)],
                         provision_seconds=60, autodown_seconds=None, terminate_seconds=0)
    (tmp_path / "run").write_text("a file where the run directory should be\n")
    store = StateStore(tmp_path / "state.db")
    c = Controller(_spec(tmp_path), store, clock=clock, providers={"fake": cloud}, write_lease=False)
    from orchestrator.run.uricheck import UriRefused

    with pytest.raises(UriRefused):  # the job ends FAILED, exit 6 (was: the bare OSError)
        c.run()
    assert cloud.closed == 1
    assert store.get_job(c.spec.name)["state"] == "FAILED"

"""The chaos suite on the fake cloud: the real controller on a virtual clock, a modelled node
writing progress / COMMITTED / DONE into a real (temp-dir) run URI, and faults in between.

After every scenario: the fake cloud's bill shows no instance running, total spend ≤ budget +
one tick's spend, and the job's state says why it ended."""

from __future__ import annotations

import pytest

from orchestrator.contract import runuri
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.simulate import Model, Simulation
from orchestrator.plan.spec import parse_spec
from orchestrator.run.state import TERMINAL_STATES, StateStore
from orchestrator.run.sweep import sweep_orphans
from providers import registry
from providers.fake import FakeProvider

POLL = 10.0
PROVISION = 60.0


class Killed(BaseException):
    """What SIGKILL does to a controller: it stops between two statements, no cleanup."""


class World:
    def __init__(self, tmp_path, *, spot=False, steps=600, budget=None, max_hours=None, preempt_rate=0.0,
                 terminate_seconds=0.0, idle_minutes=None):
        self.clock = VirtualClock()
        self.cloud = FakeProvider(clock=self.clock, provision_seconds=PROVISION, autodown_seconds=0.0,
                                  terminate_seconds=terminate_seconds, preemptions_per_hour=preempt_rate, seed=5)
        self.uri = "file://" + str(tmp_path / "run")
        d = {
            "name": "chaos",
            "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1, "spot": spot},
            "trainer": {"model": "gpt2-124m", "steps": steps, "batch_size": 8, "seq_len": 128},
            "checkpoint": {"uri": self.uri, "every_steps": 50},
            "budget": {k: v for k, v in (("max_usd", budget), ("max_hours", max_hours)) if v is not None},
            "recovery": {"poll_seconds": POLL, "backoff_seconds": 5, "heartbeat_timeout_seconds": 120},
        }
        if idle_minutes is not None:
            d["teardown"] = {"idle_minutes": idle_minutes}
        self.spec = parse_spec(d)
        self.model = Model(total_steps=steps, step_s=1.0, every=50, save_s=1.0, load_s=5.0, compile_s=0.0,
                           provision_s=PROVISION)
        self.node = Simulation(self.model, self.cloud, self.uri)
        self.clock.on_advance.append(self.node.hook)
        self.store = StateStore(tmp_path / "state.db")
        registry.register("fake", self.cloud)

    def controller(self, cloud=None) -> Controller:
        return Controller(self.spec, self.store, clock=self.clock, providers={"fake": cloud or self.cloud})

    def drive(self, ctl: Controller, until, max_ticks: int = 5000) -> str:
        """Tick until ``until(state)`` holds (then return, as if killed there) or a final state."""
        ctl.start()
        for _ in range(max_ticks):
            state = ctl.tick()
            if until(state) or state in TERMINAL_STATES:
                return state
            self.clock.sleep(ctl.poll)
        raise AssertionError(f"still {state} after {max_ticks} ticks")

    def job(self) -> dict:
        return self.store.get_job(self.spec.name)

    def price(self) -> float:
        a = self.store.attempts(self.spec.name)
        return max((x["offer"]["price_per_gpu_hour"] * x["offer"]["gpus_per_node"] for x in a), default=0.0)

    def check(self, state: str, reason_has: str = "") -> None:
        job = self.job()
        assert job["state"] == state, (job["state"], job["reason"])
        assert job["reason"], "the job's state must say why it ended"
        assert reason_has.lower() in job["reason"].lower(), job["reason"]
        assert self.cloud.running_instances() == [], "an instance is still billing"
        bill = self.cloud.bill()["total_usd"]
        if self.spec.budget.max_usd is not None:
            assert bill <= self.spec.budget.max_usd + self.price() * POLL / 3600 + 1e-9
        # the controller's books never under-count the cloud's bill (more than a tick per attempt);
        # they over-count only for time it was dead and could not see the node go
        booked = self.store.spend_total(self.spec.name)
        n = len(self.store.attempts(self.spec.name))
        assert booked >= bill - n * self.price() * POLL / 3600 - 1e-9, (booked, bill)
        self.booked, self.bill = booked, bill


@pytest.fixture
def world_factory(tmp_path, dtrun_home):
    made = []

    def make(**kw) -> World:
        w = World(tmp_path / f"w{len(made)}", **kw)
        made.append(w)
        return w

    yield make
    registry.unregister("fake")
    for w in made:
        w.store.close()


# ---- the controller dies (SIGKILL) in every lifecycle state, then `dtrun up` again ----------------

@pytest.mark.parametrize("kill_in", ["PENDING", "PROVISIONING", "RUNNING", "RECOVERING", "STOPPING"])
def test_controller_killed_in_each_state_then_restarted(world_factory, kill_in):
    w = world_factory(spot=True)
    ctl = w.controller()
    if kill_in == "PENDING":
        ctl.start()
        assert w.job()["state"] == "PENDING"
    elif kill_in == "RECOVERING":
        w.drive(ctl, lambda s: s == "RUNNING" and (w.job()["step"] or 0) >= 120)
        w.cloud.preempt(w.store.nodes("chaos", live_only=True)[0]["instance_id"])
        w.clock.sleep(POLL)
        assert w.drive(ctl, lambda s: s == "RECOVERING") == "RECOVERING"
    elif kill_in == "STOPPING":
        w.drive(ctl, lambda s: s == "RUNNING" and (w.job()["step"] or 0) >= 100)
        w.store.request_action("chaos", "stop")
        assert w.drive(ctl, lambda s: s == "STOPPING") == "STOPPING"
        assert runuri.exists(runuri.join(w.uri, runuri.STOP))
    else:
        assert w.drive(ctl, lambda s: s == kill_in) == kill_in
    del ctl  # killed: no cleanup ran
    w.clock.sleep(300)  # the laptop sleeps; the node (if any) goes on by itself
    final = w.controller().run()
    if kill_in == "STOPPING":
        assert final == "CANCELLED"
        w.check("CANCELLED", "down")
        assert runuri.latest_committed(w.uri) is not None  # the STOP checkpoint
    else:
        assert final == "SUCCEEDED"
        w.check("SUCCEEDED", "DONE")
        assert runuri.read_json(runuri.join(w.uri, runuri.DONE))["step"] == 600
    assert any(e["type"] == "reattach" for e in w.store.events("chaos"))


def test_killed_between_launch_and_record_is_swept_at_restart(world_factory):
    w = world_factory()

    real_launch = w.cloud.launch

    def launch_then_die(req):
        real_launch(req)  # the instance exists and bills
        raise Killed()

    ctl = w.controller()
    w.cloud.launch = launch_then_die
    with pytest.raises(Killed):
        w.drive(ctl, lambda s: False)
    w.cloud.launch = real_launch
    assert [i.name for i in w.cloud.running_instances()] == ["dtrun-chaos-a1"]
    assert w.store.nodes("chaos") == []  # never recorded
    w.clock.sleep(120)
    assert w.controller().run() == "SUCCEEDED"
    w.check("SUCCEEDED")
    ev = [e["message"] for e in w.store.events("chaos") if e["type"] == "orphan"]
    assert ev and "dtrun-chaos-a1" in ev[0]
    orphan = [r for r in w.cloud.bill()["rows"] if r["name"] == "dtrun-chaos-a1"][0]
    assert orphan["seconds"] <= 120 + POLL  # billed only until the restarted controller swept it


def test_created_but_never_recorded_by_a_timed_out_launch_is_swept(world_factory):
    w = world_factory()
    # the create call "times out" (Transient) but the cloud made the instance anyway
    w.cloud.inject("launch", "Transient", count=1, create=True)
    ctl = w.controller()
    # killed right after the failed launch (a live controller sweeps it before its next launch)
    w.drive(ctl, lambda s: s == "RECOVERING")
    ghost = [i for i in w.cloud.running_instances() if i.name == "dtrun-chaos-a1"]
    assert ghost and w.store.attempts("chaos")[0]["outcome"] == "launch_error"
    del ctl  # the controller dies; `dtrun up` again
    w.clock.sleep(30)
    assert w.controller().run() == "SUCCEEDED"
    w.check("SUCCEEDED")
    row = [r for r in w.cloud.bill()["rows"] if r["name"] == "dtrun-chaos-a1"][0]
    assert row["end"] is not None and row["seconds"] <= 30 + 2 * POLL + 5 + 1
    assert any("dtrun-chaos-a1" in e["message"] for e in w.store.events("chaos") if e["type"] == "orphan")


def test_gc_catches_a_ghost_of_a_finished_job(world_factory):
    w = world_factory()
    assert w.controller().run() == "SUCCEEDED"
    from providers.base import LaunchRequest, Offer

    w.cloud.launch(LaunchRequest(job="chaos", attempt=9, offer=Offer("fake", "fake-east", "H100", 1, False, 2.49),
                                 nodes=1, command=["x"], owner=w.store.owner_id))  # launched by this store
    swept = sweep_orphans(w.store, ["fake"], providers={"fake": w.cloud}, clock=w.clock)
    assert [i.name for i in swept] == ["dtrun-chaos-a9"]
    assert w.cloud.running_instances() == []


# ---- provider faults ------------------------------------------------------------------------------

def test_terminate_failing_transiently_is_retried_until_confirmed(world_factory):
    w = world_factory(terminate_seconds=45.0)
    w.cloud.inject("terminate", "Transient", count=4)
    assert w.controller().run() == "SUCCEEDED"
    w.check("SUCCEEDED")
    nodes = w.store.nodes("chaos")
    assert all(n["terminated_at"] is not None for n in nodes)
    # recorded terminated only once the cloud confirmed it gone
    for n in nodes:
        inst = w.cloud.instance(n["instance_id"])
        assert inst.gone_at is not None and n["terminated_at"] >= inst.gone_at - 1e-6


def test_cancel_during_recovery_leaves_nothing_billing(world_factory):
    w = world_factory(spot=True)
    ctl = w.controller()
    w.drive(ctl, lambda s: s == "RUNNING" and (w.job()["step"] or 0) >= 100)
    w.cloud.preempt(w.store.nodes("chaos", live_only=True)[0]["instance_id"])
    # recovery relaunches; cancel while the new attempt is still provisioning (SkyPilot #4410)
    w.drive(ctl, lambda s: s == "PROVISIONING" and len(w.store.attempts("chaos")) == 2)
    assert len(w.cloud.running_instances()) == 1
    w.store.request_action("chaos", "stop")
    assert w.drive(ctl, lambda s: False) == "CANCELLED"
    w.check("CANCELLED")


def test_cancel_while_recovering_before_the_relaunch(world_factory):
    w = world_factory(spot=True)
    ctl = w.controller()
    w.drive(ctl, lambda s: s == "RUNNING" and (w.job()["step"] or 0) >= 100)
    w.cloud.preempt(w.store.nodes("chaos", live_only=True)[0]["instance_id"])
    w.clock.sleep(POLL)
    w.drive(ctl, lambda s: s == "RECOVERING")
    w.store.request_action("chaos", "stop")
    assert w.drive(ctl, lambda s: False) == "CANCELLED"
    w.check("CANCELLED")
    assert len(w.store.attempts("chaos")) == 1


# ---- money and time limits ------------------------------------------------------------------------

def test_budget_crossed_mid_run_stops_with_a_checkpoint(world_factory):
    # H100 on-demand in the fake cloud: $2.49/h; 600 steps ≈ 11 min + 1 min provisioning ≈ $0.50
    w = world_factory(budget=0.25, steps=600)
    assert w.controller().run() == "OVER_BUDGET"
    w.check("OVER_BUDGET", "budget")
    assert runuri.read_json(runuri.join(w.uri, runuri.DONE)) is None
    assert runuri.latest_committed(w.uri) is not None


def test_budget_crossed_under_a_preemption_storm(world_factory):
    w = world_factory(spot=True, budget=0.20, steps=3000, preempt_rate=6.0)
    final = w.controller().run()
    assert final == "OVER_BUDGET"
    w.check("OVER_BUDGET", "budget")
    assert len(w.store.attempts("chaos")) >= 2


def test_deadline_reached(world_factory):
    w = world_factory(steps=5000, max_hours=0.25)
    assert w.controller().run() == "OVER_BUDGET"
    w.check("OVER_BUDGET", "deadline")
    job = w.job()
    assert job["finished_at"] - job["started_at"] <= 0.25 * 3600 + POLL


def test_idle_node_is_torn_down(world_factory):
    w = world_factory(idle_minutes=3)
    # the node's trainer hangs after provisioning: never starts training
    w.model = w.node.m = Model(total_steps=600, step_s=1.0, every=50, save_s=1.0, load_s=5.0,
                               compile_s=10_000.0, provision_s=PROVISION)
    final = w.controller().run()
    assert final == "FAILED"
    w.check("FAILED", "idle")

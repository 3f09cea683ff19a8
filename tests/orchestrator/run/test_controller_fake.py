"""The controller against the fake cloud on a virtual clock: hours of job time in milliseconds.

Fake nodes run no trainer; ``SimTrainer`` (a fake-cloud ``workload``) plays one through the real
run-URI contract: progress.json heartbeats, COMMITTED checkpoints every k steps, STOP honoured
with a checkpoint, DONE at the end, and a resume from the newest COMMITTED step.
"""

from __future__ import annotations

import json

import pytest

from orchestrator.contract import runuri
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.startup import ControllerBusy
from orchestrator.plan.spec import parse_spec
from orchestrator.run.state import StateStore
from providers.fake import FakeOfferTemplate, FakeProvider

OFFERS = [
    FakeOfferTemplate("fake-east", "H100", True, 1.0),
    FakeOfferTemplate("fake-west", "H100", True, 1.5),
    FakeOfferTemplate("fake-north", "H100", True, 2.0),
]


class SimTrainer:
    """A trainer on fake nodes: one step every ``step_s`` seconds from the node's ready time."""

    def __init__(self, steps: int, step_s: float, every: int) -> None:
        self.steps, self.step_s, self.every = steps, step_s, every
        self.resumed: dict[str, int] = {}
        self.hang: set[int] = set()     # attempts whose trainer stops heartbeating
        self.stall: set[int] = set()    # attempts that heartbeat but never step

    def __call__(self, inst, now):
        uri = inst.env["DTRUN_RUN_URI"]
        attempt = int(inst.env["DTRUN_ATTEMPT"])
        if inst.id not in self.resumed:
            lc = runuri.latest_committed(uri)
            self.resumed[inst.id] = lc[0] if lc else 0
        s0 = self.resumed[inst.id]
        if attempt in self.hang:
            return None
        step = s0 if attempt in self.stall else min(self.steps, s0 + int((now - inst.ready_at) / self.step_s))
        for k in range(s0 + 1, step + 1):
            if k % self.every == 0 or k == self.steps:
                self._commit(uri, k, now)
        if runuri.exists(runuri.join(uri, runuri.STOP)) and step < self.steps:
            self._commit(uri, step, now)
            self._progress(uri, step, attempt, now)
            return 0
        self._progress(uri, step, attempt, now)
        if step >= self.steps:
            runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "loss": 1.0, "tokens": step, "time": now})
            return (0, inst.ready_at + (self.steps - s0) * self.step_s)
        return None

    def _commit(self, uri, k, now):
        c = runuri.join(runuri.checkpoint_uri(uri, k), runuri.COMMITTED)
        if not runuri.exists(c):
            runuri.write_json(c, {"step": k, "time": now})

    def _progress(self, uri, step, attempt, now):
        lc = runuri.latest_committed(uri)
        runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                          {"step": step, "steps": self.steps, "loss": 2.0, "tokens_per_s": 100.0, "time": now,
                           "attempt": attempt, "last_committed_step": lc[0] if lc else None})


def make_spec(tmp_path, **over):
    d = {
        "name": "fakejob",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1, "spot": True},
        "trainer": {"model": "tiny", "steps": 1000, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 100},
        "budget": {"max_usd": 100.0},
        "recovery": {"poll_seconds": 30, "backoff_seconds": 10, "heartbeat_timeout_seconds": 300},
    }
    for k, v in over.items():
        d.setdefault(k, {}).update(v) if isinstance(v, dict) else d.__setitem__(k, v)
    return parse_spec(d)


@pytest.fixture
def world(tmp_path):
    clock = VirtualClock()
    sim = SimTrainer(steps=1000, step_s=10.0, every=100)
    cloud = FakeProvider(clock=clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None, workload=sim)
    store = StateStore(tmp_path / "state.db")

    def make(spec=None, **kw):
        return Controller(spec or make_spec(tmp_path), store, clock=clock, providers={"fake": cloud}, **kw)

    return dict(clock=clock, sim=sim, cloud=cloud, store=store, make=make, tmp=tmp_path)


def running(cloud):
    return [i for i in cloud.instances() if i.gone_at is None]


def test_runs_to_succeeded_and_books_spend_like_the_bill(world):
    c = world["make"]()
    assert c.run() == "SUCCEEDED"
    job = world["store"].get_job("fakejob")
    assert job["step"] == 1000 and job["reason"] == "training finished (DONE)"
    assert running(world["cloud"]) == []
    bill = world["cloud"].bill()
    # spend booked from the launch request (provisioning included) to the confirmed terminate
    assert world["store"].spend_total("fakejob") == pytest.approx(bill["total_usd"], abs=0.01)
    assert world["store"].spend_total("fakejob") > 1.0 * (60 + 10000) / 3600 - 0.01
    assert c.summary()["attempts"] == 1
    assert runuri.read_text(runuri.join(c.run_uri, "job.yaml")).startswith("name: fakejob")
    lease = runuri.read_json(runuri.join(c.run_uri, runuri.LEASE))
    assert lease["expires"] == pytest.approx(lease["renewed"] + 90)
    assert all(n["terminated_at"] is not None for n in world["store"].nodes("fakejob"))


def test_preemption_storm_resumes_from_checkpoints_until_done(world):
    cloud, clock = world["cloud"], world["clock"]
    for a in range(1, 6):  # five preemptions in a row, each 25 min into the attempt
        cloud.script(f"dtrun-fakejob-a{a}", preempt_after=1500)
    c = world["make"]()
    assert c.run() == "SUCCEEDED"
    store = world["store"]
    atts = store.attempts("fakejob")
    assert [a["outcome"] for a in atts] == ["preempted"] * 5 + ["succeeded"]
    assert all(a["offer"]["region"] == "fake-east" for a in atts)  # same offer after a preemption
    # each attempt resumed from the newest COMMITTED step of the one before
    assert [a["start_step"] for a in atts] == [None, 100, 200, 300, 400, 500]
    assert 5 * 45 <= store.get_job("fakejob")["steps_lost"] <= 5 * 50  # seen at poll granularity (3 steps)
    assert running(cloud) == []
    assert store.spend_total("fakejob") == pytest.approx(cloud.bill()["total_usd"], abs=0.01)


def test_capacity_errors_fail_over_to_the_next_offer(world):
    cloud = world["cloud"]
    cloud.inject("launch", "NoCapacity", count=None, match="fake-east")
    cloud.inject("launch", "QuotaExceeded", count=1, match="fake-west")
    c = world["make"]()
    assert c.run() == "SUCCEEDED"
    atts = world["store"].attempts("fakejob")
    assert [(a["offer"]["region"], a["outcome"]) for a in atts] == [
        ("fake-east", "no_capacity"), ("fake-west", "no_capacity"), ("fake-north", "succeeded")]
    assert running(cloud) == []


def test_transient_errors_in_launch_and_terminate_are_retried(world):
    cloud = world["cloud"]
    cloud.inject("launch", "Transient", count=2)
    cloud.inject("terminate", "Transient", count=3)
    cloud.configure(terminate_seconds=30)
    c = world["make"]()
    assert c.run() == "SUCCEEDED"
    atts = world["store"].attempts("fakejob")
    assert [a["outcome"] for a in atts] == ["launch_error", "launch_error", "succeeded"]
    assert running(cloud) == []
    ev = [e["message"] for e in world["store"].events("fakejob") if e["type"] == "terminate"]
    assert any("not confirmed" in m for m in ev) and ev[-1].endswith("terminated (confirmed)")
    assert world["store"].spend_total("fakejob") == pytest.approx(cloud.bill()["total_usd"], abs=0.01)


def test_budget_crossed_mid_run_stops_before_crossing(world, tmp_path):
    spec = make_spec(tmp_path, budget={"max_usd": 1.0})   # $1/h → about an hour of a 2.8 h job
    c = world["make"](spec)
    assert c.run() == "OVER_BUDGET"
    job = world["store"].get_job("fakejob")
    assert job["reason"].startswith("budget:")
    assert running(world["cloud"]) == []
    assert world["store"].spend_total("fakejob") <= 1.0
    assert world["cloud"].bill()["total_usd"] <= 1.0 + 1.0 * 30 / 3600  # + one tick
    # graceful: the trainer honoured STOP with a checkpoint at the step it reached
    lc = runuri.latest_committed(c.run_uri)
    assert lc is not None and lc[0] == job["step"]


def test_deadline_stops_the_run(world, tmp_path):
    spec = make_spec(tmp_path, budget={"max_hours": 1.0})
    c = world["make"](spec)
    assert c.run() == "OVER_BUDGET"
    job = world["store"].get_job("fakejob")
    assert job["reason"].startswith("deadline")
    assert job["finished_at"] <= job["deadline"]
    assert running(world["cloud"]) == []


def test_idle_trainer_is_torn_down(world, tmp_path):
    world["sim"].stall.add(1)
    spec = make_spec(tmp_path, teardown={"idle_minutes": 20})
    c = world["make"](spec)
    assert c.run() == "FAILED"
    assert world["store"].get_job("fakejob")["reason"].startswith("idle")
    assert running(world["cloud"]) == []


def test_stale_heartbeat_counts_as_lost_and_relaunches(world):
    world["sim"].hang.add(1)
    c = world["make"]()
    assert c.run() == "SUCCEEDED"
    atts = world["store"].attempts("fakejob")
    assert atts[0]["outcome"] == "lost" and "no heartbeat" in atts[0]["reason"]
    assert atts[-1]["outcome"] == "succeeded"


def test_trainer_crashes_restart_then_fail_with_reason(world, tmp_path):
    cloud = world["cloud"]
    for a in range(1, 5):
        cloud.script(f"dtrun-fakejob-a{a}", exit_after=300, exit_code=1)
    spec = make_spec(tmp_path, recovery={"max_restarts_on_errors": 2})
    c = world["make"](spec)
    assert c.run() == "FAILED"
    job = world["store"].get_job("fakejob")
    assert "max_restarts_on_errors = 2" in job["reason"] and "job exited with code 1" in job["reason"]
    assert len(world["store"].attempts("fakejob")) == 3
    assert running(cloud) == []


def test_recovery_is_bounded_by_max_attempts(world, tmp_path):
    world["cloud"].inject("launch", "NoCapacity", count=None)
    spec = make_spec(tmp_path, recovery={"max_attempts": 7})
    c = world["make"](spec)
    assert c.run() == "FAILED"
    job = world["store"].get_job("fakejob")
    assert "recovery.max_attempts = 7" in job["reason"]
    assert len(world["store"].attempts("fakejob")) == 7


def test_recovery_is_bounded_in_time(world, tmp_path):
    world["cloud"].inject("launch", "NoCapacity", count=None)
    spec = make_spec(tmp_path, recovery={"max_recovery_minutes": 10, "max_attempts": 1000})
    c = world["make"](spec)
    assert c.run() == "FAILED"
    assert "max_recovery_minutes" in world["store"].get_job("fakejob")["reason"]


def test_cancel_during_recovery_leaves_nothing_running(world):
    cloud, store = world["cloud"], world["store"]
    cloud.script("dtrun-fakejob-a1", preempt_after=600)
    cloud.configure(terminate_seconds=20)
    c = world["make"]()
    c.start()
    while c.state != "RECOVERING":
        c.tick()
        world["clock"].sleep(5)
    store.request_action("fakejob", "stop")
    for _ in range(100):
        if c.tick() in ("CANCELLED",):
            break
        world["clock"].sleep(5)
    assert c.state == "CANCELLED"
    assert running(cloud) == []


def test_graceful_down_checkpoints_then_cancels(world):
    c = world["make"]()
    c.start()
    while c.state != "RUNNING" or (world["store"].get_job("fakejob")["step"] or 0) < 150:
        c.tick()
        world["clock"].sleep(5)
    world["store"].request_action("fakejob", "stop")
    assert c.run() == "CANCELLED"
    job = world["store"].get_job("fakejob")
    assert runuri.latest_committed(c.run_uri)[0] == job["step"] >= 150
    assert running(world["cloud"]) == []


def test_down_now_terminates_without_stop_file(world):
    c = world["make"]()
    c.start()
    for _ in range(30):
        c.tick()
        world["clock"].sleep(5)
    world["store"].request_action("fakejob", "stop_now")
    assert c.run() == "CANCELLED"
    assert not runuri.exists(runuri.join(c.run_uri, runuri.STOP))
    assert running(world["cloud"]) == []


def test_restarted_controller_reattaches_to_the_live_node(world):
    store, cloud = world["store"], world["cloud"]
    c1 = world["make"]()
    c1.start()
    for _ in range(40):
        c1.tick()
        world["clock"].sleep(5)
    assert c1.state == "RUNNING"
    # the first controller "dies" (no release); a second one with the same pid takes over
    c2 = world["make"]()
    assert c2.run() == "SUCCEEDED"
    assert len(store.attempts("fakejob")) == 1
    assert len(cloud.instances()) == 1
    assert any(e["type"] == "reattach" for e in store.events("fakejob"))


def test_a_second_live_controller_is_refused(world):
    store = world["store"]
    c1 = world["make"]()
    c1.start()
    store.update_job("fakejob", controller_pid=1)  # pid 1 is alive and is not us
    with pytest.raises(ControllerBusy):
        world["make"]().start()


def test_launch_request_env_and_no_secrets(world, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "sekrit")
    c = world["make"]()
    c.start()
    c.tick()
    inst = world["cloud"].instances()[0]
    env = inst.env
    assert env["DTRUN_ATTEMPT"] == "1" and env["DTRUN_JOB"] == "fakejob"
    assert env["DTRUN_RUN_URI"] == c.run_uri and env["DTRUN_NPROC_PER_NODE"] == "1"
    assert float(env["DTRUN_PRICE_PER_HOUR"]) == 1.0 and float(env["DTRUN_BUDGET_LEFT_USD"]) == 100.0
    assert "DTRUN_IDLE_MINUTES" in env
    dump = json.dumps([dict(r) for r in world["store"]._read("SELECT * FROM jobs")]) + \
        json.dumps(world["store"].events("fakejob")) + json.dumps(world["store"].nodes("fakejob"))
    assert "sekrit" not in dump
    world["store"].request_action("fakejob", "stop_now")
    assert c.run() == "CANCELLED"


def test_random_preemption_storm_with_flaky_api_still_finishes_and_leaks_nothing(world, tmp_path):
    cloud = world["cloud"]
    cloud.configure(preemptions_per_hour=3.0, transient_rate=0.05, seed=7, terminate_seconds=10)
    spec = make_spec(tmp_path, recovery={"max_attempts": 100})
    c = world["make"](spec)
    assert c.run() == "SUCCEEDED"
    atts = world["store"].attempts("fakejob")
    assert sum(a["outcome"] == "preempted" for a in atts) >= 3
    assert atts[-1]["outcome"] == "succeeded"
    assert running(cloud) == []
    # the guard books conservatively: a vanished node is paid until the controller saw it gone
    spend, bill = world["store"].spend_total("fakejob"), cloud.bill()["total_usd"]
    assert bill <= spend + 0.01
    assert spend - bill <= len(atts) * 3 * 30 / 3600 * 2.0  # ≤ a few ticks per attempt
    assert runuri.read_json(runuri.join(c.run_uri, runuri.DONE))["step"] == 1000


def test_auth_error_on_launch_fails_with_the_providers_message(world):
    world["cloud"].inject("launch", "AuthError", count=1)
    c = world["make"]()
    assert c.run() == "FAILED"
    reason = world["store"].get_job("fakejob")["reason"]
    assert reason.startswith("fake refused:")
    assert running(world["cloud"]) == []


def test_poll_errors_do_not_lose_the_node(world):
    world["cloud"].inject("poll", "Transient", count=20)
    c = world["make"]()
    assert c.run() == "SUCCEEDED"
    assert len(world["store"].attempts("fakejob")) == 1


def test_auto_settings_are_resolved_before_the_nodes_see_them(world, tmp_path):
    spec = make_spec(tmp_path, checkpoint={"every_steps": "auto"})
    d = spec.model_dump(mode="json", exclude_none=True)
    d["trainer"]["parallel"] = "auto"
    c = world["make"](parse_spec(d))
    c.start()
    import yaml

    sent = yaml.safe_load(runuri.read_text(runuri.join(c.run_uri, "job.yaml")))
    assert isinstance(sent["checkpoint"]["every_steps"], int) and sent["checkpoint"]["every_steps"] > 0
    assert isinstance(sent["trainer"]["parallel"], dict) and sent["trainer"]["parallel"]["dp_shard"] >= 1
    world["store"].request_action("fakejob", "stop_now")
    assert c.run() == "CANCELLED"


def test_a_failed_reason_says_when_the_node_left_no_log_lines(world, tmp_path, monkeypatch):
    """The reason never ends in an empty "last trainer log lines:" (issue 23)."""
    cloud = world["cloud"]
    cloud.script("dtrun-fakejob-a1", exit_after=300, exit_code=1)
    monkeypatch.setattr(cloud, "logs", lambda handle, tail=200: "\n \n")
    c = world["make"](make_spec(tmp_path, recovery={"max_restarts_on_errors": 0}))
    assert c.run() == "FAILED"
    reason = world["store"].get_job("fakejob")["reason"]
    assert "last trainer log lines" not in reason and "left no trainer log lines" in reason

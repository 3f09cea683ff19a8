"""The controller against the fake cloud on a virtual clock:

* a heartbeat that stays fresh while the trainer's step does not move (a long checkpoint load) is
  not a lost node; the idle guard (``teardown.idle_minutes``, keyed on the step) still ends a
  load that never finishes;
* a tick that raises an unexpected exception is recorded and retried with a backoff; after
  ``MAX_TICK_FAILURES`` in a row the controller exits with the reason recorded and leaves the
  nodes alone.
"""

from __future__ import annotations

import pytest

from orchestrator.contract import runuri
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.loop import MAX_TICK_FAILURES, ControllerGaveUp
from orchestrator.plan.spec import parse_spec
from orchestrator.run.state import StateStore
from providers.fake import FakeOfferTemplate, FakeProvider

OFFERS = [FakeOfferTemplate("fake-east", "H100", True, 1.0), FakeOfferTemplate("fake-west", "H100", True, 1.5)]
STEPS, STEP_S, EVERY = 100, 10.0, 20


class SlowLoadTrainer:
    """A fake node's trainer: ``load_s`` seconds in ``loading_checkpoint`` (step frozen) before
    stepping every STEP_S seconds. ``beats`` False: progress.json's time stays at the node's start
    (the old step-tied heartbeat) while loading."""

    def __init__(self, load_s: float, beats: bool = True) -> None:
        self.load_s, self.beats = load_s, beats
        self.start: dict[str, int] = {}
        self.phases: list[str] = []

    def __call__(self, inst, now):
        uri, attempt = inst.env["DTRUN_RUN_URI"], int(inst.env["DTRUN_ATTEMPT"])
        if inst.id not in self.start:
            lc = runuri.latest_committed(uri)
            self.start[inst.id] = lc[0] if lc else 0
        s0 = self.start[inst.id]
        t = now - inst.ready_at
        if t < self.load_s:
            phase, step, beat = "loading_checkpoint", s0, now if self.beats else inst.ready_at
        else:
            phase, step, beat = "training", min(STEPS, s0 + int((t - self.load_s) / STEP_S)), now
        for k in range(s0 + 1, step + 1):
            if k % EVERY == 0 or k == STEPS:
                c = runuri.join(runuri.checkpoint_uri(uri, k), runuri.COMMITTED)
                if not runuri.exists(c):
                    runuri.write_json(c, {"step": k, "time": now})
        if not self.phases or self.phases[-1] != phase:
            self.phases.append(phase)
        lc = runuri.latest_committed(uri)
        runuri.write_json(runuri.join(uri, runuri.PROGRESS), {
            "step": step, "steps": STEPS, "loss": None, "tokens_per_s": 0.0, "mfu": None,
            "last_committed_step": lc[0] if lc else None, "time": beat, "attempt": attempt, "world_size": 1,
            "status": "training", "phase": phase})
        if runuri.exists(runuri.join(uri, runuri.STOP)):
            return 0
        if step >= STEPS:
            runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "loss": 1.0, "tokens": step, "time": now})
            return 0
        return None


class FlakyPoll(FakeProvider):
    """``poll`` raises a plain RuntimeError on calls ``fail_from`` … ``fail_from + fail_count - 1``
    (``fail_count`` None: on every call from ``fail_from`` on)."""

    def __init__(self, *a, fail_from: int, fail_count: int | None, message: str = "SDK blew up", **kw):
        super().__init__(*a, **kw)
        self.fail_from, self.fail_count, self.message, self.calls = fail_from, fail_count, message, 0

    def poll(self, handle):
        self.calls += 1
        k = self.calls - self.fail_from
        if k >= 0 and (self.fail_count is None or k < self.fail_count):
            raise RuntimeError(self.message)
        return super().poll(handle)


def spec(tmp_path, **recovery):
    return parse_spec({
        "name": "resil",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1, "spot": True},
        "trainer": {"model": "tiny", "steps": STEPS, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": EVERY},
        "budget": {"max_usd": 100.0},
        "teardown": {"idle_minutes": 30},
        "recovery": {"poll_seconds": 10, "backoff_seconds": 10, "heartbeat_timeout_seconds": 300, **recovery},
    })


def make(tmp_path, workload, cls=FakeProvider, **kw):
    clock = VirtualClock()
    cloud = cls(clock=clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None, workload=workload, **kw)
    store = StateStore(tmp_path / "state.db")
    ctl = Controller(spec(tmp_path), store, clock=clock, providers={"fake": cloud})
    return ctl, cloud, store, clock


def events(store, type_=None):
    return [e for e in store.events("resil") if type_ is None or e["type"] == type_]


# ---- heartbeat vs progress ------------------------------------------------------------------------

def test_fresh_heartbeat_during_a_long_load_is_not_lost(tmp_path):
    sim = SlowLoadTrainer(load_s=20 * 60)  # 4 × heartbeat_timeout, < idle_minutes
    ctl, cloud, store, _ = make(tmp_path, sim)
    assert ctl.run() == "SUCCEEDED"
    assert sim.phases == ["loading_checkpoint", "training"]
    assert [e for e in events(store) if e["type"] in ("lost", "give_up", "guard")] == []
    assert len(store.attempts("resil")) == 1 and len(cloud.instances()) == 1


def test_without_the_background_heartbeat_the_same_load_is_declared_lost(tmp_path):
    # The control: the same load with progress.json's time frozen (the old step-tied heartbeat).
    sim = SlowLoadTrainer(load_s=20 * 60, beats=False)
    ctl, cloud, store, _ = make(tmp_path, sim)
    ctl.start()
    for _ in range(60):
        ctl.tick()
        ctl.clock.sleep(10)
        if events(store, "lost"):
            break
    lost = events(store, "lost")
    assert lost and "no heartbeat" in lost[0]["message"] and "loading_checkpoint" in lost[0]["message"]


def test_a_load_that_never_ends_is_still_stopped_by_idle_minutes(tmp_path):
    sim = SlowLoadTrainer(load_s=10 ** 9)  # heartbeats forever, the step never moves
    ctl, cloud, store, clock = make(tmp_path, sim)
    t0 = clock.now()
    assert ctl.run() == "FAILED"
    job = store.get_job("resil")
    assert "idle" in job["reason"] and "teardown.idle_minutes" in job["reason"]
    assert events(store, "lost") == [] and len(store.attempts("resil")) == 1
    assert 30 * 60 <= clock.now() - t0 <= 30 * 60 + 60 + 300  # provisioning + one STOP grace
    assert all(i.gone_at is not None for i in cloud.instances())


# ---- a tick that raises -----------------------------------------------------------------------------

def test_poll_raising_a_few_times_is_recorded_backed_off_and_the_job_still_succeeds(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNPOD_API_KEY", "rp-supersecret-123456")
    sim = SlowLoadTrainer(load_s=60)
    ctl, cloud, store, _ = make(tmp_path, sim, FlakyPoll, fail_from=3, fail_count=5,
                                message="request failed for key rp-supersecret-123456\nsecond line")
    assert ctl.run() == "SUCCEEDED"
    errs = events(store, "controller_error")
    assert len(errs) == 5
    for i, e in enumerate(errs, 1):
        assert "RuntimeError: request failed for key <RUNPOD_API_KEY>" in e["message"]
        assert f"({i} in a row" in e["message"]
        assert "supersecret" not in e["message"] and "second line" not in e["message"]
        assert e["data"]["type"] == "RuntimeError" and any("poll" in w for w in e["data"]["where"])
    # backoff: poll (10 s), doubling, capped at 60 s
    gaps = [b["time"] - a["time"] for a, b in zip(errs, errs[1:])]
    assert gaps == [10.0, 20.0, 40.0, 60.0]
    assert events(store, "controller_exit") == [] and len(store.attempts("resil")) == 1
    assert all(i.gone_at is not None for i in cloud.instances())


def test_poll_always_raising_stops_the_controller_with_the_reason_and_leaves_the_node(tmp_path):
    sim = SlowLoadTrainer(load_s=60)
    ctl, cloud, store, _ = make(tmp_path, sim, FlakyPoll, fail_from=2, fail_count=None)
    with pytest.raises(ControllerGaveUp) as ei:
        ctl.run()
    assert "20 consecutive failed ticks" in str(ei.value) and "RuntimeError: SDK blew up" in str(ei.value)
    assert len(events(store, "controller_error")) == MAX_TICK_FAILURES - 1
    ex = events(store, "controller_exit")
    assert len(ex) == 1 and "own watchdogs" in ex[0]["message"]
    job = store.get_job("resil")
    assert job["state"] in ("PROVISIONING", "RUNNING") and job["controller_pid"] is None
    # nothing recorded terminated, nothing terminated in the cloud, the attempt still open
    assert [n["terminated_at"] for n in store.nodes("resil")] == [None]
    assert [i.gone_at for i in cloud.instances()] == [None]
    assert store.attempts("resil")[-1]["state"] != "ENDED"
    # a later controller re-attaches and finishes the job once the provider works again
    cloud.fail_count = 0
    ctl2 = Controller(spec(tmp_path), store, clock=ctl.clock, providers={"fake": cloud})
    assert ctl2.run() == "SUCCEEDED"
    assert len(store.attempts("resil")) == 1


def test_detached_controller_reports_giving_up_and_exits_1(tmp_path, dtrun_home, monkeypatch, capsys):
    from orchestrator.run import controller
    from orchestrator.cli import detached as controller_main
    from orchestrator.plan.spec import spec_to_yaml

    def gave_up(self, should_pause=None, on_tick=None):
        raise ControllerGaveUp("controller exiting after 20 consecutive failed ticks (last: RuntimeError: x)")

    monkeypatch.setattr(controller.Controller, "run", gave_up)
    path = tmp_path / "job.yaml"
    path.write_text(spec_to_yaml(spec(tmp_path)))
    assert controller_main.main(["--spec", str(path)]) == 1
    assert "20 consecutive failed ticks" in capsys.readouterr().err

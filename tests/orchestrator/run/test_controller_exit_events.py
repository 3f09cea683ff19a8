"""Every end of a controller is an event (orchestrator.run.loop): ``controller_done`` when its job
reached a final state, ``controller_exit`` (how: crashed) when an exception ended the loop and
the nodes go on without it. The fake cloud on a virtual clock."""

from __future__ import annotations

import pytest

from orchestrator.contract import runuri
from orchestrator.plan.spec import parse_spec
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.state import StateStore
from providers.fake import FakeOfferTemplate, FakeProvider

OFFERS = [FakeOfferTemplate("fake-east", "H100", False, 1.0)]


def trainer(steps):
    """A fake node's trainer: one step per 10 s from the node's start, DONE at ``steps``."""

    def workload(inst, now):
        uri = inst.env["DTRUN_RUN_URI"]
        step = min(steps, int((now - inst.ready_at) / 10))
        runuri.write_json(runuri.join(uri, runuri.PROGRESS), {"step": step, "steps": steps, "time": now})
        if runuri.exists(runuri.join(uri, runuri.STOP)):
            return 0
        if step >= steps:
            runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "time": now})
            return 0
        return None

    return workload


def make(tmp_path, steps=50):
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None,
                         workload=trainer(steps))
    spec = parse_spec({
        "name": "exits",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1},
        "trainer": {"model": "tiny", "steps": steps, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 10},
        "budget": {"max_usd": 100.0},
        "recovery": {"poll_seconds": 10, "backoff_seconds": 10},
    })
    store = StateStore(tmp_path / "state.db")
    return Controller(spec, store, clock=clock, providers={"fake": cloud}), store, cloud


def of(store, type_):
    return [e for e in store.events("exits") if e["type"] == type_]


def test_a_finished_job_is_a_controller_done_event(tmp_path):
    ctl, store, _ = make(tmp_path)
    assert ctl.run() == "SUCCEEDED"
    done = of(store, "controller_done")
    assert len(done) == 1 and done[0]["message"] == f"controller (pid {ctl.pid}) finished: SUCCEEDED"
    assert done[0]["data"]["state"] == "SUCCEEDED" and of(store, "controller_exit") == []


def test_an_exception_out_of_the_loop_is_a_controller_exit_event(tmp_path):
    ctl, store, cloud = make(tmp_path, steps=10 ** 6)
    ticks = {"n": 0}

    def pause():
        ticks["n"] += 1
        if ticks["n"] > 30:
            raise RuntimeError("disk full\nsecond line")
        return False

    with pytest.raises(RuntimeError):
        ctl.run(should_pause=pause)
    ex = of(store, "controller_exit")
    assert len(ex) == 1 and ex[0]["data"]["how"] == "crashed" and ex[0]["data"]["type"] == "RuntimeError"
    assert "crashed: RuntimeError: disk full" in ex[0]["message"] and "second line" not in ex[0]["message"]
    assert "`dtrun down exits` stops it" in ex[0]["message"] and of(store, "controller_done") == []
    assert [i.gone_at for i in cloud.instances()] == [None]  # the node is left to its own watchdog

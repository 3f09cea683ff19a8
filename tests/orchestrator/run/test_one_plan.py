"""One plan per `dtrun up` (issue 28): the plan the dry run shows — made on the resolved spec
(auto's degrees, micro-batch and activation checkpointing) — is the plan a detached controller
stores and launches: the same estimate, the same chosen offer, the same Young/Daly checkpoint
interval. A detached controller that cannot use the confirmed plan says why in an event."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import main

ROOT = Path(__file__).resolve().parents[3]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"
NAME = "one-plan"


@pytest.fixture
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("DTRUN_HOME", str(home))
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the detached controller imports this checkout
    return home


def _job(tmp_path) -> Path:
    """llama3-8b on 8×H100 spot with micro_batch_size 64 pinned: auto must turn on activation
    checkpointing and tensor parallel, which slows a step — so the estimate and the Young/Daly
    interval of the resolved spec differ from the spec as written."""
    data = yaml.safe_load(GPT2.read_text())
    data["name"] = NAME
    data["trainer"]["model"] = "llama3-8b"
    data["trainer"]["data"] = "synthetic"  # the fake node reads no data
    data["resources"] = {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8, "spot": True}
    data["checkpoint"] = {"uri": f"file://{tmp_path}/run", "every_steps": "auto", "keep": 3}
    data["budget"] = {"max_usd": 100_000, "max_hours": 1000}
    data["recovery"] = {"poll_seconds": 0.2}
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _stop(store, name: str) -> None:
    from orchestrator.run.state import TERMINAL_STATES, StateStore

    store.request_action(name, "stop_now")
    deadline = time.time() + 60
    while time.time() < deadline:
        row = store.get_job(name)
        if row is None or (row["state"] in TERMINAL_STATES and not StateStore.controller_alive(row)):
            return
        time.sleep(0.2)


def test_a_detached_jobs_stored_estimate_and_interval_are_the_dry_runs(tmp_path, home, capsys, monkeypatch):
    from orchestrator.contract import runuri
    from orchestrator.run.state import StateStore
    from providers.fake import FakeProvider

    f = _job(tmp_path)
    cloud = FakeProvider(path=home / "fake-cloud.json", provision_seconds=3600)
    assert main(["up", str(f), "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["plan"]["activation_checkpointing"] != "none"  # auto changed what the step costs
    assert main(["up", str(f), "--yes", "--detach"]) == 0
    capsys.readouterr()
    store = StateStore()
    try:
        row = store.get_job(NAME)
        est = json.loads(row["estimate_json"])
        assert est["cost_usd"] == pytest.approx(dry["cost_usd"], abs=1e-4)
        assert est["hours"] == pytest.approx(dry["hours"], abs=1e-4)
        assert est["breakdown"]["checkpoint_every_steps"] == dry["checkpoint_every_steps"]
        assert est["breakdown"]["step_seconds"] == pytest.approx(dry["breakdown"]["step_seconds"])
        stored = yaml.safe_load(row["spec_yaml"])
        assert stored["checkpoint"]["every_steps"] == dry["checkpoint_every_steps"]
        sent = yaml.safe_load(runuri.read_text(runuri.join(row["run_uri"], "job.yaml")))
        assert sent["checkpoint"]["every_steps"] == dry["checkpoint_every_steps"]
        assert sent["trainer"]["activation_checkpointing"] == dry["plan"]["activation_checkpointing"]
        deadline = time.time() + 60
        while not store.attempts(NAME) and time.time() < deadline:
            time.sleep(0.2)
        att = store.attempts(NAME)[0]
        assert att["offer"]["provider"] == dry["chosen"]["provider"]
        assert (att["offer"]["region"], att["offer"]["spot"]) == (dry["chosen"]["region"], dry["chosen"]["spot"])
        assert len(cloud.instances()) == 1
        # the controller dies; one started with --job (what "detach" after Ctrl-C starts)
        # re-attaches with the same confirmed plan instead of planning again
        pid = store.get_job(NAME)["controller_pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 30
        while StateStore.controller_alive(store.get_job(NAME)) and time.time() < deadline:
            time.sleep(0.1)
        seen = store.events(NAME)[-1]["id"]
        _in_process(monkeypatch, store, ["--job", NAME], stop_after=2)
        plans = [e for e in store.events(NAME, after_id=seen) if e["type"] == "plan"]
        assert [e["data"]["confirmed"] for e in plans] == [True], plans
        assert json.loads(store.get_job(NAME)["estimate_json"]) == est
        assert store.get_job(NAME)["state"] == "CANCELLED" and len(store.attempts(NAME)) == 1
    finally:
        _stop(store, NAME)
    assert all(i.gone_at is not None for i in cloud.instances())


def _in_process(monkeypatch, store, argv: list[str], stop_after: float) -> int:
    """``python -m orchestrator.cli.detached ARGV`` in this process, stopped (``dtrun down --now``)
    after ``stop_after`` seconds."""
    from orchestrator.cli import detached

    monkeypatch.setattr(detached.signal, "signal", lambda *a: None)  # pytest keeps its own handlers
    timer = threading.Timer(stop_after, lambda: store.request_action(NAME, "stop_now"))
    timer.start()
    try:
        return detached.main(argv)
    finally:
        timer.cancel()


def test_a_detached_controller_without_the_confirmed_plan_says_why_it_planned_again(tmp_path, home, monkeypatch):
    """The plan file is gone (or its offer is no longer sold): the detached controller plans once
    more, on the resolved spec, and an event says why and what it chose."""
    from orchestrator.plan.spec import load_spec
    from orchestrator.run import prepare
    from orchestrator.run.state import StateStore
    from providers.fake import FakeOfferTemplate, FakeProvider

    f = _job(tmp_path)
    cloud = FakeProvider(path=home / "fake-cloud.json", provision_seconds=3600)
    confirmed = prepare.prepare(load_spec(f), spec_path=str(f))
    path = prepare.save(confirmed)
    # the confirmed offer is no longer sold; a dearer region is
    cloud.configure(offers=[FakeOfferTemplate("fake-west", "H100", True, 9.0)])
    store = StateStore()
    try:
        assert _in_process(monkeypatch, store, ["--plan", str(path)], stop_after=3) == 1  # CANCELLED
        events = [e for e in store.events(NAME) if e["type"] == "plan"]
        assert events, [e["message"] for e in store.events(NAME)]
        msg = events[0]["message"]
        assert confirmed.plan.chosen.key() in msg and "no longer offered" in msg and "fake-west" in msg
        est = json.loads(store.get_job(NAME)["estimate_json"])
        assert est["breakdown"]["price_per_gpu_hour"] == pytest.approx(9.0)
        # planned again on the resolved spec: the step time of the confirmed plan, not the written spec's
        assert est["breakdown"]["step_seconds"] == pytest.approx(confirmed.plan.estimate.breakdown["step_seconds"])
        assert store.get_job(NAME)["state"] == "CANCELLED"
    finally:
        _stop(store, NAME)


def test_the_prepared_plan_survives_its_file(tmp_path, home):
    from orchestrator.plan.spec import load_spec, spec_to_yaml
    from orchestrator.run import prepare
    from providers import registry
    from providers.fake import FakeProvider

    FakeProvider(path=home / "fake-cloud.json")
    f = _job(tmp_path)
    p = prepare.prepare(load_spec(f), spec_path=str(f))
    assert p.spec.trainer.parallel != "auto" and p.spec.checkpoint.every_steps == p.plan.checkpoint_every_steps
    q = prepare.load(prepare.save(p))
    assert spec_to_yaml(q.spec) == spec_to_yaml(p.spec) and q.spec_path == str(f)
    assert q.plan.chosen == p.plan.chosen and q.plan.offers == p.plan.offers
    assert q.plan.estimate == p.plan.estimate and q.plan.to_dict() == p.plan.to_dict()
    # the spec as written keeps what the user left open: planning it again gives the same plan
    assert q.written.model_dump() == p.written.model_dump()
    assert q.written.trainer.model_fields_set == p.written.trainer.model_fields_set
    assert prepare.prepare(q.written).plan.estimate == p.plan.estimate
    # no record: planned again, saying why; a record of another spec does not count for a re-attach
    again, why = prepare.confirmed(tmp_path / "nope.json", registry.get, fallback=p.written)
    assert why.startswith(f"no confirmed plan at {tmp_path / 'nope.json'}: planned again: ")
    assert again.plan.estimate == p.plan.estimate
    _, why = prepare.confirmed(prepare.plan_path(NAME), registry.get, spec_yaml="name: other\n", fallback=p.spec)
    assert why.startswith("the confirmed plan is not for the spec the job is recorded with")
    same, why = prepare.confirmed(prepare.plan_path(NAME), registry.get, spec_yaml=spec_to_yaml(p.spec))
    assert why is None and same.plan.to_dict() == p.plan.to_dict()

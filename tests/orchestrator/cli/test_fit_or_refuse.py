"""Never rent what cannot run (issue 14): a plan that does not fit memory is refused (exit 4) by the
dry run and by `dtrun up` unless --force; `trainer.parallel: auto` finds the cheapest plan that fits
(rung, then micro-batch, then selective, then full activation checkpointing) and the nodes get it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import main
from orchestrator.plan import planner
from orchestrator.plan.spec import parse_spec

ROOT = Path(__file__).resolve().parents[3]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"


@pytest.fixture(autouse=True)
def no_sky_catalog(tmp_path, monkeypatch, provider_credentials):
    # provider_credentials: every provider usable (offers from providers without credentials
    # are refused, issue 10)
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "home"))


def llama_job(tmp_path, **trainer) -> Path:
    """jobs/gpt2-124m.yaml switched to llama3-8b (micro_batch_size 64 as written there), with a
    budget large enough: the issue's new-user case."""
    data = yaml.safe_load(GPT2.read_text())
    data["trainer"]["model"] = "llama3-8b"
    data["budget"] = {"max_usd": 100_000, "max_hours": 1000}
    for k, v in trainer.items():
        if v is None:
            data["trainer"].pop(k, None)
        else:
            data["trainer"][k] = v
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def dry(capsys, f, *extra):
    rc = main(["up", str(f), "--dry-run", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_auto_finds_a_plan_that_fits_for_llama3_8b_micro_batch_64(capsys, tmp_path):
    rc, out = dry(capsys, llama_job(tmp_path))  # micro_batch_size 64 pinned; checkpointing left to auto
    assert rc == 0, out.get("does_not_fit")
    p = out["plan"]
    assert p["fits"] is True and out["fits_memory"] is True and p["memory_per_gpu_gb"] <= 80
    assert p["micro_batch_size"] == 64  # what the user wrote is kept
    assert p["activation_checkpointing"] in ("selective", "full")
    assert p["auto"]["pinned"] == ["micro_batch_size"]
    assert all(o["fits_memory"] for o in out["offers"])


def test_auto_lowers_the_micro_batch_before_checkpointing(capsys, tmp_path):
    rc, out = dry(capsys, llama_job(tmp_path, micro_batch_size=None))
    assert rc == 0
    p = out["plan"]
    assert p["fits"] and p["memory_per_gpu_gb"] <= 80
    assert p["activation_checkpointing"] == "none" and p["micro_batch_size"] < 64
    assert 512 % (p["micro_batch_size"] * p["parallel"]["dp_shard"]) == 0  # accumulation keeps batch_size


def test_pinned_settings_that_do_not_fit_exit_4_with_reason_and_suggestions(capsys, tmp_path):
    f = llama_job(tmp_path, activation_checkpointing="none")  # auto may change neither
    rc, out = dry(capsys, f)
    assert rc == 4 and out["exit_code"] == 4
    assert out["fits_memory"] is False and out["plan"]["fits"] is False
    why = out["does_not_fit"]
    assert "trainer.micro_batch_size" in why and "trainer.activation_checkpointing" in why
    # (the micro-batch that fits depends on the activation model: TP is sequence-parallel since issue 12)
    assert "activation_checkpointing: full fits" in why and re.search(r"micro_batch_size: \d+ fits", why)
    assert not any(o["fits_memory"] for o in out["offers"])
    rc = main(["up", str(f), "--dry-run"])
    text = capsys.readouterr()
    assert rc == 4 and "Refused (exit 4)" in text.err and "NONE fits memory" in text.out
    assert "Offers that fit" not in text.out


def test_explicit_degrees_that_do_not_fit_exit_4(capsys, tmp_path):
    f = llama_job(tmp_path, parallel={"dp_shard": 8}, activation_checkpointing="none")
    rc, out = dry(capsys, f)
    assert rc == 4 and "needs" in out["does_not_fit"]
    sp = out["plan"]["spec_parallel"]
    assert sp["strategy"] == "fsdp-zero3" and sp["fits"] is False and sp["memory_per_gpu_gb"] > 80
    assert main(["up", str(f), "--dry-run"]) == 4
    assert "your trainer.parallel (fsdp-zero3)" in capsys.readouterr().out


def test_force_turns_the_refusal_into_a_warning(capsys, tmp_path):
    rc, out = dry(capsys, llama_job(tmp_path, activation_checkpointing="none"), "--force")
    assert rc == 0 and out["fits_memory"] is False
    assert any("out-of-memory" in w for w in out["warnings"])


def test_up_refuses_and_rents_nothing_then_force_rents_with_a_warning(capsys, tmp_path, monkeypatch):
    import orchestrator.cli.up as jobs

    rented = []
    monkeypatch.setattr(jobs, "check_run_uri_reachable", lambda *a: None)
    monkeypatch.setattr(jobs, "_check_credentials", lambda p: None)
    monkeypatch.setattr("orchestrator.run.nodecreds.node_storage", lambda spec, p: ({}, {}))
    monkeypatch.setattr("orchestrator.run.startup.node_storage", lambda spec, p: ({}, {}))  # check_start's copy
    monkeypatch.setattr("orchestrator.run.preflight.maybe_preflight", lambda spec: None)
    monkeypatch.setattr("orchestrator.run.uricheck.check_online", lambda spec, source: None)
    monkeypatch.setattr("orchestrator.contract.runuri.exists", lambda uri: False)
    monkeypatch.setattr("orchestrator.contract.runuri.latest_committed", lambda uri: None)
    monkeypatch.setattr(jobs, "run_foreground", lambda spec, plan, store, path, js: rented.append(spec) or 0)
    f = llama_job(tmp_path, activation_checkpointing="none")
    assert main(["up", str(f), "--yes"]) == 4
    err = capsys.readouterr().err
    assert "does not fit memory" in err and "nothing rented" in err and rented == []
    assert main(["up", str(f), "--yes", "--force"]) == 0
    err = capsys.readouterr().err
    assert "--force" in err and "out-of-memory" in err
    assert len(rented) == 1 and rented[0].trainer.parallel != "auto"


def test_what_auto_chose_reaches_the_nodes_job_yaml(tmp_path):
    """The controller writes the resolved spec to the run URI (the trainer reads job.yaml): the
    micro-batch and checkpointing auto chose are in it."""
    from orchestrator.contract import runuri
    from orchestrator.run.clock import VirtualClock
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import StateStore
    from providers.fake import FakeProvider

    data = yaml.safe_load(llama_job(tmp_path, micro_batch_size=None).read_text())
    data["resources"]["providers"] = ["fake"]
    data["checkpoint"]["uri"] = f"file://{tmp_path}/run"
    spec = parse_spec(data)
    want = planner.auto_plan(spec)
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, provision_seconds=60)
    c = Controller(spec, StateStore(tmp_path / "s.db"), clock=clock, providers={"fake": cloud})
    c.start()
    sent = yaml.safe_load(runuri.read_text(runuri.join(c.run_uri, "job.yaml")))["trainer"]
    assert sent["micro_batch_size"] == want.micro_batch_size < 64
    assert sent["activation_checkpointing"] == want.activation_checkpointing
    assert sent["parallel"]["tp"] == want.parallel.tp


def test_auto_plan_order_and_pins():
    def job(**tr):
        return parse_spec({"name": "fit-test", "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8},
                           "trainer": {"model": "llama3-8b", "steps": 10, "seq_len": 1024, "batch_size": 512,
                                       "parallel": "auto", **tr}})
    # nothing pinned: the micro-batch shrinks first, no recompute
    p = planner.auto_plan(job())
    assert p.fits and p.activation_checkpointing == "none" and p.micro_batch_size < 64
    # the micro-batch pinned: checkpointing is what auto may change
    p = planner.auto_plan(job(micro_batch_size=64))
    assert p.fits and p.micro_batch_size == 64 and p.activation_checkpointing != "none"
    # a small model fits as written: nothing changes
    small = parse_spec({"name": "fit-small", "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8},
                        "trainer": {"model": "gpt2-124m", "steps": 10, "seq_len": 1024, "batch_size": 512}})
    d = small.model_dump(mode="json", exclude_none=True)
    d["trainer"]["parallel"] = "auto"
    p = planner.auto_plan(parse_spec(d))
    assert p.strategy == "ddp" and p.micro_batch_size == 64 and p.auto["changed"] == []


def test_force_really_rents_on_the_fake_cloud_and_the_node_gets_the_forced_plan(tmp_path, monkeypatch, capsys):
    """`dtrun up --force --detach` end to end against the file-shared fake cloud (no real provider
    runs offline): a detached controller rents a node; job.yaml carries auto's smallest plan."""
    import time

    from orchestrator.contract import runuri
    from orchestrator.run.state import StateStore
    from providers.fake import FakeProvider

    home = tmp_path / "home"
    monkeypatch.setenv("DTRUN_HOME", str(home))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    data = yaml.safe_load(llama_job(tmp_path, activation_checkpointing="none").read_text())
    data["resources"] = {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8, "spot": False}
    data["checkpoint"]["uri"] = f"file://{tmp_path}/run"
    data["trainer"]["data"] = "synthetic"  # the fake node reads no data; S3 data would need AWS keys here
    data["recovery"] = {"poll_seconds": 0.2}
    f = tmp_path / "forced.yaml"
    f.write_text(yaml.safe_dump(data))
    cloud = FakeProvider(path=home / "fake-cloud.json", provision_seconds=3600)
    assert main(["up", str(f), "--yes", "--detach"]) == 4
    assert cloud.instances() == []
    capsys.readouterr()
    assert main(["up", str(f), "--yes", "--detach", "--force"]) == 0
    assert "out-of-memory" in capsys.readouterr().err
    store = StateStore()
    try:
        deadline = time.time() + 60
        while not cloud.instances() and time.time() < deadline:
            time.sleep(0.2)
        assert len(cloud.instances()) == 1  # rented
        sent = yaml.safe_load(runuri.read_text(runuri.join(f"file://{tmp_path}/run", "job.yaml")))["trainer"]
        assert sent["activation_checkpointing"] == "none" and sent["micro_batch_size"] == 64
        assert sent["parallel"]["tp"] == 8  # the smallest plan auto found (157 GB: it will OOM, as warned)
    finally:
        store.request_action(data["name"], "stop_now")
        deadline = time.time() + 60
        while time.time() < deadline:
            row = store.get_job(data["name"])
            if row and row["state"] in ("CANCELLED", "FAILED", "SUCCEEDED") and not StateStore.controller_alive(row):
                break
            time.sleep(0.2)
    assert all(i.gone_at is not None for i in cloud.instances())

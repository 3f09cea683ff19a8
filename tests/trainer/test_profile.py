"""dtrun profile: a real torchrun run of the tiny preset under torch.profiler on CPU; the traces
and the breakdown land in the run URI (moto S3 over HTTP)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from orchestrator.cli.app import main
from trainer.profiling import VERDICT_LOW, breakdown_from_events, intersect, merge, verdict


def _ev(name, start, end, thread=1):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread)


def test_breakdown_arithmetic():
    assert merge([(5, 7), (0, 2), (1, 3)]) == [(0, 3), (5, 7)]
    assert intersect([(0, 10)], [(2, 3), (5, 12)]) == 6
    events = [
        _ev("dtrun/data", 0, 100),
        _ev("dtrun/forward_backward", 100, 600),
        _ev("FSDP::all_gather", 150, 250),       # inside compute: moves to communication
        _ev("c10d::allreduce_", 200, 300),       # overlaps the previous: counted once
        _ev("dtrun/optimizer", 600, 700),
        _ev("dtrun/checkpoint", 700, 800),
        _ev("gloo:all_gather", 0, 900, thread=2),  # the gloo worker thread: not the training thread
    ]
    b = breakdown_from_events(events, 1000)
    assert b["data"] == pytest.approx(100e-6)
    assert b["communication"] == pytest.approx(150e-6)
    assert b["compute"] == pytest.approx(450e-6)
    assert b["checkpoint_stall"] == pytest.approx(100e-6)
    assert b["idle"] == pytest.approx(200e-6)
    assert verdict(0.12, {"communication": 0.4, "data": 0.1}).startswith(VERDICT_LOW)
    assert "communication" in verdict(0.12, {"communication": 0.4, "data": 0.1})
    assert "compute-bound" in verdict(0.45, {})


def _job(tmp_path, uri, gpu="cpu", providers=("local",)):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "name": "prof-tiny",
        "resources": {"providers": list(providers), "gpu": gpu, "gpus_per_node": 2},
        "trainer": {"model": "tiny", "steps": 100, "batch_size": 8, "seq_len": 64, "precision": "fp32",
                    "parallel": "auto"},
        "checkpoint": {"uri": uri, "async_mode": "async"},
    }))
    return path


@pytest.mark.slow
def test_profile_writes_trace_and_breakdown_to_run_uri(tmp_path, s3_bucket, capsys):
    from orchestrator.contract import runuri

    uri = f"{s3_bucket}/runs/prof"
    rc = main(["profile", str(_job(tmp_path, uri)), "--steps", "4", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    res = json.loads(out.out)
    assert res["world_size"] == 2 and res["steps"] == 4
    cats = ("compute", "communication", "data", "checkpoint_stall", "idle")
    assert all(res["seconds"][k] >= 0 for k in cats)
    assert res["seconds"]["compute"] > 0 and res["seconds"]["communication"] > 0  # FSDP over 2 ranks
    assert res["seconds"]["checkpoint_stall"] > 0  # one save mid-run
    assert sum(res["shares"][k] for k in cats) == pytest.approx(1.0, abs=0.02)
    assert res["tokens_per_s"] > 0 and 0 < res["mfu"] < 1
    assert res["verdict"].startswith(VERDICT_LOW) or "compute-bound" in res["verdict"]
    assert res["pipeline_bubble"] is None  # pp 1
    # Traces (Chrome JSON, one per rank) and the breakdown are in the run URI; scratch removed.
    names = runuri.list_dir(runuri.join(uri, "profile"))
    assert {"trace-rank0.json", "trace-rank1.json", "breakdown.json"} <= set(names)
    assert "scratch-checkpoint" not in names
    trace = json.loads(runuri.read_text(runuri.join(uri, "profile", "trace-rank0.json")))
    assert any(e.get("name") == "dtrun/forward_backward" for e in trace["traceEvents"])
    assert runuri.read_json(runuri.join(uri, "profile", "breakdown.json"))["verdict"] == res["verdict"]


@pytest.mark.slow
def test_profile_table_output(tmp_path, capsys):
    rc = main(["profile", str(_job(tmp_path, "file://" + str(tmp_path / "run"))), "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    for word in ("compute", "communication", "data loading", "checkpoint stall", "idle", "tokens/s", "MFU",
                 "verdict:"):
        assert word in out
    assert "pipeline bubble" not in out  # pp 1: no pipeline, no bubble line


@pytest.mark.slow
def test_profile_pp2_reports_measured_bubble_next_to_formula(tmp_path, capsys):
    """A tiny pp 2 (1f1b, 2 microbatches) job: the stages run through the trainer's pipeline, the
    JSON holds the measured bubble and the planner's formula (1/3), the table prints both."""
    from orchestrator.cli.profile import _render

    path = tmp_path / "pp.yaml"
    path.write_text(yaml.safe_dump({
        "name": "prof-pp2",
        "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 2},
        "trainer": {"model": {"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "max_seq_len": 64,
                              "tie_embeddings": False},
                    "parallel": {"dp_shard": 1, "pp": 2, "pp_schedule": "1f1b"},
                    "steps": 100, "batch_size": 8, "micro_batch_size": 4, "seq_len": 64, "precision": "fp32"},
        "checkpoint": {"uri": "file://" + str(tmp_path / "run")},
    }))
    rc = main(["profile", str(path), "--steps", "2", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    res = json.loads(out.out)
    assert res["parallel"]["pp"] == 2 and res["parallel"]["pp_schedule"] == "1f1b"
    assert res["loss"] > 0  # the last stage's loss, carried to rank 0 (which holds the first stage)
    b = res["pipeline_bubble"]
    assert (b["schedule"], b["microbatches"], b["pp"], b["stages_per_rank"]) == ("1f1b", 2, 2, 1)
    assert b["formula"] == pytest.approx(1 / 3, abs=1e-4)
    assert 0 < b["measured"] < 1 and len(b["busy_seconds_per_rank"]) == 2
    line = [ln for ln in _render(res).splitlines() if "pipeline bubble" in ln]
    assert line == [f"  pipeline bubble: measured {b['measured']:.1%} vs formula 33.3% (1f1b, 2 microbatches, pp 2)"]


def test_profile_gpu_job_without_gpus_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("orchestrator.cli.profile._cuda_devices", lambda: 0)  # as on this CPU machine
    rc = main(["profile", str(_job(tmp_path, "s3://b/r", gpu="H100", providers=("fake",)))])
    err = capsys.readouterr().err
    assert rc == 2 and "CUDA GPU" in err and "Traceback" not in err

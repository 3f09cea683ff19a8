"""The job spec: examples load, and every kind of bad input gives one clear message (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.contract.errors import SpecError
from orchestrator.plan.spec import JobSpec, load_spec

ROOT = Path(__file__).resolve().parents[3]
JOBS = sorted((ROOT / "jobs").glob("*.yaml"))

GOOD = {
    "name": "t1",
    "resources": {"providers": ["runpod"], "gpu": "H100", "gpus_per_node": 8},
    "trainer": {"model": "gpt2-124m", "steps": 100, "batch_size": 64},
}


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_example_jobs_load(path):
    spec = load_spec(path)
    assert spec.trainer.total_steps > 0
    assert spec.run_uri.startswith(("s3://", "file://"))


def test_defaults_and_derived():
    spec = JobSpec.model_validate(GOOD)
    assert spec.budget.buffer == 0.20
    assert spec.checkpoint.keep >= 2
    assert spec.parallel_degrees.dp_shard == 8
    assert spec.uses_spot is False


def _with(path: str, value):
    data = json.loads(json.dumps(GOOD))
    node = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
    return data


BAD = [
    # (case id, YAML text or data, expected fragments in the message)
    ("unknown-top-key", {**GOOD, "resourcez": {}}, ["resourcez", "unknown key"]),
    ("unknown-nested-key", _with("resources.gpus", 8), ["resources.gpus", "unknown key"]),
    ("unknown-deep-key", _with("trainer.parallel.dpshard", 2), ["trainer.parallel.dpshard", "unknown key"]),
    ("wrong-type", _with("resources.gpus_per_node", "eight"), ["resources.gpus_per_node", "integer"]),
    ("zero-count", _with("resources.nodes", 0), ["resources.nodes", "greater than 0"]),
    ("negative-count", _with("resources.gpus_per_node", -1), ["resources.gpus_per_node"]),
    ("tp-not-dividing", _with("trainer.parallel", {"tp": 3}), ["trainer.parallel.tp", "3", "divide"]),
    ("ep-not-dividing", {**_with("trainer.parallel", {"ep": 3}), "trainer": {**GOOD["trainer"], "model": "moe-small", "parallel": {"ep": 3}}}, ["ep", "3"]),
    ("ep-on-dense", _with("trainer.parallel", {"ep": 2}), ["ep", "MoE"]),
    ("unknown-gpu", _with("resources.gpu", "H900"), ["resources.gpu", "H900"]),
    ("unknown-provider", _with("resources.providers", ["aws"]), ["resources.providers", "aws"]),
    ("unknown-preset", _with("trainer.model", "gpt5"), ["gpt5", "preset"]),
    ("no-steps", _with("trainer.steps", None), ["steps", "tokens"]),
    ("bad-name", {**GOOD, "name": "My Job"}, ["name"]),
    ("missing-name", {k: v for k, v in GOOD.items() if k != "name"}, ["name", "missing"]),
    ("keep-one", _with("checkpoint.keep", 1), ["checkpoint.keep"]),
    ("cpu-on-runpod", _with("resources.gpu", "cpu"), ["cpu", "local"]),
]


@pytest.mark.parametrize("case,data,fragments", BAD, ids=[b[0] for b in BAD])
def test_bad_spec_names_the_field(tmp_path, case, data, fragments):
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SpecError) as exc:
        load_spec(f)
    msg = str(exc.value)
    assert str(f) in msg
    for frag in fragments:
        assert frag.lower() in msg.lower(), (case, msg)


def test_yaml_line_is_reported(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("name: t1\nresources:\n  providers: [runpod]\n  gpu: H100\n  gpuz: 8\ntrainer:\n  steps: 10\n")
    with pytest.raises(SpecError) as exc:
        load_spec(f)
    assert f"{f}:5: resources.gpuz" in str(exc.value)


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"),
    ("name: [unclosed\n", "invalid YAML"),
    ("- just\n- a list\n", "not a mapping"),
])
def test_bad_files(tmp_path, text, fragment):
    f = tmp_path / "job.yaml"
    f.write_text(text)
    with pytest.raises(SpecError, match=fragment):
        load_spec(f)


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text,fragment", [
    ("name: t1\ntrainer: {steps: 10, model: tiny}\nresources: {gpus_per_node: 0}\n", "resources.gpus_per_node"),
    ("", "empty"),
    (":\n  - [", "invalid YAML"),
])
def test_cli_bad_input_exit_2_without_traceback(tmp_path, text, fragment):
    f = tmp_path / "job.yaml"
    f.write_text(text)
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", str(f), "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr + p.stdout
    assert fragment in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_cli_missing_file_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "up", str(tmp_path / "x.yaml"), "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2
    assert "no such file" in p.stderr and "Traceback" not in p.stderr


def test_schema_has_field_docs():
    from orchestrator.plan.spec import json_schema

    schema = json_schema()
    res = schema["$defs"]["Resources"]["properties"]
    assert "spot" in res and res["spot"]["description"]
    assert schema["additionalProperties"] is False


@pytest.mark.parametrize("degrees, why", [({"cp": 2, "ep": 2}, "cp (2) > 1 with ep (2) > 1 is not supported"),
                                          ({"pp": 3}, "pp (3) × cp (1) must divide the job's GPUs"),
                                          ({"cp": 3}, "pp (1) × cp (3) must divide the job's GPUs")])
def test_pipeline_and_context_degrees_are_refused_before_anything_is_rented(degrees, why):
    # Combinations the trainer does not run: a dry run must not quote a layout the node would reject.
    raw = json.loads(json.dumps(GOOD))
    raw["trainer"]["parallel"] = degrees
    with pytest.raises(Exception) as e:
        JobSpec.model_validate(raw)
    assert why in str(e.value)


def test_context_degree_is_accepted_now_the_trainer_runs_it():
    raw = json.loads(json.dumps(GOOD))
    raw["trainer"]["parallel"] = {"cp": 2}
    raw["trainer"]["seq_len"] = 1024
    assert JobSpec.model_validate(raw).trainer.parallel.cp == 2
    raw["trainer"]["parallel"] = {"cp": 2, "pp": 2}  # pp × cp composes (trainer/pipeline.py)
    assert JobSpec.model_validate(raw).trainer.parallel.pp == 2
    raw["trainer"]["parallel"] = {"cp": 2}
    raw["trainer"]["seq_len"] = 1022  # not divisible by 2 × cp
    with pytest.raises(Exception) as e:
        JobSpec.model_validate(raw)
    assert "trainer.seq_len (1022) must be divisible by 2 × cp = 4" in str(e.value)


def test_pipeline_degree_is_accepted_now_the_trainer_runs_it():
    raw = json.loads(json.dumps(GOOD))
    raw["trainer"]["parallel"] = {"pp": 2, "pp_schedule": "zbv"}
    p = JobSpec.model_validate(raw).trainer.parallel
    assert p.pp == 2 and p.pp_schedule == "zbv"

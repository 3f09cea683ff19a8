"""`dtrun export JOB --skypilot`: YAML that SkyPilot's own parser accepts, with no secrets."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from orchestrator.cli.app import main


def test_export_gpt2_is_valid_skypilot_yaml_without_secrets(capsys, monkeypatch):
    secrets = {"AWS_SECRET_ACCESS_KEY": "aws-topsecret-1", "RUNPOD_API_KEY": "rp-topsecret-2",
               "VAST_API_KEY": "vast-topsecret-3", "MODAL_TOKEN_SECRET": "modal-topsecret-4"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    assert main(["export", "jobs/gpt2-124m.yaml", "--skypilot"]) == 0
    out = capsys.readouterr().out
    for v in secrets.values():
        assert v not in out
    cfg = yaml.safe_load(out)
    import sky

    task = sky.Task.from_yaml_config(dict(cfg))
    assert task.num_nodes == 1
    clouds = {(str(r.cloud), r.use_spot) for r in task.resources}
    # spot: prefer → spot and on-demand on RunPod and Vast; Lambda on-demand only; Modal not exportable
    assert clouds == {("RunPod", True), ("RunPod", False), ("Vast", True), ("Vast", False), ("Lambda", False)}
    # each H100 variant under its SkyPilot name: RunPod's H100 is the PCIe card, H100-SXM the SXM
    assert all(r.accelerators in ({"H100": 8}, {"H100-SXM": 8}) for r in task.resources)
    assert {"H100-SXM": 8} in [r.accelerators for r in task.resources if str(r.cloud) == "RunPod"]
    env = cfg["envs"]
    assert env["DTRUN_RUN_URI"] == "s3://my-bucket/dtrun/gpt2-124m"
    assert yaml.safe_load(env["DTRUN_JOB_YAML"])["name"] == "gpt2-124m"
    assert float(env["DTRUN_BUDGET_LEFT_USD"]) == 250
    assert "node_bootstrap.py" in cfg["run"] and "job.yaml" in cfg["setup"]
    assert "not exportable to SkyPilot: modal" in out


def test_export_multi_node_keeps_only_multi_node_clouds(tmp_path, capsys):
    job = tmp_path / "big.yaml"
    job.write_text(textwrap.dedent("""
        name: big
        resources: {providers: [runpod, lambda, vast], gpu: H100, gpus_per_node: 8, nodes: 2}
        trainer: {model: gpt2-124m, steps: 100, batch_size: 16}
        checkpoint: {uri: "s3://b/{name}"}
        budget: {max_usd: 100}
    """))
    assert main(["export", str(job), "--skypilot"]) == 0
    out = capsys.readouterr().out
    cfg = yaml.safe_load(out)
    assert cfg["num_nodes"] == 2
    (only,) = cfg["resources"]["any_of"]
    assert only["infra"] == "lambda" and only["use_spot"] is False and only["accelerators"] == "H100:8"
    assert float(cfg["envs"]["DTRUN_BUDGET_LEFT_USD"]) == 50  # per node
    assert "multi-node is not available on runpod" in out


@pytest.mark.parametrize("content,code,needle", [
    ("name: qq\nresources: {providers: [local], gpu: cpu}\ntrainer: {steps: 1}\n", 4, "none of its providers"),
    ("name: qq\nresources: {providers: [runpod], gpu: H100, gpus_per_node: 8}\ntrainer: {stepz: 1}\n", 2, "stepz"),
])
def test_export_bad_input_is_one_line_and_an_exit_code(tmp_path, capsys, content, code, needle):
    job = tmp_path / "j.yaml"
    job.write_text(content)
    assert main(["export", str(job), "--skypilot"]) == code
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_export_needs_a_format(capsys):
    assert main(["export", "jobs/gpt2-124m.yaml"]) == 2
    assert "--skypilot" in capsys.readouterr().err

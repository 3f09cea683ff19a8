"""The ``command:`` section (your own training code): validation with one line naming the field
(exit 2), the dry run's estimate from hours or 6·N·D and its budget refusal (exit 3), and the
code folder shipped without ``.gitignore``d or large files (each named)."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from orchestrator.cli.app import main
from orchestrator.contract.gpus import GPUS
from orchestrator.plan.spec import json_schema


@pytest.fixture(autouse=True)
def _creds(tmp_path, monkeypatch, provider_credentials):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))


def write_job(folder, **command):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text("print('step 1')\n")
    data = {"name": "mine", "resources": {"providers": ["runpod"], "gpu": "H100", "gpus_per_node": 8},
            "command": {"run": "train.py", **command},
            "checkpoint": {"uri": "s3://bucket/dtrun/{name}"}, "budget": {"max_usd": 100_000}}
    f = folder / "job.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    return f


def dry(capsys, job, *extra):
    rc = main(["up", str(job), "--dry-run", "--json", *extra])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if out.out.strip() else None), out.err


def test_schema_has_the_command_section():
    s = json_schema()
    assert "command" in s["properties"] and "trainer" in s["properties"]
    cmd = s["$defs"]["Command"]
    assert cmd["additionalProperties"] is False
    assert {"run", "code", "checkpoint_format", "hours", "params", "tokens", "setup", "requirements"} <= set(cmd["properties"])


@pytest.mark.parametrize("change, field", [
    ({"paramz": 5}, "command.paramz: unknown key"),
    ({"hours": None}, "command: give command.hours, or command.params and command.tokens"),
    ({"checkpoint_format": "zip"}, "command.checkpoint_format"),
    ({"step_pattern": "step (\\d+"}, "command.step_pattern: not a regular expression"),
    ({"step_pattern": "step \\d+"}, "command.step_pattern: needs a capturing group"),
    ({"hours": -1}, "command.hours"),
])
def test_bad_command_is_one_line_naming_the_field_exit_2(capsys, tmp_path, change, field):
    job = write_job(tmp_path / "j", hours=2, **{k: v for k, v in change.items() if k != "hours"})
    if "hours" in change:
        data = yaml.safe_load(job.read_text())
        data["command"]["hours"] = change["hours"]
        if change["hours"] is None:
            del data["command"]["hours"]
        job.write_text(yaml.safe_dump(data))
    rc, out, err = dry(capsys, job)
    assert rc == 2 and out is None
    assert field in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_trainer_and_command_are_mutually_exclusive(capsys, tmp_path):
    job = write_job(tmp_path / "j", hours=1)
    data = yaml.safe_load(job.read_text())
    data["trainer"] = {"model": "tiny", "steps": 10}
    job.write_text(yaml.safe_dump(data))
    rc, _, err = dry(capsys, job)
    assert rc == 2 and "give trainer (the bundled trainer) or command (your own code), not both" in err
    del data["trainer"], data["command"]
    job.write_text(yaml.safe_dump(data))
    rc, _, err = dry(capsys, job)
    assert rc == 2 and "give a trainer section" in err


def test_dry_run_prices_the_given_hours(capsys, tmp_path):
    rc, out, _ = dry(capsys, write_job(tmp_path / "j", hours=3))
    assert rc == 0, out
    b = out["breakdown"]
    assert b["hours_source"] == "command.hours" and b["compute_hours"] == 3
    assert out["hours"] == pytest.approx(3 + b["startup_hours"], rel=1e-3)
    assert out["cost_usd"] >= 3 * b["price_per_hour"]
    assert out["plan"] is None and out["traps"] == []  # the script's memory is its own
    assert out["command"]["run"] == "train.py" and out["command"]["checkpoint_format"] == "marker"


def test_dry_run_prices_6nd_and_refuses_over_budget_exit_3(capsys, tmp_path):
    job = write_job(tmp_path / "j", params=124e6, tokens=10e9)
    rc, out, _ = dry(capsys, job)
    b = out["breakdown"]
    want = 6 * 124e6 * 10e9 / (8 * GPUS["H100"].peak_bf16_flops * 0.40) / 3600
    assert b["compute_hours"] == pytest.approx(want) and b["params"] == 124_000_000
    data = yaml.safe_load(job.read_text())
    data["budget"]["max_usd"] = 1
    job.write_text(yaml.safe_dump(data))
    rc, out, _ = dry(capsys, job)
    assert rc == 3 and out["within_budget"] is False
    rc = main(["up", str(job), "--dry-run"])
    assert rc == 3 and "nothing will be rented" in capsys.readouterr().out.replace("\n", " ")


def _big(path, mib):
    with open(path, "wb") as f:
        f.truncate(int(mib * 2**20))


def test_code_folder_leaves_out_gitignored_and_large_files_by_name(capsys, tmp_path):
    job = write_job(tmp_path / "j", hours=1, max_file_mb=1)
    (tmp_path / "j" / ".gitignore").write_text("*.log\nwandb/\n")
    (tmp_path / "j" / "run.log").write_text("x")
    (tmp_path / "j" / "wandb").mkdir()
    (tmp_path / "j" / "wandb" / "x").write_text("x")
    _big(tmp_path / "j" / "weights.bin", 2)
    (tmp_path / "j" / "pkg").mkdir()
    (tmp_path / "j" / "pkg" / "mod.py").write_text("")
    rc, out, _ = dry(capsys, job)
    code = out["command"]["code"]
    assert code["folder"] == str(tmp_path / "j") and code["files"] == 4  # job, train, .gitignore, mod
    assert "run.log (.gitignore)" in code["left_out"] and "wandb (.gitignore)" in code["left_out"]
    assert any(x.startswith("weights.bin (2.0 MiB > command.max_file_mb 1)") for x in code["left_out"])
    main(["up", str(job), "--dry-run"])
    assert "not shipped: weights.bin" in capsys.readouterr().out


def test_code_folder_in_a_git_tree_follows_git(tmp_path, capsys):
    job = write_job(tmp_path / "repo" / "train", hours=1)
    repo = tmp_path / "repo"
    (repo / ".gitignore").write_text("data/\n")  # a rule from the repository's root
    (repo / "train" / "data").mkdir()
    (repo / "train" / "data" / "x.bin").write_text("x")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    rc, out, _ = dry(capsys, job)
    code = out["command"]["code"]
    assert code["files"] == 2 and "data (.gitignore)" in code["left_out"]


def test_pack_ships_the_files_and_not_the_run_folder(tmp_path):
    import tarfile

    from orchestrator.plan.spec import load_spec
    from orchestrator.run.codeship import pack

    job = write_job(tmp_path / "j", hours=1)
    data = yaml.safe_load(job.read_text())
    data["checkpoint"]["uri"] = "./runs/{name}"
    data["resources"] = {"providers": ["local"], "gpu": "cpu"}
    job.write_text(yaml.safe_dump(data))
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path / "j")
    try:
        spec = load_spec(job)
        (tmp_path / "j" / "runs" / "mine").mkdir(parents=True)
        (tmp_path / "j" / "runs" / "mine" / "old.bin").write_text("x")
        cf, uri = pack(spec)
    finally:
        os.chdir(cwd)
    assert uri == f"file://{tmp_path}/j/runs/mine/code.tar.gz"
    with tarfile.open(uri[len("file://"):]) as tar:
        assert sorted(tar.getnames()) == ["job.yaml", "train.py"]
    assert "runs/mine (the run URI)" in cf.left_out


def test_weights_and_sample_refuse_a_command_job_exit_2(capsys, tmp_path):
    job = write_job(tmp_path / "j", hours=1)
    assert main(["weights", str(job), "--out", str(tmp_path / "w")]) == 2
    assert "runs your own command" in capsys.readouterr().err
    assert main(["export", str(job), "--skypilot"]) == 2  # its nodes would find no code.tar.gz
    err = capsys.readouterr().err
    assert "code.tar.gz" in err and "dtrun up" in err and len(err.strip().splitlines()) == 1
    assert main(["profile", str(job), "--steps", "2"]) == 2  # was an AttributeError (exit 1)
    err = capsys.readouterr().err
    assert "runs your own command" in err and "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("change, field", [
    ({"run": "python train.py"}, "command.run: 'python train.py': under torchrun"),
    ({"run": "/usr/bin/python3.11 -u train.py"}, "without '/usr/bin/python3.11'"),
    ({"run": "missing.py --lr 3e-4"}, "command.run: missing.py is not in the code folder"),
    ({"run": "python missing.py", "torchrun": False}, "command.run: missing.py is not in the code folder"),
    ({"run": "train.py 'unclosed"}, "command.run: cannot split"),
    ({"run": "torchrun --nproc-per-node 8 train.py"}, "dtrun already runs the command under torchrun"),
    ({"run": "train.py --lr 1", "torchrun": False}, "looks 'train.py' up on PATH; write `python train.py --lr 1`"),
    ({"requirements": "requirements.txt"}, "command.requirements: requirements.txt is not a file in the code folder"),
])
def test_a_command_that_cannot_start_on_a_node_is_refused_before_renting(capsys, tmp_path, change, field):
    job = write_job(tmp_path / "j", hours=1, **change)
    rc, out, err = dry(capsys, job)
    assert rc == 2 and out is None
    assert field in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("change", [
    {"run": "train.py --lr 3e-4"}, {"run": "-m pkg.train"}, {"run": "python train.py", "torchrun": False},
    {"run": "bash -c 'python train.py'", "torchrun": False}, {"run": "$DTRUN_CODE_DIR/gen.py"},
    {"run": "torchrun --nproc-per-node 2 train.py", "torchrun": False},
])
def test_commands_torchrun_or_bash_can_run_pass(capsys, tmp_path, change):
    rc, out, err = dry(capsys, write_job(tmp_path / "j", hours=1, **change))
    assert rc == 0, err


def test_the_dry_run_names_the_scripts_own_checkpoint_interval_not_steps(capsys, tmp_path):
    job = write_job(tmp_path / "j", hours=1, checkpoint_every_minutes=20)
    assert main(["up", str(job), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "every ~20 min (command.checkpoint_every_minutes)" in out and "every 0 steps" not in out

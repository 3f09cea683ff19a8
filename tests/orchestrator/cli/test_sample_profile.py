"""``dtrun sample`` on a job without a tokenizer (text prompt → one line saying ids are needed,
exit 2) and ``dtrun profile`` given a job name (the state store) as well as a job file."""

from __future__ import annotations

from pathlib import Path

import yaml

from orchestrator.cli.app import main

QUICKSTART = Path(__file__).resolve().parents[3] / "jobs" / "quickstart.yaml"


def synthetic_job(tmp_path) -> Path:
    data = yaml.safe_load(QUICKSTART.read_text())
    data["checkpoint"]["uri"] = str(tmp_path / "runs" / "{name}")
    f = tmp_path / "quickstart.yaml"
    f.write_text(yaml.safe_dump(data, sort_keys=False))
    return f


def test_sample_text_prompt_on_synthetic_data_says_ids_are_needed(capsys, tmp_path, dtrun_home):
    job = synthetic_job(tmp_path)
    assert main(["sample", str(job), "--prompt", "Once upon a time"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer" in err and "synthetic" in err and "token ids" in err
    assert "'Once'" in err and len(err.strip().splitlines()) == 1
    assert "internal error" not in err and "ValueError" not in err


def test_sample_id_out_of_vocabulary_is_refused(capsys, tmp_path, dtrun_home):
    job = synthetic_job(tmp_path)
    assert main(["sample", str(job), "--prompt", "1 2 99999999"]) == 2
    err = capsys.readouterr().err
    assert "'99999999'" in err and "internal error" not in err


def test_sample_id_prompt_goes_on_to_the_checkpoint(capsys, tmp_path, dtrun_home):
    job = synthetic_job(tmp_path)
    assert main(["sample", str(job), "--prompt", "1 2 3"]) == 2  # no checkpoint yet: the export's refusal
    err = capsys.readouterr().err
    assert "no tokenizer" not in err and "internal error" not in err and "COMMITTED" in err


def test_profile_takes_a_job_name_from_the_state_store_and_says_so(capsys, tmp_path, dtrun_home):
    from orchestrator.run.state import StateStore

    data = yaml.safe_load(synthetic_job(tmp_path).read_text())
    data["resources"].update(providers=["runpod"], gpu="H100", gpus_per_node=8)
    data["trainer"]["parallel"] = {"dp_shard": 8, "tp": 1}
    StateStore().create_job("quickstart", yaml.safe_dump(data, sort_keys=False), "file:///tmp/x")
    # resolved from the store (not "no such file"): it goes on to the GPU check (this machine has none)
    assert main(["profile", "quickstart", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "no such file" not in err and "in the state store" in err and "8 × H100" in err


def test_profile_unknown_name_says_neither_file_nor_job(capsys, tmp_path, dtrun_home, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "nosuchjob"]) == 6
    err = capsys.readouterr().err
    assert "no such job file" in err and "no job named 'nosuchjob'" in err and "dtrun ls" in err

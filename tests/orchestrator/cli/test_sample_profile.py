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

"""`dtrun up` runs the restore preflight before renting anything when the spec asks for it."""

from __future__ import annotations

import yaml

from orchestrator.cli.app import main


def _job(tmp_path, uri: str) -> str:
    data = {
        "name": "preflight-job",
        "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 2},
        "trainer": {"model": "tiny", "steps": 5, "batch_size": 4, "seq_len": 32, "precision": "fp32"},
        "checkpoint": {"uri": uri, "preflight": True, "every_steps": 5},
        "budget": {"max_usd": 1},
    }
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    return str(f)


def test_up_refuses_when_the_bucket_does_not_exist(tmp_path, s3_server, dtrun_home, capsys):
    rc = main(["up", _job(tmp_path, "s3://no-such-bucket-dtrun/run"), "--yes"])
    err = capsys.readouterr().err
    assert rc == 6, err
    # refused by the run URI probe before renting (the restore preflight would say the same)
    assert "no-such-bucket-dtrun" in err and "does not exist" in err and "nothing rented" in err
    # Nothing was launched: no attempt recorded, no local node registered.
    from orchestrator.run.state import StateStore

    store = StateStore()
    job = store.get_job("preflight-job")
    assert job is None or not store.attempts("preflight-job")

"""A Hugging Face ``Trainer`` script (jobs/user-hf/train.py: a tiny GPT-2, 2 CPU ranks under real
torchrun, ``DtrunCallback`` added) as a ``command:`` job on the local provider, run URI on moto S3:

* SIGKILL of the node's whole process group mid-run → resumed from the newest COMMITTED
  ``checkpoint-N`` → the final weights equal an uninterrupted run's, bit for bit (the Trainer's
  own resume restores model, optimizer, scheduler, every rank's RNG state and skips the batches
  already seen, so with a fixed seed it is deterministic on CPU);
* SIGTERM (a spot notice) → the callback saves the step it is at and exits 75; the next attempt
  starts from that step (no step lost) and ends with the same weights.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from orchestrator.contract import runuri
from tests.e2e.test_command_local import job as command_job
from tests.e2e.test_command_local import run

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "jobs" / "user-hf"
STEPS = 40


def job(uri: str, name: str) -> dict:
    return command_job(uri, name, EXAMPLE, "hf")


def final_weights(uri: str, tmp: Path) -> dict:
    from safetensors.torch import load_file

    step, rec = runuri.latest_committed(uri)
    assert step == STEPS and rec["format"] == "hf" and rec["path"] == f"checkpoint-{STEPS}"
    local = tmp / f"w-{abs(hash(uri))}.safetensors"
    runuri.get_file(runuri.checkpoint_uri(uri, step) + f"/checkpoint-{step}/model.safetensors", str(local))
    return load_file(str(local))


def assert_same(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.timeout(900)
def test_hf_trainer_sigkill_and_sigterm_end_like_an_uninterrupted_run(dtrun_home, tmp_path, s3_bucket, monkeypatch):
    monkeypatch.setenv("STEPS", str(STEPS))
    monkeypatch.setenv("SAVE_EVERY", "10")
    monkeypatch.setenv("STEP_SLEEP", "0.2")
    monkeypatch.setenv("DTRUN_SYNC_SECONDS", "0.5")
    monkeypatch.setenv("DTRUN_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("DTRUN_NODE_DIR", str(tmp_path / "nodes"))
    plain, _ = run(job(f"file://{tmp_path}/plain", "hf-plain"))
    ref = final_weights(plain.run_uri, tmp_path)

    uri = f"{s3_bucket}/runs/hf-kill"
    killed, sent = run(job(uri, "hf-kill"), kill=(signal.SIGKILL, 22))
    atts = killed.store.attempts("hf-kill")
    assert [a["outcome"] for a in atts] == ["preempted", "succeeded"]
    assert atts[1]["start_step"] in (10, 20) and atts[1]["start_step"] <= sent[0]["step"]
    assert_same(final_weights(uri, tmp_path), ref)

    uri = f"{s3_bucket}/runs/hf-term"
    termed, sent = run(job(uri, "hf-term"), kill=(signal.SIGTERM, 13))
    atts = termed.store.attempts("hf-term")
    assert [a["outcome"] for a in atts] == ["preempted", "succeeded"]
    log = Path(atts[0]["log_path"]).read_text()
    saved = int(log.split("dtrun: SIGTERM: saving step ")[1].split()[0])
    assert saved >= sent[0]["step"]
    assert atts[1]["start_step"] == saved  # the checkpoint at the notice: no step lost
    assert runuri.committed(uri, STEPS) is not None
    assert_same(final_weights(uri, tmp_path), ref)

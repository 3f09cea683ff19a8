"""A Lightning script (jobs/user-lightning/train.py with ``DtrunLightningCallback``) as a
``command:`` job on the local provider under real torchrun, run URI on moto S3: SIGTERM (a spot
notice) → Lightning's own signal connector ends the fit at the batch boundary, the callback saves
``epoch=E-step=S.ckpt`` and the process exits 75; the next attempt restores that file (the newest
COMMITTED ``lightning`` checkpoint) and finishes. Lightning restores the loop counters; this test
does not claim bit-identical weights (its data loader is not resumed mid-epoch)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from orchestrator.contract import runuri
from tests.e2e.test_command_local import job, run

pytest.importorskip("lightning")

EXAMPLE = Path(__file__).resolve().parents[2] / "jobs" / "user-lightning"


@pytest.mark.timeout(600)
def test_lightning_sigterm_checkpoints_at_the_notice_and_resumes(dtrun_home, tmp_path, s3_bucket, monkeypatch):
    monkeypatch.setenv("STEPS", "60")
    monkeypatch.setenv("SAVE_EVERY", "10")
    monkeypatch.setenv("STEP_SLEEP", "0.1")  # 60 unslept steps can end before the notice arrives
    monkeypatch.setenv("DTRUN_SYNC_SECONDS", "0.5")
    monkeypatch.setenv("DTRUN_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("DTRUN_NODE_DIR", str(tmp_path / "nodes"))
    uri = f"{s3_bucket}/runs/lt-term"
    ctl, sent = run(job(uri, "lt-term", EXAMPLE, "lightning", ranks=1), kill=(signal.SIGTERM, 12))
    atts = ctl.store.attempts("lt-term")
    assert [a["outcome"] for a in atts] == ["preempted", "succeeded"]
    log = Path(atts[0]["log_path"]).read_text()
    saved = int(log.split("dtrun: SIGTERM: saved step ")[1].split(",")[0])
    assert saved >= sent[0]["step"]
    assert atts[1]["start_step"] == saved  # the notice's checkpoint, committed and restored
    assert "Restored all states from the checkpoint" in Path(atts[1]["log_path"]).read_text()
    step, rec = runuri.latest_committed(uri)
    assert step == 60 and rec["format"] == "lightning" and rec["path"] == "epoch=0-step=60.ckpt"

"""Checkpoints in a real S3 API (moto over HTTP): async save and load, bit-exact resume after SIGKILL
and after SIGTERM, STOP honoured, partial checkpoints skipped; resharding 4 → 2 → 1; a checkpoint
of another model shape refused."""

from __future__ import annotations

import signal

import pytest
from conftest import losses, wait_for

from orchestrator.contract import runuri

pytestmark = pytest.mark.slow

STEPS, EVERY = 12, 4
SLOW = {"DTRUN_DEBUG_STEP_SLEEP": "0.3"}  # lets the test act between checkpoints


def _committed(uri: str, step: int) -> bool:
    return runuri.committed(uri, step) is not None


def _progress(uri: str) -> dict:
    return runuri.read_json(runuri.join(uri, "progress.json")) or {}


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
def test_s3_resume_is_bit_exact_after_sigkill_sigterm_and_stop(trainer, s3_bucket):
    def job(name: str, uri: str):
        return trainer.job(name, nproc=2, run_uri=uri, steps=STEPS, every=EVERY)

    # A: never interrupted.
    ref = f"{s3_bucket}/ref"
    rc, log = trainer.run(job("ref", ref), 2)
    assert rc == 0, log[-3000:]
    done = runuri.read_json(runuri.join(ref, "DONE"))
    assert done["step"] == STEPS and len(done["param_digest"]) == 64
    # keep: 2 → only the newest two COMMITTED steps remain.
    assert runuri.checkpoint_steps(ref) == [8, 12]
    assert all(_committed(ref, s) for s in (8, 12))
    assert len(done["checkpoint_stall_s"]) == 3
    prog = _progress(ref)
    assert prog["status"] == "done" and prog["step"] == STEPS and prog["last_committed_step"] == STEPS
    assert prog["world_size"] == 2 and "tokens_per_s" in prog and "attempt" in prog

    # B: SIGKILL between checkpoints (after step 4 committed), plus a planted partial step-8 folder.
    b = f"{s3_bucket}/killed"
    p = trainer.start(job("killed", b), 2, env=SLOW)
    wait_for(lambda: _committed(b, 4), what="step 4 committed")
    trainer.kill(p, signal.SIGKILL)
    p.wait(timeout=60)
    assert not runuri.exists(runuri.join(b, "DONE"))
    assert runuri.latest_committed(b)[0] == 4
    runuri.write_text(runuri.join(runuri.checkpoint_uri(b, 8), "__0_0.distcp"), "garbage from a dead attempt")
    rc, log = trainer.run(job("killed", b), 2)
    assert rc == 0, log[-3000:]
    assert "ignoring partial checkpoint step-8" in log and "resumed from checkpoint step 4" in log
    assert runuri.read_json(runuri.join(b, "DONE"))["param_digest"] == done["param_digest"]

    # C: SIGTERM (the spot notice, forwarded by torchrun) → emergency checkpoint → resume;
    # then STOP → checkpoint, exit 0 without DONE → resume → the same parameters again.
    # (This run's URI comes from --run-uri, which must override the spec's and survive torchrun.)
    c = f"{s3_bucket}/preempted"
    cjob = job("preempted", f"file://{trainer.tmp}/not-used")
    p = trainer.start(cjob, 2, env=SLOW, run_uri=c)
    wait_for(lambda: _committed(c, 4) and _progress(c).get("step", 0) >= 5, what="step 5")
    p.send_signal(signal.SIGTERM)  # the launcher (torchrun) forwards it to every worker
    out, _ = p.communicate(timeout=120)
    assert p.returncode in (75, 128 + signal.SIGTERM), out[-3000:]
    prog = _progress(c)
    assert prog["status"] == "preempted" and prog["exit_code"] == 75, prog
    stopped_at = prog["step"]
    assert 5 <= stopped_at < STEPS and _committed(c, stopped_at), (stopped_at, runuri.checkpoint_steps(c))
    assert not runuri.exists(runuri.join(c, "DONE"))

    p = trainer.start(cjob, 2, env=SLOW, run_uri=c)
    wait_for(lambda: _progress(c).get("step", 0) > stopped_at, what="progress after resume")
    runuri.write_text(runuri.join(c, "STOP"), "budget")
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out[-3000:]
    assert f"resumed from checkpoint step {stopped_at}" in out
    prog = _progress(c)
    assert prog["status"] == "stopped" and _committed(c, prog["step"]) and prog["step"] < STEPS, prog
    assert not runuri.exists(runuri.join(c, "DONE"))

    runuri.remove(runuri.join(c, "STOP"))
    rc, log = trainer.run(cjob, 2, run_uri=c)
    assert rc == 0, log[-3000:]
    assert runuri.read_json(runuri.join(c, "DONE"))["param_digest"] == done["param_digest"]
    assert not (trainer.tmp / "not-used").exists()


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
def test_reshard_4_to_2_to_1_and_shape_mismatch(trainer, tmp_path):
    # Constant LR so that a run split over several jobs (different `steps`) equals one run.
    cfg = dict(warmup_steps=0, min_lr_ratio=1.0, every=2)
    ref = f"file://{tmp_path}/ref"
    rc, log = trainer.run(trainer.job("ref", nproc=1, run_uri=ref, steps=6, **cfg), 1)
    assert rc == 0, log[-3000:]

    uri = f"file://{tmp_path}/reshard"
    for nproc, steps in [(4, 2), (2, 4), (1, 6)]:
        rc, log = trainer.run(trainer.job(f"w{nproc}", nproc=nproc, run_uri=uri, steps=steps, **cfg), nproc)
        assert rc == 0, log[-3000:]
        if nproc != 4:
            assert f"resumed from checkpoint step {steps - 2}" in log
        assert runuri.read_json(runuri.join(uri, "DONE"))["world_size"] == nproc
    # World sizes differ → reduction order differs: equal up to float rounding, not bitwise.
    assert losses(uri) == pytest.approx(losses(ref), abs=2e-4)

    # The same run URI with another model shape: a clear error, exit 2, never a fresh start.
    bad = trainer.job("bad", nproc=1, run_uri=uri, steps=8, model={"vocab_size": 256, "d_model": 32,
                      "n_layers": 2, "n_heads": 4, "max_seq_len": 128}, **cfg)
    rc, log = trainer.run(bad, 1)
    assert rc == 2, log[-3000:]
    assert "different model shape" in log and "tok_emb.weight" in log

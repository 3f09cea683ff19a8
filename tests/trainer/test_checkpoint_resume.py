"""Resume under a throttling store: moto S3 behind a proxy answering ``503 SlowDown`` for the
newest checkpoint's files. A storage error is retried with backoff and, if it persists, ends the
attempt as retryable with every checkpoint still there; once the store answers, the newest one
loads. Only a proven-corrupt checkpoint is skipped, and it is quarantined, not deleted.
(Before: any read error marked the checkpoint unloadable and rank 0 deleted it.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestrator.contract import runuri
from orchestrator.plan.presets import PRESETS
from trainer.checkpoint import QUARANTINED, CheckpointManager
from trainer.data import DataLoader, SyntheticSource
from trainer.errors import CheckpointUnavailable
from trainer.model import build_model


def _parts(seed: int):
    model = build_model(PRESETS["tiny"], seed=seed)
    opt = torch.optim.AdamW(model.parameters())
    loader = DataLoader(SyntheticSource(256, 16, 0), global_batch=2, micro_batch=2, dp_rank=0, dp=1,
                        device=torch.device("cpu"), prefetch=False)
    return model, opt, loader


def _mgr(uri: str) -> CheckpointManager:
    return CheckpointManager(uri, keep=2, async_mode="sync", rank=0, world_size=1, dp_rank=0, describe={})


def test_503_at_resume_retries_then_ends_retryable_and_deletes_nothing(s3_bucket, s3_server, monkeypatch):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from s3proxy import S3Proxy

    uri = f"{s3_bucket}/run"
    model, opt, loader = _parts(0)
    mgr = _mgr(uri)
    for step in (5, 10):
        loader.samples_seen = 2 * step
        mgr.save(step, mgr.state_dict(model, opt, loader, {"step": step, "tokens": step, "loss": 1.0}), {}, sync=True)
    assert runuri.checkpoint_steps(uri) == [5, 10] and runuri.committed(uri, 10)

    throttled = {"on": True}

    def fail(method: str, path: str) -> bool:  # S3 throttling the hot prefix: step-10's files
        return throttled["on"] and method in ("GET", "HEAD") and "/checkpoints/step-10/" in path \
            and not path.endswith("/COMMITTED")

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries off: the test is about ours
    monkeypatch.setenv("DTRUN_DEBUG_LOAD_RETRY", "3,0.05")
    with S3Proxy(s3_server, fail=fail) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        m2, o2, l2 = _parts(1)
        with pytest.raises(CheckpointUnavailable, match="step-10 failed 3 times .* nothing deleted"):
            _mgr(uri).load_latest(m2, o2, l2)
        assert proxy.failed  # the proxy really answered 503s
        assert runuri.checkpoint_steps(uri) == [5, 10] and runuri.committed(uri, 10)  # nothing deleted
        assert not torch.equal(m2.tok_emb.weight, model.tok_emb.weight)

        # The throttling stops after a few 503s: the same attempt retries and resumes step 10.
        n = len(proxy.failed)
        throttled["on"] = False
        proxy.fail = lambda method, path: fail(method, path) or (
            "/checkpoints/step-10/" in path and method == "GET" and len(proxy.failed) < n + 2)
        train = _mgr(uri).load_latest(m2, o2, l2)
        assert train["step"] == 10 and l2.samples_seen == 20 and len(proxy.failed) == n + 2
        assert torch.equal(m2.tok_emb.weight, model.tok_emb.weight)


def test_corrupt_checkpoint_is_quarantined_not_deleted_and_survives_restarts(s3_bucket):
    uri = f"{s3_bucket}/run"
    model, opt, loader = _parts(0)
    mgr = _mgr(uri)
    for step in (5, 10):
        mgr.save(step, mgr.state_dict(model, opt, loader, {"step": step, "tokens": step, "loss": 1.0}), {}, sync=True)
    runuri.write_text(runuri.join(runuri.checkpoint_uri(uri, 10), ".metadata"), "not a pickle")
    for _ in range(2):  # a second start neither deletes the quarantined folder nor retries it
        m2, o2, l2 = _parts(1)
        assert _mgr(uri).load_latest(m2, o2, l2)["step"] == 5
        assert runuri.checkpoint_steps(uri) == [5, 10] and runuri.committed(uri, 10) is None
        rec = runuri.read_json(runuri.join(runuri.checkpoint_uri(uri, 10), QUARANTINED))
        assert rec["step"] == 10 and "UnpicklingError" in rec["reason"]
    # Training reaches step 10 again: the new save commits over the quarantined folder.
    mgr2 = _mgr(uri)
    mgr2.save(10, mgr2.state_dict(m2, o2, l2, {"step": 10, "tokens": 10, "loss": 1.0}), {}, sync=True)
    m3, o3, l3 = _parts(2)
    assert _mgr(uri).load_latest(m3, o3, l3)["step"] == 10
    assert np.allclose(m3.tok_emb.weight.detach().numpy(), m2.tok_emb.weight.detach().numpy())


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
@pytest.mark.slow
def test_trainer_restart_under_503_exits_retryable_then_resumes_the_newest(trainer, s3_bucket, s3_server):
    """The issue's repro through the real trainer: keep 2, checkpoints every 5; at the restart S3
    answers 503 for step-10's files. The attempt ends with exit 1 (retryable) and step-10 intact;
    the next attempt, once the throttling is over, resumes from step 10 (not 5)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from s3proxy import S3Proxy

    uri = f"{s3_bucket}/run"
    rc, out = trainer.run(trainer.job("first", nproc=1, run_uri=uri, steps=10, every=5), 1, torchrun=False)
    assert rc == 0, out[-3000:]
    assert runuri.checkpoint_steps(uri) == [5, 10]
    state = {"throttle": True}
    fail = (lambda method, path: state["throttle"] and "/checkpoints/step-10/" in path
            and not path.endswith("/COMMITTED") and method in ("GET", "HEAD"))
    env = {"AWS_MAX_ATTEMPTS": "1", "DTRUN_DEBUG_LOAD_RETRY": "2,0.1"}
    with S3Proxy(s3_server, fail=fail) as proxy:
        job = trainer.job("again", nproc=1, run_uri=uri, steps=12, every=5)
        rc, out = trainer.run(job, 1, torchrun=False, env={**env, "AWS_ENDPOINT_URL": proxy.url})
        assert rc == 1, out[-3000:]
        assert "nothing deleted" in out and proxy.failed
        assert runuri.checkpoint_steps(uri) == [5, 10] and runuri.committed(uri, 10)
        state["throttle"] = False
        rc, out = trainer.run(job, 1, torchrun=False, env={**env, "AWS_ENDPOINT_URL": proxy.url})
    assert rc == 0, out[-3000:]
    assert "resumed from checkpoint step 10" in out

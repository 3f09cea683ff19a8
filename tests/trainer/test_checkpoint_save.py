"""The save path: staging buffers reused across saves; COMMITTED and retention off the training
loop; the emergency save bounded by the preemption notice (wait for an in-flight upload only as
long as it allows, abandon it otherwise, save the current step only if a whole save fits)."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch

from orchestrator.contract import runuri
from orchestrator.plan.presets import PRESETS
from trainer import checkpoint
from trainer.checkpoint import CheckpointManager, emergency_plan
from trainer.data import DataLoader, SyntheticSource
from trainer.model import build_model


def _parts():
    model = build_model(PRESETS["tiny"], seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    loader = DataLoader(SyntheticSource(256, 16, 0), global_batch=2, micro_batch=2, dp_rank=0, dp=1,
                        device=torch.device("cpu"), prefetch=False)
    return model, opt, loader


def test_staging_buffers_are_reused_across_saves(tmp_path):
    model, opt, loader = _parts()
    mgr = CheckpointManager(f"file://{tmp_path}/run", keep=3, async_mode="async", rank=0, world_size=1, dp_rank=0,
                            describe={})
    cache = mgr._stager._state_dict_stager._cached_storage_mapping
    ptrs = []
    for step in (1, 2, 3):
        mgr.save(step, mgr.state_dict(model, opt, loader, {"step": step, "tokens": 0, "loss": 0.0}), {})
        mgr.wait()
        ptrs.append(sorted(s.data_ptr() for s in cache.values()))
    assert ptrs[0] and ptrs[0] == ptrs[1] == ptrs[2]  # the same host buffers every time
    assert runuri.checkpoint_steps(f"file://{tmp_path}/run") == [1, 2, 3]
    mgr.close()


def test_commit_and_retention_run_off_the_loop(tmp_path, monkeypatch):
    model, opt, loader = _parts()
    uri = f"file://{tmp_path}/run"
    mgr = CheckpointManager(uri, keep=1, async_mode="async", rank=0, world_size=1, dp_rank=0, describe={})
    gate, entered = threading.Event(), threading.Event()
    real = runuri.write_json

    def slow_write(u, obj):  # a COMMITTED PUT stuck on a slow store
        if u.endswith("COMMITTED"):
            entered.set()
            assert gate.wait(30)
        return real(u, obj)

    monkeypatch.setattr(checkpoint.runuri, "write_json", slow_write)
    mgr.save(1, mgr.state_dict(model, opt, loader, {"step": 1, "tokens": 0, "loss": 0.0}), {})
    while mgr._pending is not None:  # the training loop: poll() after each step
        mgr.poll()
    assert entered.wait(30)
    mgr.poll()  # returns although the COMMITTED write is blocked
    assert mgr.last_committed is None and not runuri.committed(uri, 1)
    gate.set()
    mgr.settle()
    assert mgr.last_committed == 1 and runuri.committed(uri, 1)
    mgr.save(2, mgr.state_dict(model, opt, loader, {"step": 2, "tokens": 0, "loss": 0.0}), {}, sync=True)
    assert runuri.checkpoint_steps(uri) == [2]  # retention (keep 1) ran on the committer thread
    mgr.close()


def test_emergency_save_is_bounded_by_the_notice(tmp_path):
    # Arithmetic: 30 s notice, 3 s margin.
    assert emergency_plan(1.0, None, 12.0) == (0.0, True)  # nothing in flight, a 12 s save fits
    assert emergency_plan(1.0, 5.0, 12.0) == (5.0, True)  # wait 5 s, then 12 s: 21 ≤ 26
    assert emergency_plan(1.0, 15.0, 12.0) == (15.0, False)  # the in-flight one fits, a new one not
    assert emergency_plan(1.0, 60.0, 12.0) == (26.0, False)  # never wait past the notice
    assert emergency_plan(2.0, None, None) == (0.0, True)  # never measured: try

    # An in-flight upload that does not finish within the wait is abandoned: never committed.
    model, opt, loader = _parts()
    uri = f"file://{tmp_path}/run"
    mgr = CheckpointManager(uri, keep=3, async_mode="async", rank=0, world_size=1, dp_rank=0, describe={})
    mgr._pending = (7, Future(), {}, 0.0)  # an upload that never completes
    assert mgr.settle(timeout=0.05) is None and mgr.abandoned == 7
    mgr.save(8, mgr.state_dict(model, opt, loader, {"step": 8, "tokens": 0, "loss": 0.0}), {}, sync=True,
             emergency=True)
    assert mgr.last_committed == 8 and runuri.committed(uri, 8) and not runuri.committed(uri, 7)
    mgr.close()


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
@pytest.mark.slow
def test_sigterm_with_a_slow_upload_exits_within_the_notice_and_resumes(trainer, s3_bucket, s3_server):
    """Real trainer (world 2) on moto behind a proxy adding 0.4 s per request, a 2 s notice: at
    SIGTERM no upload can finish and no new save fits, so the in-flight one is abandoned and the
    run exits 75 at once; the last COMMITTED step is the resume point."""
    import signal
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import wait_for
    from s3proxy import S3Proxy

    uri = f"{s3_bucket}/slow"
    with S3Proxy(s3_server, latency_s=0.4) as proxy:
        env = {"AWS_ENDPOINT_URL": proxy.url, "DTRUN_PREEMPTION_NOTICE_S": "2", "DTRUN_DEBUG_STEP_SLEEP": "0.3"}
        job = trainer.job("slow", nproc=2, run_uri=uri, steps=40, every=2)
        p = trainer.start(job, 2, env=env)

        def ready() -> bool:
            prog = runuri.read_json(runuri.join(uri, "progress.json")) or {}
            return runuri.latest_committed(uri) is not None and prog.get("step", 0) >= 5

        wait_for(ready, timeout=240, what="a commit and step 5")
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
        assert p.returncode in (75, 128 + signal.SIGTERM), out[-3000:]
        assert "does not fit the notice" in out or "abandoned" in out, out[-3000:]
        prog = runuri.read_json(runuri.join(uri, "progress.json"))
        assert prog["status"] == "preempted" and prog["exit_code"] == 75
        last = runuri.latest_committed(uri)[0]
        rc, out = trainer.run(trainer.job("slow", nproc=2, run_uri=uri, steps=last + 2, every=100), 2,
                              env={"AWS_ENDPOINT_URL": proxy.url})
    assert rc == 0, out[-3000:]
    assert f"resumed from checkpoint step {last}" in out

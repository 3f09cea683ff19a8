"""The trainer's heartbeat is not tied to steps: progress.json's ``time`` keeps advancing while the
trainer loads a checkpoint or runs its first step, with ``phase`` saying which; ``step`` only moves
when a step completes (the idle guards key on it). In the ``training`` phase the heartbeat goes
stale when steps stop (a hung loop is still detected as lost)."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import wait_for

from orchestrator.contract import runuri
from trainer.metrics import PHASES, Metrics

CONTRACT = {"step", "steps", "loss", "tokens_per_s", "mfu", "last_committed_step", "time", "attempt",
            "world_size", "status", "phase"}


def _read(uri: str) -> dict | None:
    try:
        p = runuri.read_json(runuri.join(uri, runuri.PROGRESS))
    except (OSError, ValueError):  # mid-rewrite
        return None
    return p if isinstance(p, dict) else None


class Sampler:
    """Reads progress.json every 50 ms on a thread and keeps every distinct record."""

    def __init__(self, uri: str) -> None:
        self.uri, self.seen, self._done = uri, [], threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._done.is_set():
            p = _read(self.uri)
            if p is not None and (not self.seen or p != self.seen[-1]):
                self.seen.append(p)
            self._done.wait(0.05)

    def stop(self) -> list[dict]:
        self._done.set()
        self._t.join()
        return self.seen


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
@pytest.mark.slow
def test_heartbeat_advances_through_a_slow_load_and_first_step_under_torchrun(trainer, tmp_path):
    uri = f"file://{tmp_path}/run"
    job = trainer.job("hb", nproc=2, run_uri=uri, steps=3, every=2)  # heartbeat_seconds 0.2
    sampler = Sampler(uri)
    rc, out = trainer.run(job, 2, env={"DTRUN_DEBUG_LOAD_SLEEP": "2.5", "DTRUN_DEBUG_STEP_SLEEP": "1.0",
                                       "DTRUN_ATTEMPT": "3"})
    seen = sampler.stop()
    assert rc == 0, out[-3000:]
    assert seen, "progress.json never appeared"
    for p in seen:
        assert CONTRACT <= set(p), p
        assert p["phase"] in PHASES and p["attempt"] == 3 and p["world_size"] == 2

    loading = [p for p in seen if p["phase"] == "loading_checkpoint"]
    times = sorted({p["time"] for p in loading})
    # 2.5 s of "loading" at a 0.2 s heartbeat: many beats (allow a slow, shared 2-core machine)
    assert len(times) >= 4 and times[-1] - times[0] >= 1.0, times
    assert all(p["step"] == 0 and p["status"] == "training" for p in loading)

    first = [p for p in seen if p["phase"] == "first_step"]
    ftimes = sorted({p["time"] for p in first})
    assert len(ftimes) >= 2 and all(p["step"] == 0 for p in first), first
    # the step never advanced while not training; the phases come in order
    order = [p["phase"] for p in seen]
    assert order.index("loading_checkpoint") < order.index("first_step") < order.index("training")
    assert all(p["step"] == 0 for p in seen[:order.index("training")])

    final = runuri.read_json(runuri.join(uri, runuri.PROGRESS))
    assert final["status"] == "done" and final["exit_code"] == 0 and final["step"] == 3
    assert final["phase"] == "stopping"
    assert runuri.exists(runuri.join(uri, runuri.DONE))


def test_training_phase_heartbeat_goes_stale_when_steps_stop(tmp_path):
    uri = f"file://{tmp_path}/run"
    m = Metrics(uri, rank=0, steps=10, world_size=1, tokens_per_step=8, flops_per_token=1.0,
                peak_flops_per_rank=None, heartbeat_s=0.05, log_every=1, stall_s=0.4)
    try:
        m.start_heartbeat(0, None)
        m.set_phase("loading_checkpoint")
        t0 = time.time()
        time.sleep(0.9)  # longer than stall_s: a loading phase is not subject to it
        p = _read(uri)
        assert p["phase"] == "loading_checkpoint" and p["time"] > t0 + 0.6 and p["step"] == 0

        m.progress(0, None, None, force=True, phase="first_step")
        m.step(1, 2.0, 1.0, 0.01, None)
        assert m.phase == "training"
        stepped = time.time()
        wait_for(lambda: (_read(uri) or {}).get("time", 0) > stepped + 0.2, timeout=5, what="a beat between steps")
        p = _read(uri)
        assert p["phase"] == "training" and p["step"] == 1 and p["loss"] == 2.0

        time.sleep(0.8)  # no step for 2 × stall_s: the beat stops
        stale = _read(uri)["time"]
        assert stale <= stepped + 0.4 + 0.15, stale - stepped
        time.sleep(0.3)
        assert _read(uri)["time"] == stale

        m.step(2, 1.9, 1.0, 0.01, None)  # steps resume: so does the beat
        resumed = time.time()
        wait_for(lambda: (_read(uri) or {}).get("time", 0) > resumed + 0.1, timeout=5, what="the beat again")
        assert _read(uri)["step"] == 2
    finally:
        m.close()
    closed = _read(uri)
    time.sleep(0.3)
    assert _read(uri) == closed  # close() stopped the thread


def test_other_ranks_write_no_heartbeat(tmp_path):
    uri = f"file://{tmp_path}/run"
    m = Metrics(uri, rank=1, steps=10, world_size=2, tokens_per_step=8, flops_per_token=1.0,
                peak_flops_per_rank=None, heartbeat_s=0.05, log_every=1, stall_s=None)
    m.start_heartbeat(0, None)
    m.set_phase("loading_checkpoint")
    time.sleep(0.2)
    m.close()
    assert _read(uri) is None

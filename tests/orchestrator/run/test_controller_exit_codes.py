"""Exit codes from every provider: a node that rejects its configuration (exit 2) fails the job at
once, with the node's own words, whatever provider it runs on (issue 28, item 1).

A remote node (SkyPilot, Modal) leaves no ``<log>.exit`` file on the controller's machine — only
the local provider writes one. What every node does write is its record in the run URI
(``nodes/a<n>/node-<rank>.json``: state EXITED, exit code) and its output (``node-<rank>.log``).
The fake cloud plays such a remote node: its workload writes exactly those two files and exits 2.
Before this change the controller read only the exit file, counted the exit as a trainer failure
and launched again (``recovery.max_restarts_on_errors`` times, each launch paid)."""

from __future__ import annotations

import os

import pytest
from test_controller_fake import OFFERS, make_spec

from orchestrator.contract import runuri
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.state import StateStore
from providers.fake import FakeProvider

CUDA_LINE = ("dtrun trainer: error: resources.gpu is H100 but CUDA is not usable (torch 2.13.0, built for CUDA "
             "12.8): no GPU visible, or the driver is older than CUDA 12.8 needs; check `nvidia-smi`")


class RemoteNodes:
    """Fake-cloud nodes that report the way a remote node's bootstrap does: only through the run URI."""

    def __init__(self, codes: dict[int, int], after_s: float = 20.0) -> None:
        self.codes, self.after_s = codes, after_s

    def __call__(self, inst, now):
        if now - inst.ready_at < self.after_s:
            return None
        uri, attempt = inst.env["DTRUN_RUN_URI"], int(inst.env["DTRUN_ATTEMPT"])
        for rank, code in self.codes.items():
            said = CUDA_LINE if code == 2 else "dtrun trainer: rank lost its peer; exit 75"
            runuri.write_text(runuri.node_uri(uri, attempt, rank, "log"),
                              f"[dtrun-node 10:00:00] job x attempt {attempt} node {rank}\n{said}\n"
                              f"[dtrun-node 10:00:09] trainer exited {code}\n")
            runuri.write_json(runuri.node_uri(uri, attempt, rank),
                              {"attempt": attempt, "rank": rank, "state": "EXITED", "exit_code": code})
        return max(self.codes.values(), key=lambda c: c == 2)


def _run(tmp_path, codes, nodes=1):
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None,
                         workload=RemoteNodes(codes))
    store = StateStore(tmp_path / "state.db")
    spec = make_spec(tmp_path, resources={"nodes": nodes}, recovery={"max_restarts_on_errors": 2})
    c = Controller(spec, store, clock=clock, providers={"fake": cloud})
    return c.run(), store, cloud


def test_a_remote_node_that_exits_2_fails_the_job_at_once_with_its_own_message(tmp_path, dtrun_home):
    state, store, cloud = _run(tmp_path, {0: 2})
    atts = store.attempts("fakejob")
    assert state == "FAILED"
    assert len(atts) == 1, [(a["outcome"], a["reason"]) for a in atts]  # not relaunched
    assert not os.path.exists(atts[0]["log_path"] + ".exit")  # nothing but the run URI said it
    reason = store.get_job("fakejob")["reason"]
    assert "rejected its configuration (exit 2)" in reason and "not retried" in reason
    assert "CUDA is not usable" in reason.splitlines()[0], reason  # the node's own words, up front
    assert atts[0]["outcome"] == "failed" and store.get_job("fakejob")["restarts_used"] == 0
    assert [i for i in cloud.instances() if i.gone_at is None] == []


def test_exit_2_on_any_node_of_several_beats_a_peer_that_asked_to_be_resumed(tmp_path, dtrun_home):
    state, store, _ = _run(tmp_path, {0: 75, 1: 2}, nodes=2)
    assert state == "FAILED"
    assert len(store.attempts("fakejob")) == 1
    first = store.get_job("fakejob")["reason"].splitlines()[0]
    assert "exit 2 on node 1" in first and "CUDA is not usable" in first, first


@pytest.mark.parametrize("code", [1, 75])
def test_other_exits_from_the_node_record_keep_their_meaning(tmp_path, dtrun_home, code):
    # 1 from the record alone: a trainer failure, restarted up to max_restarts_on_errors (3 attempts);
    # 75 on the one node: it asked to be resumed (the fake cloud reports it PREEMPTED) until storm/budget
    state, store, _ = _run(tmp_path, {0: code})
    atts = store.attempts("fakejob")
    if code == 1:
        assert state == "FAILED" and [a["outcome"] for a in atts] == ["failed"] * 3
        assert "recovery.max_restarts_on_errors = 2" in store.get_job("fakejob")["reason"]
    else:
        assert atts[0]["outcome"] == "preempted" and len(atts) > 1


@pytest.mark.slow  # real torchrun, the real trainer, the local provider
@pytest.mark.timeout(300)
def test_the_real_trainer_rejecting_its_data_on_a_local_node_fails_once_in_its_own_words(dtrun_home, tmp_path):
    import importlib.util  # the helpers live beside the CLI tests; by path, so this folder runs on its own
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "cli" / "test_e2e_local_torchrun.py"
    spec = importlib.util.spec_from_file_location("cli_e2e_local_torchrun", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    job, run = mod.job, mod.run

    (tmp_path / "shards").mkdir()  # a data folder without a token shard: the trainer says so, exit 2
    d = job(f"file://{tmp_path}/run", "nodata", steps=20)
    d["trainer"]["data"] = str(tmp_path / "shards")
    ctl, _ = run(d)
    assert ctl.state == "FAILED"
    assert len(ctl.store.attempts("nodata")) == 1
    first = ctl.job()["reason"].splitlines()[0]
    assert "rejected its configuration (exit 2)" in first and "no .bin or .npy token shards" in first, first

"""How an attempt ended, as a table: ``outcome.decide`` over every case the controller tells apart
(the provider's node states, the node records and their exit codes, the exit file, DONE, the
node watchdog's reason, the provider's words, the heartbeat). Pure: no cloud, no clock, no files."""

from __future__ import annotations

import pytest

from orchestrator.run.outcome import (
    NOT_COUNTED, PREEMPTIONS, AttemptView, Next, NodeRecord, Outcome, decide, node_message,
)
from orchestrator.run.recovery import counted_attempts
from providers.base import NodeState as S

R, P, F, OK, T, Q = S.RUNNING, S.PREEMPTED, S.FAILED, S.SUCCEEDED, S.TERMINATED, S.PENDING
CUDA = ("dtrun trainer: error: resources.gpu is H100 but CUDA is not usable (torch 2.13.0, built for CUDA 12.8): "
        "no GPU visible")


def exited(rank, code, message=None):
    return NodeRecord(rank=rank, state="EXITED", exit_code=code, message=message)


CASES = [
    # (id, view, outcome, next, target, words in the reason)
    ("done", AttemptView(1, states=(R,), done=True), Outcome.SUCCEEDED, Next.STOP, "SUCCEEDED", "DONE"),
    ("done-while-the-provider-is-silent", AttemptView(1, done=True), Outcome.SUCCEEDED, Next.STOP, "SUCCEEDED", "DONE"),
    ("done-beats-a-failed-node", AttemptView(1, states=(F,), done=True, exit_code=2), Outcome.SUCCEEDED, Next.STOP,
     "SUCCEEDED", "DONE"),
    ("running", AttemptView(1, states=(R,), silent_s=10, heartbeat_timeout=300), None, None, None, ""),
    ("provisioning", AttemptView(1, states=(Q,)), None, None, None, ""),
    ("one-of-two-still-provisioning", AttemptView(1, nnodes=2, states=(R, Q)), None, None, None, ""),
    ("heartbeat-lost", AttemptView(1, states=(R,), silent_s=301, heartbeat_timeout=300, phase="compile"),
     Outcome.LOST, Next.RECOVER, None, "no heartbeat for 301 s (recovery.heartbeat_timeout_seconds = 300, "
                                      "trainer phase compile)"),
    ("exit-2-in-the-exit-file", AttemptView(1, states=(F,), exit_code=2), Outcome.FAILED, Next.FAIL, "FAILED",
     "rejected its configuration (exit 2); not retried"),
    ("exit-2-in-the-node-record-only", AttemptView(1, states=(F,), records=(exited(0, 2, CUDA),)),
     Outcome.FAILED, Next.FAIL, "FAILED", "CUDA is not usable"),
    ("exit-2-message-from-the-log-tail", AttemptView(1, states=(F,), records=(exited(0, 2),),
                                                     log_tail=f"[dtrun-node 10:00:00] exec: torchrun\n{CUDA}\n"
                                                              "[dtrun-node 10:00:09] trainer exited 2"),
     Outcome.FAILED, Next.FAIL, "FAILED", "CUDA is not usable"),
    ("exit-2-though-the-provider-says-gone", AttemptView(1, states=(P,), records=(exited(0, 2, CUDA),)),
     Outcome.FAILED, Next.FAIL, "FAILED", "exit 2"),
    ("exit-2-on-one-of-two-nodes-at-once", AttemptView(1, nnodes=2, states=(F, R),
                                                       records=(exited(1, 2, "bad node network: no such iface"),)),
     Outcome.FAILED, Next.FAIL, "FAILED", "exit 2 on node 1): bad node network"),
    ("a-record-still-running-is-no-exit", AttemptView(1, states=(F,), records=(NodeRecord(0, "RUNNING", 2),)),
     Outcome.FAILED, Next.RETRY_ERROR, None, "the trainer failed"),
    ("trainer-failed", AttemptView(1, states=(F,), exit_code=1), Outcome.FAILED, Next.RETRY_ERROR, None,
     "the trainer failed"),
    ("trainer-failed-no-code", AttemptView(1, states=(F,)), Outcome.FAILED, Next.RETRY_ERROR, None, "trainer failed"),
    ("multinode-lost-node", AttemptView(1, nnodes=2, states=(F,), records=(exited(0, 75),)),
     Outcome.PREEMPTED, Next.RECOVER, None, "node 1 of 2 stopped reporting (lost); node 0 exited 75"),
    ("multinode-a-node-failed", AttemptView(1, nnodes=2, states=(F,), records=(exited(0, 75), exited(1, 1))),
     Outcome.FAILED, Next.RETRY_ERROR, None, "the trainer failed"),
    ("multinode-all-reported", AttemptView(1, nnodes=2, states=(F,), records=(exited(0, 75), exited(1, 75))),
     Outcome.FAILED, Next.RETRY_ERROR, None, "the trainer failed"),
    ("multinode-lost-but-the-watchdog-spoke", AttemptView(1, nnodes=2, states=(F,), records=(exited(0, 75),),
                                                          watchdog="budget"),
     Outcome.FAILED, Next.RETRY_ERROR, None, "the trainer failed"),
    ("one-node-75-is-not-a-lost-peer", AttemptView(1, states=(F,), records=(exited(0, 75),)),
     Outcome.FAILED, Next.RETRY_ERROR, None, "the trainer failed"),
    ("watchdog-budget", AttemptView(1, states=(P,), watchdog="budget"), Outcome.WATCHDOG, Next.STOP, "OVER_BUDGET",
     "the node's watchdog stopped it: budget"),
    ("watchdog-deadline", AttemptView(1, states=(P,), watchdog="deadline"), Outcome.WATCHDOG, Next.STOP,
     "OVER_BUDGET", "deadline"),
    ("watchdog-restart", AttemptView(1, states=(P,), watchdog="restart"), Outcome.PLANNED_RESTART, Next.RESTART,
     None, "planned restart before the provider's timeout"),
    ("watchdog-idle", AttemptView(1, states=(P,), watchdog="idle"), Outcome.WATCHDOG, Next.STOP, "FAILED", "idle"),
    ("stopped-without-done", AttemptView(1, states=(OK,)), Outcome.STOPPED, Next.RECOVER, None,
     "the trainer stopped without DONE"),
    ("stopped-by-a-lost-controller", AttemptView(1, states=(OK,), watchdog="controller"), Outcome.STOPPED,
     Next.RECOVER, None, "without DONE (watchdog: controller)"),
    ("terminated-outside", AttemptView(1, states=(T,)), Outcome.LOST, Next.RECOVER, None,
     "terminated outside this controller"),
    ("preempted", AttemptView(1, states=(P,)), Outcome.PREEMPTED, Next.RECOVER, None, "attempt 1: preempted"),
    ("preempted-in-the-providers-words", AttemptView(1, states=(P,), end_reason="evicted by Modal"),
     Outcome.PREEMPTED, Next.RECOVER, None, "preempted: evicted by Modal"),
    ("preempted-while-the-other-runs", AttemptView(1, nnodes=2, states=(R, P)), Outcome.PREEMPTED, Next.RECOVER,
     None, "preempted"),
    ("preempted-with-a-watchdog-note", AttemptView(3, states=(P,), watchdog="controller"), Outcome.PREEMPTED,
     Next.RECOVER, None, "attempt 3: preempted (watchdog: controller)"),
]


@pytest.mark.parametrize("view,outcome,nxt,target,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(view, outcome, nxt, target, words):
    e = decide(view)
    if outcome is None:
        assert e is None
        return
    assert (e.outcome, e.next) == (outcome, nxt), e
    if target is not None:
        assert e.target == target
    assert words in (e.stop_reason or "") + " " + e.reason, e


def test_outcomes_are_the_strings_the_state_store_always_held():
    assert {o.value for o in Outcome} == {
        "succeeded", "preempted", "planned_restart", "stopped", "lost", "failed", "watchdog", "cancelled",
        "over_budget", "abandoned", "unrecorded", "no_capacity", "launch_error", "refused"}
    assert Outcome("preempted") is Outcome.PREEMPTED and Outcome.PREEMPTED == "preempted"
    assert f"{Outcome.NO_CAPACITY}" == "no_capacity"
    assert "planned_restart" in PREEMPTIONS and "unrecorded" in NOT_COUNTED and "failed" not in NOT_COUNTED
    # rows read back from an existing database are plain strings
    assert counted_attempts([{"outcome": "preempted"}, {"outcome": "failed"}, {"outcome": "unrecorded"},
                             {"outcome": "no_capacity"}, {"outcome": None}]) == 2


@pytest.mark.parametrize("log,said", [
    (f"[dtrun-node 10:00:00] exec: torchrun ...\nINFO step\n{CUDA}\nERROR:torch...failed (exitcode: 2)\n"
     "[dtrun-node 10:00:05] trainer exited 2", CUDA),
    ("[dtrun-node 10:00:00] job j attempt 1 node 0/2\n[dtrun-node 10:00:01] bad node network: no route\n"
     "[dtrun-node 10:00:02] self-terminate (try 1/3)", "bad node network: no route"),
    ("[dtrun-node 10:00:00] trainer exited 2", None),
    ("[dtrun-node 10:00:00] job j attempt 1 node 0/1 ip 10.0.0.2 nproc 2 run s3://b/j\n"
     "[dtrun-node 10:00:01] exec: python infra/torchrun_launch.py ...\n[dtrun-node 10:00:05] trainer exited 2", None),
    ("[dtrun-node 10:00:00] job j attempt 1 node 0/1 ip 10.0.0.2 nproc 2 run s3://b/j\n"
     "[dtrun-node 10:00:01] s3://b/j/job.yaml: not found\n", "s3://b/j/job.yaml: not found"),
    ("", None),
])
def test_node_message_is_the_nodes_own_line(log, said):
    assert node_message(log) == said

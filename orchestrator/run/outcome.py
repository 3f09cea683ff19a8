"""How an attempt ended: the outcomes, and one pure function from what was observed to the outcome.

:class:`Outcome` is what the state store records for an attempt (``attempts.outcome``: the enum's
values are the strings stored since the first release, so existing databases read the same).
:func:`decide` is the whole judgement, like dstack's ``_should_retry_job`` over its
``JobTerminationReason``: given an :class:`AttemptView` (each node's provider state, the node
records in the run URI with their exit codes, the exit file, DONE, the node watchdog's reason,
the provider's words, the heartbeat) it returns an :class:`Ending` — the outcome, what comes next
and the reason in words — or None while the attempt is still running. No I/O: the view is built
by ``orchestrator.run.observe``, the ending acted on by ``orchestrator.run.watching``.

The rules, in order:

1. DONE in the run URI → SUCCEEDED (stop, tear down).
2. no node ended: every node RUNNING but no heartbeat for longer than the timeout → LOST;
   otherwise still running (None).
3. a node exited 2 (``EXIT_BAD_CONFIG``: its node record, or the provider's exit file) → FAILED
   at once, the node's own message in the reason, no relaunch — on every provider.
4. several nodes, the cluster FAILED, one node silent and a survivor exited 75 → PREEMPTED (a lost
   node, not the trainer's failure).
5. a node FAILED → FAILED, a counted restart (``recovery.max_restarts_on_errors``).
6. the node watchdog stopped it: budget/deadline → stop OVER_BUDGET; ``restart`` (before the
   provider's own lifetime cap) → PLANNED_RESTART, relaunched at once; idle → stop FAILED.
7. every ended node SUCCEEDED without DONE (a STOP honoured) → STOPPED, resumed.
8. a node TERMINATED outside this controller → LOST.
9. anything else (PREEMPTED, gone) → PREEMPTED, with the provider's words for it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from orchestrator.contract.runuri import EXIT_BAD_CONFIG, EXIT_PREEMPTED
from providers.base import PREEMPT_EXIT_CODES, NodeState


class Outcome(str, enum.Enum):
    """How an attempt ended (the value is what the state store records)."""

    SUCCEEDED = "succeeded"              # the job finished in this attempt
    PREEMPTED = "preempted"              # the provider took a node away (or it vanished)
    PLANNED_RESTART = "planned_restart"  # checkpointed before the provider's lifetime cap
    STOPPED = "stopped"                  # exit 0 without DONE: a STOP honoured; resumed
    LOST = "lost"                        # no heartbeat, or terminated outside this controller
    FAILED = "failed"                    # the trainer failed, or rejected its configuration
    WATCHDOG = "watchdog"                # the node's watchdog stopped the run (budget, deadline, idle)
    CANCELLED = "cancelled"              # `dtrun down` (or a launch cancelled while in flight)
    OVER_BUDGET = "over_budget"          # the job ended at its budget or deadline
    ABANDONED = "abandoned"              # a cancelled launch the loop stopped waiting for
    UNRECORDED = "unrecorded"            # the controller died while the launch was in flight
    NO_CAPACITY = "no_capacity"          # the launch found no capacity (or quota)
    LAUNCH_ERROR = "launch_error"        # the launch raised an API error (retried with backoff)
    REFUSED = "refused"                  # the provider refused: credentials, not supported

    def __str__(self) -> str:
        return self.value


PREEMPTIONS = frozenset({Outcome.PREEMPTED, Outcome.PLANNED_RESTART})
"""Outcomes that are preemptions: they do not use up ``recovery.max_attempts``."""
NOT_COUNTED = PREEMPTIONS | {Outcome.UNRECORDED}
"""Outcomes that are not the job's failures (preemptions, a controller killed mid-launch)."""
FINAL = {"SUCCEEDED": Outcome.SUCCEEDED, "CANCELLED": Outcome.CANCELLED, "OVER_BUDGET": Outcome.OVER_BUDGET}
"""The current attempt's outcome when the job ends in one of these states (else FAILED)."""


class Next(str, enum.Enum):
    """What the controller does after an attempt ended."""

    RECOVER = "recover"          # a new attempt after the backoff
    RESTART = "restart"          # a new attempt at once (a planned restart: no backoff)
    RETRY_ERROR = "retry_error"  # a new attempt if ``recovery.max_restarts_on_errors`` allows
    FAIL = "fail"                # the job FAILS now: no relaunch
    STOP = "stop"                # the job stops, ending in ``Ending.target``


@dataclass(frozen=True)
class NodeRecord:
    """One node's record in the run URI (``nodes/a<n>/node-<rank>.json``, the node bootstrap's)."""

    rank: int
    state: str = "STARTING"
    """STARTING, RUNNING or EXITED."""
    exit_code: int | None = None
    message: str | None = None
    """What the node said when it exited 2 (from its log in the run URI), if anything."""

    @classmethod
    def from_dict(cls, d: dict[str, Any], message: str | None = None) -> "NodeRecord":
        code = d.get("exit_code")
        return cls(rank=int(d.get("rank") or 0), state=str(d.get("state") or "STARTING"),
                   exit_code=code if isinstance(code, int) else None, message=message)

    @property
    def exited(self) -> bool:
        return self.state == "EXITED"


@dataclass(frozen=True)
class AttemptView:
    """Everything one tick observed about attempt ``n`` (built by ``orchestrator.run.observe``)."""

    n: int
    nnodes: int = 1
    """Nodes the spec asks for."""
    states: tuple[NodeState, ...] = ()
    """Each live node's provider state this tick (empty when the provider could not say)."""
    records: tuple[NodeRecord, ...] = ()
    """The node records (read once a node ended)."""
    exit_code: int | None = None
    """The exit code the provider left in its exit file (local: ``<attempt log>.exit``)."""
    done: bool = False
    """DONE is in the run URI."""
    watchdog: str | None = None
    """The node watchdog's reason for stopping this attempt (``watchdog.json``)."""
    end_reason: str = ""
    """What the providers say ended the nodes (Modal: evicted, OOM-killed, …)."""
    log_tail: str = ""
    """The nodes' last output lines (read when a node failed)."""
    silent_s: float | None = None
    """Every node RUNNING: seconds since the trainer's last heartbeat."""
    heartbeat_timeout: float | None = None
    phase: str | None = None
    """The trainer's phase in its last heartbeat (checkpoint load, compile, …)."""

    @property
    def ended(self) -> tuple[NodeState, ...]:
        return tuple(s for s in self.states if s.is_terminal)


@dataclass(frozen=True)
class Ending:
    """How an attempt ended and what comes next."""

    outcome: Outcome
    next: Next
    reason: str
    """The attempt's reason (and the job's, unless ``stop_reason`` says otherwise)."""
    target: str | None = None
    """The job's final state for ``Next.STOP`` / ``Next.FAIL``."""
    stop_reason: str | None = None
    """The job's reason for a stop, when it differs from the attempt's."""
    end_now: bool = True
    """Record the attempt ended now (False: the stop's finish records it, e.g. on DONE)."""


TRAINER_ERROR = "dtrun trainer: error:"
_BOOT = "[dtrun-node"
_BOOT_STATUS = ("trainer exited", "self-terminate", "got signal", "node report:", "multi-node network:")
_BANNER = re.compile(r"job \S+ attempt \d+ node \d+/\d+")
MESSAGE_LIMIT = 600


def node_message(log: str) -> str | None:
    """The line in which a node said why it rejected its configuration: the trainer's own error
    line (``dtrun trainer: error: …``); else, when the bootstrap stopped before it started the
    trainer (a bad node environment, network or job file), the bootstrap's last line without its
    ``[dtrun-node hh:mm:ss]`` prefix. None when neither said anything dtrun knows to quote."""
    lines = [ln.strip() for ln in (log or "").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if TRAINER_ERROR in ln:
            return ln[ln.index(TRAINER_ERROR):][:MESSAGE_LIMIT]
    boot = [ln.split("]", 1)[1].strip() for ln in lines if ln.startswith(_BOOT) and "]" in ln]
    if any(t.startswith("exec:") for t in boot):
        return None  # the trainer (or the job's own command) ran: its words are in the log tail
    for text in reversed(boot):
        if text and not text.startswith(_BOOT_STATUS) and not _BANNER.match(text):
            return text[:MESSAGE_LIMIT]
    return None


def bad_config(v: AttemptView) -> str | None:
    """Why the attempt is a rejected configuration (a node exited 2), in the node's words; None if
    no node did."""
    bad = [r for r in v.records if r.exited and r.exit_code == EXIT_BAD_CONFIG]
    if not bad and v.exit_code != EXIT_BAD_CONFIG:
        return None
    said = next((r for r in bad if r.message), None)
    msg = said.message if said else node_message(v.log_tail)
    where = f" on node {(said or bad[0]).rank}" if (said or bad) and v.nnodes > 1 else ""
    return (f"attempt {v.n}: the trainer rejected its configuration (exit 2{where})"
            + (f": {msg}" if msg else "") + "; not retried")


def node_lost(v: AttemptView) -> str | None:
    """Several nodes: did the cluster's job fail because one of its nodes was lost rather than
    because the trainer failed? Yes when a node's own record says it exited 75 ("resume me": its
    peer was gone), none says another non-zero exit (76, a watchdog stop, has its own path), and
    a node never reported its exit (it vanished with its machine). SkyPilot reports such a job
    FAILED, without the exit marker, when its job driver sees a node's task die before the
    survivors' exit reaches the log (seen on the emulated Lambda cloud): counted as a trainer
    failure, preemptions would use up ``recovery.max_restarts_on_errors``. Returns what
    happened, or None."""
    if v.nnodes < 2:
        return None
    exited = {r.rank: r.exit_code for r in v.records if r.exited}
    if any(c not in PREEMPT_EXIT_CODES and c != 0 for c in exited.values()):
        return None  # a node's own failure: the trainer failed
    resumers = sorted(r for r, c in exited.items() if c == EXIT_PREEMPTED)
    silent = [r for r in range(v.nnodes) if r not in exited]
    if not resumers or not silent:
        return None
    return (f"node {', '.join(map(str, silent))} of {v.nnodes} stopped reporting (lost); "
            f"node {', '.join(map(str, resumers))} exited {exited[resumers[0]]} (resume me)")


def decide(v: AttemptView) -> Ending | None:
    """How attempt ``v.n`` ended (see the module docstring for the rules), or None while it runs."""
    n = v.n
    if v.done:
        return Ending(Outcome.SUCCEEDED, Next.STOP, "training finished (DONE)", target="SUCCEEDED", end_now=False)
    ended = v.ended
    if not ended:
        running = bool(v.states) and all(s == NodeState.RUNNING for s in v.states)
        if running and v.silent_s is not None and v.heartbeat_timeout is not None and v.silent_s > v.heartbeat_timeout:
            phase = f", trainer phase {v.phase}" if v.phase else ""
            return Ending(Outcome.LOST, Next.RECOVER, f"attempt {n}: no heartbeat for {v.silent_s:.0f} s "
                                                      f"(recovery.heartbeat_timeout_seconds = "
                                                      f"{v.heartbeat_timeout:g}{phase})")
        return None
    why = bad_config(v)
    if why:
        return Ending(Outcome.FAILED, Next.FAIL, why, target="FAILED")
    wd = v.watchdog
    if NodeState.FAILED in ended:
        lost = node_lost(v) if wd is None else None
        if lost:
            return Ending(Outcome.PREEMPTED, Next.RECOVER, f"attempt {n}: preempted: {lost}")
        return Ending(Outcome.FAILED, Next.RETRY_ERROR, f"attempt {n}: the trainer failed")
    if wd in ("budget", "deadline"):
        return Ending(Outcome.WATCHDOG, Next.STOP, f"the node's watchdog stopped it: {wd}", target="OVER_BUDGET",
                      stop_reason=f"{wd}: the node's watchdog stopped the run")
    if wd == "restart":
        # The node checkpointed before the provider's own timeout (Modal's 24 h cap) and asked to
        # be resumed: relaunch at once, not a preemption, no backoff.
        return Ending(Outcome.PLANNED_RESTART, Next.RESTART, f"attempt {n}: planned restart before the "
                                                             f"provider's timeout (the node checkpointed)")
    if wd == "idle":
        return Ending(Outcome.WATCHDOG, Next.STOP, "the node's watchdog stopped it: idle", target="FAILED",
                      stop_reason="idle: the node's watchdog saw no progress")
    note = f" (watchdog: {wd})" if wd else ""
    if all(s == NodeState.SUCCEEDED for s in ended):
        # Exit 0 without DONE: a STOP was honoured (not ours: we are not stopping) → resume.
        return Ending(Outcome.STOPPED, Next.RECOVER, f"attempt {n}: the trainer stopped without DONE{note}")
    if NodeState.TERMINATED in ended:
        return Ending(Outcome.LOST, Next.RECOVER, f"attempt {n}: the node was terminated outside this controller")
    return Ending(Outcome.PREEMPTED, Next.RECOVER, f"attempt {n}: preempted{note}"
                  + (f": {v.end_reason}" if v.end_reason else ""))

"""Watching a live attempt, tick by tick: observe it, tell how it ended, act on that.

Each tick of a PROVISIONING/RUNNING job (no launch in flight): poll the nodes, read
``progress.json`` (the job's step, loss, heartbeat) and ``DONE``; a running node whose trainer
stopped heartbeating is lost; an attempt with an ended node is judged (preempted, trainer failed,
rejected its configuration, stopped by its watchdog, …) and acted on — a new attempt after
backoff, a counted restart, or a stop. The money guard runs on every tick that bills.
"""

from __future__ import annotations

from typing import Any

from orchestrator.contract import runuri
from orchestrator.run.context import JobContext
from orchestrator.run.observe import Observer
from orchestrator.run.recovery import Recovery
from orchestrator.run.teardown import Teardown
from providers.base import PREEMPT_EXIT_CODES, NodeState


class Watching:
    def __init__(self, ctx: JobContext, observer: Observer, recovery: Recovery, teardown: Teardown) -> None:
        self.ctx = ctx
        self.observer = observer
        self.recovery = recovery
        self.teardown = teardown

    def watch(self, now: float) -> None:
        ctx, obs = self.ctx, self.observer
        att = ctx.current_attempt()
        nodes = [n for n in ctx.store.nodes(ctx.name, live_only=True) if att and n["attempt"] == att["n"]]
        if att is None or not nodes:
            self.recovery.begin(now)
            ctx.transition("RECOVERING", "no live node for the current attempt")
            return
        n = att["n"]
        states = obs.poll_nodes(nodes)
        ctx.sync_cluster(n)
        prog = obs.read_progress()
        mine = prog is not None and str(prog.get("attempt", n)) == str(n)
        if prog is not None:
            step = prog.get("step")
            cols: dict[str, Any] = dict(step=step, loss=prog.get("loss"), tokens_per_s=prog.get("tokens_per_s"),
                                        val_loss=prog.get("val_loss"),
                                        last_committed_step=prog.get("last_committed_step"),
                                        progress_time=prog.get("time"))
            if prog.get("steps"):
                cols["steps"] = prog.get("steps")
            ctx.store.update_job(ctx.name, updated=now, **cols)
            if isinstance(step, int) and step != obs.last_step:
                if obs.last_step is not None or mine:
                    obs.last_progress_at = now
                obs.last_step = step
                if mine and (att["start_step"] is None or step > (att["start_step"] or 0)):
                    self.recovery.progressed()
        if obs.done() is not None:
            ctx.event("done", "DONE written by the trainer: tearing down")
            self.teardown.begin_stop("SUCCEEDED", "training finished (DONE)", write_stop=False)
            return
        if states is None:
            # The provider cannot say what the node is doing, but it is billing all the same:
            # the budget and deadline guard must not wait for the status API to come back.
            self.teardown.apply_guard(now, running=False)
            return
        values = list(states.values())
        if all(s == NodeState.RUNNING for s in values):
            if ctx.state == "PROVISIONING":
                ctx.store.update_attempt(ctx.name, n, state="RUNNING", running_at=now)
                obs.last_progress_at = now
                ctx.transition("RUNNING", f"attempt {n} running")
            # heartbeat: a running node whose trainer stopped writing progress.json is lost
            hb = ctx.spec.recovery.heartbeat_timeout_seconds
            running_at = ctx.attempt_running_at(n) or now
            last_beat = float(prog["time"]) if mine and prog and isinstance(prog.get("time"), (int, float)) else running_at
            last_beat = max(last_beat, running_at)
            # Keyed on the heartbeat's time only: the trainer beats from a thread through long
            # phases (checkpoint load, first-step compile) without a step; "no step" is the
            # idle guard's business (teardown.idle_minutes, below).
            if now - last_beat > hb:
                phase = f", trainer phase {prog.get('phase')}" if mine and prog and prog.get("phase") else ""
                self.begin_recovery("lost", f"attempt {n}: no heartbeat for {now - last_beat:.0f} s "
                                            f"(recovery.heartbeat_timeout_seconds = {hb:g}{phase})")
                return
            self.teardown.apply_guard(now, running=True)
            return
        ended = [s for s in values if s.is_terminal]
        if not ended:  # PENDING (provisioning) or a mix with RUNNING
            if self.recovery.started is not None:
                why = self.recovery.overdue(now)
                if why:
                    self.teardown.give_up(why)
                if ctx.state != "PROVISIONING" and ctx.state != "RUNNING":
                    return
            self.teardown.apply_guard(now, running=False)
            return
        self.attempt_ended(n, att, nodes, ended)

    def attempt_ended(self, n: int, att: dict, nodes: list[dict], ended: list[NodeState]) -> None:
        ctx, obs = self.ctx, self.observer
        wd = obs.watchdog_reason(att)
        lost = self._node_lost(n) if NodeState.FAILED in ended and wd is None else None
        if lost:
            self.begin_recovery("preempted", f"attempt {n}: preempted: {lost}")
            return
        if NodeState.FAILED in ended:
            code = obs.exit_file_code(att)
            tail = obs.log_tail(nodes)
            if code == runuri.EXIT_BAD_CONFIG:
                self.teardown.fail_now(n, f"attempt {n}: the trainer rejected its configuration (exit 2); "
                                          f"not retried", tail)
                return
            used = ctx.job()["restarts_used"] + 1
            ctx.store.update_job(ctx.name, restarts_used=used)
            limit = ctx.spec.recovery.max_restarts_on_errors
            why = self.recovery.restart_refusal(used)
            if why:
                self.teardown.fail_now(n, f"attempt {n}: the trainer failed ({why})", tail)
                return
            ctx.event("failed", f"attempt {n}: the trainer failed; restart {used} of {limit}"
                                + (f"\n{tail}" if tail else ""))
            self.begin_recovery("failed", f"attempt {n}: trainer failed (restart {used}/{limit})")
            return
        if wd in ("budget", "deadline"):
            ctx.end_attempt(n, "watchdog", f"the node's watchdog stopped it: {wd}")
            self.teardown.begin_stop("OVER_BUDGET", f"{wd}: the node's watchdog stopped the run", write_stop=False)
            return
        if wd == "restart":
            # The node checkpointed before the provider's own timeout (Modal's 24 h cap) and asked
            # to be resumed: relaunch at once, not a preemption, no backoff.
            self.begin_recovery("planned_restart", f"attempt {n}: planned restart before the provider's "
                                                   f"timeout (the node checkpointed)", planned=True)
            return
        if wd == "idle":
            ctx.end_attempt(n, "watchdog", "the node's watchdog stopped it: idle")
            self.teardown.begin_stop("FAILED", "idle: the node's watchdog saw no progress", write_stop=False)
            return
        if NodeState.SUCCEEDED in ended and all(s == NodeState.SUCCEEDED for s in ended):
            # Exit 0 without DONE: a STOP was honoured (not ours: we are not stopping) → resume.
            self.begin_recovery("stopped", f"attempt {n}: the trainer stopped without DONE"
                                + (f" (watchdog: {wd})" if wd else ""))
            return
        if NodeState.TERMINATED in ended:
            self.begin_recovery("lost", f"attempt {n}: the node was terminated outside this controller")
            return
        why = obs.end_reasons(nodes)
        self.begin_recovery("preempted", f"attempt {n}: preempted" + (f" (watchdog: {wd})" if wd else "")
                            + (f": {why}" if why else ""))

    def _node_lost(self, n: int) -> str | None:
        """Several nodes: did the cluster's job fail because one of its nodes was lost rather than
        because the trainer failed? Yes when a node's own record says it exited 75 ("resume me":
        its peer was gone), none says another non-zero exit (76, a watchdog stop, has its own
        path), and a node never reported its exit (it vanished with its machine). SkyPilot reports
        such a job FAILED, without the exit marker, when its job driver sees a node's task die
        before the survivors' exit reaches the log (seen on the emulated Lambda cloud): counted as
        a trainer failure, preemptions would use up ``recovery.max_restarts_on_errors``. Returns
        what happened, or None."""
        nnodes = self.ctx.spec.resources.nodes
        if nnodes < 2:
            return None
        recs = self.observer.node_records(n)
        if recs is None:
            return None
        exited = {r.get("rank"): r.get("exit_code") for r in recs if r.get("state") == "EXITED"}
        if any(c not in PREEMPT_EXIT_CODES and c != 0 for c in exited.values()):
            return None  # a node's own failure: the trainer failed
        resumers = sorted(r for r, c in exited.items() if c == runuri.EXIT_PREEMPTED)
        silent = [r for r in range(nnodes) if r not in exited]
        if not resumers or not silent:
            return None
        return (f"node {', '.join(map(str, silent))} of {nnodes} stopped reporting (lost); "
                f"node {', '.join(map(str, resumers))} exited {exited[resumers[0]]} (resume me)")

    def begin_recovery(self, outcome: str, reason: str, planned: bool = False) -> None:
        """End the current attempt with ``outcome`` and go RECOVERING: a new attempt after the
        backoff (at once when ``planned``), once every node is confirmed gone."""
        ctx = self.ctx
        now = ctx.now()
        att = ctx.current_attempt()
        if att:
            ctx.end_attempt(att["n"], outcome, reason)
        # Work lost: steps trained past the newest committed checkpoint.
        job = ctx.job()
        committed = self.observer.latest_committed_step() or 0
        lost = max(0, (job["step"] or 0) - committed)
        if lost:
            ctx.store.update_job(ctx.name, steps_lost=(job["steps_lost"] or 0) + lost)
        self.recovery.ended(now, planned)
        ctx.event(outcome, reason + (f"; {lost} steps lost" if lost else ""))
        ctx.transition("RECOVERING", reason)
        self.teardown.terminate_nodes()

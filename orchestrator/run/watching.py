"""Watching a live attempt, tick by tick: observe it, tell how it ended, act on that.

Each tick of a PROVISIONING/RUNNING job (no launch in flight): poll the nodes, read
``progress.json`` (the job's step, loss, heartbeat) and ``DONE``; a running node whose trainer
stopped heartbeating is lost; an attempt with an ended node is judged (preempted, trainer failed,
rejected its configuration, stopped by its watchdog, …) and acted on — a new attempt after
backoff, a counted restart, or a stop. The money guard runs on every tick that bills.
"""

from __future__ import annotations

from typing import Any

from orchestrator.run.context import JobContext
from orchestrator.run.observe import Observer
from orchestrator.run.outcome import AttemptView, Ending, Next, Outcome, decide
from orchestrator.run.recovery import Recovery
from orchestrator.run.teardown import Teardown
from providers.base import NodeState


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
        prog, mine = self._progress(now, att)
        done = obs.done() is not None
        if states is None and not done:
            # The provider cannot say what the node is doing, but it is billing all the same:
            # the budget and deadline guard must not wait for the status API to come back.
            self.teardown.apply_guard(now, running=False)
            return
        values = list((states or {}).values())
        running = bool(values) and all(s == NodeState.RUNNING for s in values)
        silent = phase = None
        if running and not done:
            if ctx.state == "PROVISIONING":
                ctx.store.update_attempt(ctx.name, n, state="RUNNING", running_at=now)
                obs.last_progress_at = now
                ctx.transition("RUNNING", f"attempt {n} running")
            # heartbeat: a running node whose trainer stopped writing progress.json is lost.
            # Keyed on the heartbeat's time only: the trainer beats from a thread through long
            # phases (checkpoint load, first-step compile) without a step; "no step" is the
            # idle guard's business (teardown.idle_minutes).
            running_at = ctx.attempt_running_at(n) or now
            beat = prog.get("time") if mine and prog else None
            last_beat = max(float(beat) if isinstance(beat, (int, float)) else running_at, running_at)
            silent = now - last_beat
            phase = prog.get("phase") if mine and prog and prog.get("phase") else None
        view = obs.view(att, nodes, values, done=done, silent_s=silent, phase=phase)
        ending = decide(view)
        if ending is not None:
            self.act(ending, view)
            return
        if running:
            self.teardown.apply_guard(now, running=True)
            return
        # PENDING (provisioning) or a mix with RUNNING
        if self.recovery.started is not None:
            why = self.recovery.overdue(now)
            if why:
                self.teardown.give_up(why)
            if ctx.state != "PROVISIONING" and ctx.state != "RUNNING":
                return
        self.teardown.apply_guard(now, running=False)

    def _progress(self, now: float, att: dict) -> tuple[dict | None, bool]:
        """Read ``progress.json`` into the job (step, loss, …); (it, whether attempt ``att`` wrote it)."""
        ctx, obs, n = self.ctx, self.observer, att["n"]
        prog = obs.read_progress()
        mine = prog is not None and str(prog.get("attempt", n)) == str(n)
        if prog is None:
            return None, False
        step = prog.get("step")
        cols: dict[str, Any] = dict(step=step, loss=prog.get("loss"), tokens_per_s=prog.get("tokens_per_s"),
                                    val_loss=prog.get("val_loss"), last_committed_step=prog.get("last_committed_step"),
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
        return prog, mine

    def act(self, e: Ending, view: AttemptView) -> None:
        """Do what ``e`` (``outcome.decide``'s verdict on ``view``) says about attempt ``view.n``."""
        ctx, n = self.ctx, view.n
        if e.next is Next.STOP:
            if e.outcome is Outcome.SUCCEEDED:
                ctx.event("done", "DONE written by the trainer: tearing down")
            if e.end_now:
                ctx.end_attempt(n, e.outcome, e.reason)
            self.teardown.begin_stop(e.target or "FAILED", e.stop_reason or e.reason, write_stop=False)
        elif e.next is Next.FAIL:
            self.teardown.fail_now(n, e.reason, view.log_tail)
        elif e.next is Next.RETRY_ERROR:
            tail = view.log_tail
            used = ctx.job()["restarts_used"] + 1
            ctx.store.update_job(ctx.name, restarts_used=used)
            limit = ctx.spec.recovery.max_restarts_on_errors
            why = self.recovery.restart_refusal(used)
            if why:
                self.teardown.fail_now(n, f"{e.reason} ({why})", tail)
                return
            ctx.event("failed", f"{e.reason}; restart {used} of {limit}" + (f"\n{tail}" if tail else ""))
            self.begin_recovery(e.outcome, f"attempt {n}: trainer failed (restart {used}/{limit})")
        else:
            self.begin_recovery(e.outcome, e.reason, planned=e.next is Next.RESTART)

    def begin_recovery(self, outcome: Outcome, reason: str, planned: bool = False) -> None:
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
        ctx.event(str(outcome), reason + (f"; {lost} steps lost" if lost else ""))
        ctx.transition("RECOVERING", reason)
        self.teardown.terminate_nodes()

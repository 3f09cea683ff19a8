"""What a node does in ``dtrun simulate``, in virtual time: the node model the simulated runs share.

No trainer runs. From the same assumptions as the dry run's estimate (``plan/hours.py``):

* start-up: the fake instance provisions for provisioning + setup minutes of the chosen
  provider (``hours.startup``: the price snapshot's ``startup:`` figures, with or without a
  prebuilt image) — billed — then, on a resume, loads the newest COMMITTED checkpoint
  (checkpoint bytes ÷ ``hours.CHECKPOINT_BANDWIDTH``), and warms up (first step, plus compile
  when ``trainer.compile``);
* training: one step every ``hours.step_seconds`` (6 × active params × tokens per step ÷
  (GPUs × peak FLOP/s × MFU)); a checkpoint every ``every`` steps stalls the loop for
  ``hours.checkpoint_save_seconds`` and then counts as COMMITTED;
* a preemption is hard (no notice, no emergency checkpoint): the work since the last COMMITTED
  step is lost — unless the provider's notice (a seeded share of preemptions) leaves time for
  an emergency checkpoint; the node honours STOP (checkpoint, exit 0) and exits 0 with DONE at
  the end.

:class:`Simulation` writes ``progress.json``, ``checkpoints/step-N/COMMITTED`` and ``DONE`` into
the run URI as virtual time passes (a hook on the virtual clock), so the controller sees exactly
what it would see from a real node.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from orchestrator.contract import runuri


@dataclass(frozen=True)
class Model:
    """What one node does, in seconds and steps."""

    total_steps: int
    step_s: float
    every: int
    save_s: float
    load_s: float
    compile_s: float
    """First step + compile: after the node is up, before it trains."""
    provision_s: float
    """Provisioning + setup: the fake instance's ``provision_seconds`` (billed)."""
    emergency_s: float = 0.0
    """A synchronous (emergency) checkpoint on a preemption notice: checkpoint bytes ÷ bandwidth."""


@dataclass
class SimNode:
    iid: str
    attempt: int
    ready_at: float
    start_step: int = 0
    train_start: float = 0.0
    stop_seen: float | None = None
    finished: bool = False
    end_step: int = 0
    end_committed: int = 0

    def progress(self, m: Model, t: float) -> tuple[int, int, float | None]:
        """(step, committed step, time DONE was written or None) at time ``t``."""
        s, committed, tt = self.start_step, self.start_step, self.train_start
        if t < tt:
            return s, committed, None
        while s < m.total_steps:
            nxt = min(m.total_steps, (s // m.every + 1) * m.every)
            dur = (nxt - s) * m.step_s
            if tt + dur > t:
                return s + int((t - tt) / m.step_s), committed, None
            tt += dur
            s = nxt
            if tt + m.save_s > t:
                return s, committed, None
            tt += m.save_s
            committed = s
        return s, committed, tt


class Simulation:
    """One simulated run's node model, hooked to the virtual clock."""

    def __init__(self, model: Model, cloud: Any, run_uri: str,
                 notice: dict[str, tuple[float, float]] | None = None, seed: int = 0) -> None:
        self.m = model
        self.cloud = cloud
        self.uri = run_uri
        self.notice = dict(notice or {})
        """Per fake-cloud region (one per offer): (notice seconds, share of soft preemptions)."""
        self.seed = seed
        self.soft = 0
        self.soft_saved = 0
        self.nodes: dict[str, SimNode] = {}
        self.committed = 0
        self.prev: float | None = None
        self.preemptions = 0
        self.lost_steps = 0
        self.done_at: float | None = None
        self._written_commits: set[int] = set()

    def _commit(self, step: int) -> None:
        if step > self.committed:
            self.committed = step
        if step > 0 and step not in self._written_commits:
            self._written_commits.add(step)
            runuri.write_json(runuri.join(runuri.checkpoint_uri(self.uri, step), runuri.COMMITTED),
                              {"step": step, "world_size": 1, "time": 0})

    def hook(self, now: float) -> None:
        prev = self.prev if self.prev is not None else now
        self.prev = now
        stop = None
        for inst in self.cloud.instances():
            node = self.nodes.get(inst.id)
            if node is None:
                node = SimNode(inst.id, int(inst.env.get("DTRUN_ATTEMPT", "0") or 0), inst.ready_at)
                node.start_step = -1
                self.nodes[inst.id] = node
            if node.finished:
                continue
            end_t = inst.ended_at if inst.phase in ("preempted", "terminated", "exited") else None
            t = min(now, end_t) if end_t is not None else now
            if t < inst.ready_at:
                if end_t is not None:
                    node.finished = True  # gone before it ever ran
                continue
            if node.start_step < 0:
                node.start_step = self.committed
                resume = self.m.load_s if self.committed > 0 else 0.0
                node.train_start = inst.ready_at + resume + self.m.compile_s
            if stop is None:
                stop = runuri.exists(runuri.join(self.uri, runuri.STOP))
            if stop and node.stop_seen is None and end_t is None:
                node.stop_seen = max(prev, inst.ready_at)
            step, committed, done_t = node.progress(self.m, t)
            exit_at = None
            if node.stop_seen is not None:
                s_stop, _, d_stop = node.progress(self.m, node.stop_seen)
                if d_stop is None:
                    exit_at = max(node.stop_seen, node.train_start) + self.m.save_s
                    if exit_at <= t:
                        step = committed = s_stop
                        self._commit(s_stop)
                        self._end(node, inst, exit_at, step, step, now, end_t, code=0)
                        continue
            if done_t is not None and (end_t is None or done_t <= end_t):
                self._commit(committed)
                self.done_at = done_t
                runuri.write_json(runuri.join(self.uri, runuri.DONE), {"step": step, "time": done_t})
                self._progress(node, step, committed, done_t)
                self._end(node, inst, done_t, step, committed, now, end_t, code=0)
                continue
            if end_t is not None and inst.phase == "preempted":
                step, committed = self._notice(node, inst, end_t, step, committed)
            if committed > 0:
                self._commit(committed)
            self._progress(node, step, committed, t)
            if end_t is not None:
                node.finished = True
                node.end_step, node.end_committed = step, committed
                if inst.phase == "preempted":
                    self.preemptions += 1
                self.lost_steps += max(0, step - committed)

    def _notice(self, node: SimNode, inst: Any, end_t: float, step: int, committed: int) -> tuple[int, int]:
        """A soft preemption (the provider's notice, for a seeded share of preemptions): the
        trainer stops stepping at the notice and writes an emergency checkpoint; it is COMMITTED
        when the save fits in the notice, and then nothing since the last checkpoint is lost."""
        grace, frac = self.notice.get(inst.region, (0.0, 0.0))
        if grace <= 0 or frac <= 0 or random.Random(f"{self.seed}:{inst.id}").random() >= frac:
            return step, committed
        self.soft += 1
        at = end_t - grace
        if at < node.train_start or grace < self.m.emergency_s:
            return step, committed  # still starting, or the save does not fit: lost as if hard
        s_n, _, _ = node.progress(self.m, at)
        self.soft_saved += 1
        return s_n, max(committed, s_n)

    def _progress(self, node: SimNode, step: int, committed: int, t: float) -> None:
        runuri.write_json(runuri.join(self.uri, runuri.PROGRESS),
                          {"step": step, "steps": self.m.total_steps, "last_committed_step": committed,
                           "time": t, "attempt": node.attempt, "loss": None, "tokens_per_s": None})

    def _end(self, node: SimNode, inst: Any, at: float, step: int, committed: int, now: float,
             end_t: float | None, code: int) -> None:
        node.finished = True
        node.end_step, node.end_committed = step, committed
        if end_t is None:
            self.cloud.set_exit(inst.id, at=at, code=code)

"""The node's watchdog: it stops the run, with or without a controller, before the node's money
or time runs out.

Every ``check_seconds`` (``DTRUN_WATCHDOG_SECONDS``, default 10) :meth:`Watchdog.check` asks, in
this order:

- ``budget``: this node's spend (``DTRUN_PRICE_PER_HOUR`` × time since ``DTRUN_LAUNCHED_AT``, else
  the bootstrap's start) would reach ``DTRUN_BUDGET_LEFT_USD`` by the next check plus a whole stop
  sequence (both graces), so even a trainer that has to be killed is gone before the money runs out;
- ``deadline``: ``DTRUN_DEADLINE`` (unix time) is within two check intervals plus both graces;
- ``restart``: the provider ends this node ``DTRUN_NODE_TIMEOUT_SECONDS`` after its start
  (Modal's 24-hour sandbox cap); ``DTRUN_RESTART_GRACE_SECONDS`` before that, less the same
  margins, it stops for a planned restart (checkpoint, exit 76, resume elsewhere);
- ``controller_lost``: ``lease.json`` has been expired longer than
  ``DTRUN_CONTROLLER_LOST_MINUTES`` (only when set; no lease counts from the node's start);
- ``idle``: ``progress.json``'s (attempt, step) has not moved for ``DTRUN_IDLE_MINUTES``.

Stopping (:func:`run_watchdog`) = ``watchdog.json`` (why) and ``STOP`` in the run URI (the
trainer checkpoints and exits 0); still running after ``stop_grace_seconds``: SIGTERM to the
process tree (emergency checkpoint); after ``kill_grace_seconds`` more: SIGKILL. An unreadable run
URI never stops a run by itself. Standard library only (plus the contract): never torch.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time

from infra.node_config import NodeConfig
from infra.node_log import log
from infra.node_proctree import signal_tree
from orchestrator.contract import runuri

REASONS = ("budget", "deadline", "restart", "controller_lost", "idle")
"""Why a watchdog stops a run (``watchdog.json``'s ``reason``), in the order it checks."""


class Watchdog:
    """Checks budget, deadline, lease and progress every ``check_seconds``; stops the trainer
    (STOP, grace, SIGTERM, SIGKILL) on the first reason it finds."""

    def __init__(self, cfg: NodeConfig, start: float, clock=time.time):
        self.cfg = cfg
        self.clock = clock
        self.spend_since = cfg.launched_at if cfg.launched_at is not None else start
        self.started = start
        self.restart_at = (start + cfg.node_timeout_seconds - cfg.restart_grace_seconds
                           if cfg.node_timeout_seconds else None)
        self.reason: str | None = None
        self.detail: str = ""
        self._last_step: tuple | None = None
        self._last_progress_at = start
        self._read_errors = 0

    # -- individual checks (each returns a detail string when it fires) --
    def spend_usd(self, at: float) -> float:
        if self.cfg.price_per_hour is None:
            return 0.0
        return self.cfg.price_per_hour * max(0.0, at - self.spend_since) / 3600.0

    def check_budget(self, now: float) -> str | None:
        c = self.cfg
        if c.price_per_hour is None or c.budget_left_usd is None:
            return None
        # the whole stop sequence must fit: the next check, the STOP grace, the SIGTERM grace
        ahead = now + c.check_seconds + c.stop_grace_seconds + c.kill_grace_seconds
        if self.spend_usd(ahead) >= c.budget_left_usd:
            return (f"spend ${self.spend_usd(now):.4f} would reach the node's budget "
                    f"${c.budget_left_usd:.4f} by the next check plus a full stop sequence")
        return None

    def check_deadline(self, now: float) -> str | None:
        c = self.cfg
        if c.deadline is None:
            return None
        if now + 2 * c.check_seconds + c.stop_grace_seconds + c.kill_grace_seconds >= c.deadline:
            return f"deadline {c.deadline:.0f} is {c.deadline - now:.0f}s away"
        return None

    def check_restart(self, now: float) -> str | None:
        """The provider's own end of this node (its timeout) less the grace is near, and comes
        before the job's deadline (that one is ``deadline``)."""
        c = self.cfg
        if self.restart_at is None or (c.deadline is not None and c.deadline <= self.restart_at):
            return None
        if now + 2 * c.check_seconds + c.stop_grace_seconds + c.kill_grace_seconds >= self.restart_at:
            end = self.restart_at + c.restart_grace_seconds
            return (f"planned restart: the provider's {c.node_timeout_seconds:.0f}s timeout ends this node "
                    f"in {end - now:.0f}s (restart grace {c.restart_grace_seconds:.0f}s)")
        return None

    def _read(self, name: str):
        try:
            return runuri.read_json(runuri.join(self.cfg.run_uri, name)), True
        except Exception as e:  # a flaky object store must not stop (or crash) a healthy run
            self._read_errors += 1
            if self._read_errors <= 3 or self._read_errors % 100 == 0:
                log(f"watchdog: cannot read {name}: {type(e).__name__}: {e}")
            return None, False

    def check_lease(self, now: float) -> str | None:
        c = self.cfg
        if c.controller_lost_minutes is None:
            return None
        lease, ok = self._read(runuri.LEASE)
        if not ok:
            return None
        expires = None
        if isinstance(lease, dict):
            try:
                expires = float(lease.get("expires"))
            except (TypeError, ValueError):
                expires = None
        if expires is None:
            expires = self.started  # no lease at all: stale from our start
        stale = now - expires
        if stale > c.controller_lost_minutes * 60:
            return f"controller lease expired {stale:.0f}s ago (limit {c.controller_lost_minutes * 60:.0f}s)"
        return None

    def check_idle(self, now: float) -> str | None:
        c = self.cfg
        if c.idle_minutes is None:
            return None
        prog, ok = self._read(runuri.PROGRESS)
        if ok and isinstance(prog, dict):
            key = (prog.get("attempt"), prog.get("step"))
            if key != self._last_step:
                if self._last_step is not None:
                    self._last_progress_at = now
                self._last_step = key
        idle = now - self._last_progress_at
        if idle > c.idle_minutes * 60:
            return f"no training progress for {idle:.0f}s (limit {c.idle_minutes * 60:.0f}s)"
        return None

    def check(self, now: float | None = None) -> tuple[str, str] | None:
        now = self.clock() if now is None else now
        for reason, fn in (("budget", self.check_budget), ("deadline", self.check_deadline),
                           ("restart", self.check_restart),
                           ("controller_lost", self.check_lease), ("idle", self.check_idle)):
            detail = fn(now)
            if detail:
                return reason, detail
        return None

    def record(self, reason: str, detail: str) -> None:
        """watchdog.json first (why), then STOP (the trainer checkpoints and exits 0)."""
        self.reason, self.detail = reason, detail
        now = self.clock()
        rec = {"reason": reason, "detail": detail, "time": now, "job": self.cfg.job,
               "attempt": self.cfg.attempt, "node_rank": self.cfg.node_rank,
               "host": socket.gethostname(), "spend_usd": round(self.spend_usd(now), 6)}
        for name, text in ((runuri.WATCHDOG, json.dumps(rec, sort_keys=True)),
                           (runuri.STOP, json.dumps({"by": "watchdog", **rec}, sort_keys=True))):
            for attempt in range(3):
                try:
                    runuri.write_text(runuri.join(self.cfg.run_uri, name), text)
                    break
                except Exception as e:  # keep trying: STOP is how the trainer checkpoints
                    log(f"watchdog: cannot write {name} ({type(e).__name__}: {e}); retrying")
                    time.sleep(0.5 * (attempt + 1))


def run_watchdog(wd: Watchdog, child: subprocess.Popen, done: threading.Event) -> None:
    cfg = wd.cfg
    while not done.wait(cfg.check_seconds):
        hit = wd.check()
        if hit is None:
            continue
        reason, detail = hit
        log(f"watchdog: stopping the run ({reason}: {detail})")
        wd.record(reason, detail)
        if done.wait(cfg.stop_grace_seconds):
            return
        log(f"watchdog: trainer still running {cfg.stop_grace_seconds:.0f}s after STOP; SIGTERM")
        signal_tree(child.pid, signal.SIGTERM)
        if done.wait(cfg.kill_grace_seconds):
            return
        log(f"watchdog: trainer still running {cfg.kill_grace_seconds:.0f}s after SIGTERM; SIGKILL")
        signal_tree(child.pid, signal.SIGKILL)
        return

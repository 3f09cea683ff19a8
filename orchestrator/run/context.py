"""What every part of one job's controller shares: the spec, the state store, the clock, the
providers and the job's record (its state, events and attempts).

The controller (``orchestrator.run.controller``) is a front door over parts, each one concern —
``launching`` (with ``launchthread``), ``ledger``, ``observe``, ``outcome``, ``teardown``,
``recovery``, ``loop``. They meet through one :class:`JobContext` and never call each other's
private methods. :func:`describe_error` is how every part writes an exception into an event.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Callable

from orchestrator.contract import runuri
from orchestrator.plan.spec import JobSpec
from orchestrator.run.clock import Clock
from orchestrator.run.state import StateStore
from providers.base import Provider

_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL", re.I)


def describe_error(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (at most ``limit`` characters) with the values of
    secret-looking environment variables (``*KEY*``, ``*SECRET*``, ``*TOKEN*``, …) masked."""
    lines = str(e).strip().splitlines()
    msg = lines[0][:limit] if lines else ""
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_NAME.search(name) and value in msg:
            msg = msg.replace(value, f"<{name}>")
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def resolved_spec(spec: JobSpec) -> JobSpec:
    """The spec with its run URI made absolute (a detached controller or a node may run
    elsewhere than the directory the user typed ``dtrun up`` in)."""
    ck = spec.checkpoint.model_copy(update={"uri": spec.run_uri})
    return spec.model_copy(update={"checkpoint": ck})


class JobContext:
    """One job as its controller's parts see it. ``spec`` may be replaced once at start (auto
    settings resolved); the name and the run URI never change."""

    def __init__(self, spec: JobSpec, store: StateStore, clock: Clock,
                 providers: dict[str, Provider] | None = None,
                 on_event: Callable[[str, str], None] | None = None) -> None:
        self.spec = spec
        self.store = store
        self.clock = clock
        self.providers: dict[str, Provider] = dict(providers or {})
        self.on_event = on_event
        self.name = spec.name
        self.run_uri = spec.run_uri
        self._cluster_seen: dict[int, list[dict]] = {}

    # ---- providers and time ----------------------------------------------------------------------
    def provider(self, name: str) -> Provider:
        if name not in self.providers:
            from providers import registry

            self.providers[name] = registry.get(name)
        return self.providers[name]

    def now(self) -> float:
        return self.clock.now()

    # ---- the job's record ------------------------------------------------------------------------
    def job(self) -> dict:
        j = self.store.get_job(self.name)
        assert j is not None
        return j

    @property
    def state(self) -> str:
        return self.job()["state"]

    def event(self, type_: str, message: str, data: dict | None = None) -> None:
        self.store.add_event(self.name, type_, message, data, t=self.now())
        if self.on_event:
            self.on_event(type_, message)

    def safe_event(self, type_: str, message: str, data: dict | None = None) -> None:
        """An event that must not raise (the state store itself may be what is failing): printed
        to stderr when it cannot be recorded."""
        try:
            self.event(type_, message, data or {})
        except Exception as e:  # noqa: BLE001 - the state store itself may be failing
            print(f"dtrun controller: {type_}: {message} (not recorded: {describe_error(e)})",
                  file=sys.stderr, flush=True)

    def transition(self, state: str, reason: str | None = None, **cols: Any) -> None:
        self.store.set_state(self.name, state, reason, t=self.now(), **cols)
        if self.on_event:
            self.on_event("state", state + (f": {reason}" if reason else ""))

    # ---- attempts --------------------------------------------------------------------------------
    def session_attempts(self) -> list[dict]:
        first = self.job()["session_first_attempt"]
        return [a for a in self.store.attempts(self.name) if a["n"] >= first]

    def current_attempt(self) -> dict | None:
        atts = self.store.attempts(self.name)
        return atts[-1] if atts else None

    def attempt_running_at(self, n: int) -> float | None:
        a = self.store.get_attempt(self.name, n)
        return a["running_at"] if a else None

    def sync_cluster(self, n: int) -> None:
        """Several nodes: copy each node's record (``nodes/a<n>/node-<r>.json``) into the attempt."""
        if self.spec.resources.nodes < 2:
            return
        try:
            recs = runuri.node_records(self.run_uri, n)
        except OSError:
            return
        if recs and recs != self._cluster_seen.get(n):
            self._cluster_seen[n] = recs
            self.store.update_attempt(self.name, n, nodes_json=json.dumps(recs))

    def end_attempt(self, n: int, outcome: str, reason: str) -> None:
        """Record attempt ``n`` ended (once): ``outcome`` is an ``orchestrator.run.outcome.Outcome``
        (stored as its string value)."""
        a = self.store.get_attempt(self.name, n)
        if a and a["state"] == "ENDED":
            return
        self.sync_cluster(n)
        self.store.update_attempt(self.name, n, state="ENDED", outcome=str(getattr(outcome, "value", outcome)),
                                  reason=reason, ended_at=self.now(), end_step=self.job()["step"])

    def summary(self) -> dict:
        """The job's wall time, cost, attempts (this session's) and steps lost, as of now."""
        job = self.job()
        atts = self.session_attempts()
        start = job["started_at"] or job["created"]
        end = job["finished_at"] or self.now()
        return {"name": self.name, "state": job["state"], "reason": job["reason"],
                "wall_s": max(0.0, end - start), "cost_usd": self.store.spend_total(self.name),
                "attempts": len(atts), "steps_lost": job["steps_lost"] or 0, "step": job["step"],
                "steps": job["steps"]}

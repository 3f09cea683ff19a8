"""Observing an attempt: the provider's polls and the run URI's reads, as the controller sees them.

Everything the controller learns about a running attempt comes through here: each node's state
(``provider.poll``), ``progress.json`` (the heartbeat), ``DONE``, the newest COMMITTED step, the
node watchdog's ``watchdog.json``, the node records and logs under ``nodes/a<n>/``, the local
provider's exit file, and what a provider says ended a node (``end_reason``, Modal's eviction).
An unreachable store reads as "nothing there yet" (a warning at most), never as a crash.

:meth:`Observer.view` gathers one tick's observations into an ``outcome.AttemptView``, the typed
input of ``outcome.decide``. The run-URI files an ended attempt is judged by (node records,
their logs, ``watchdog.json``, the exit file, the providers' end reasons, the log tail) are read
only once a node has ended.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.contract import runuri
from orchestrator.run.context import JobContext
from orchestrator.run.outcome import AttemptView, NodeRecord, node_message
from providers import errors as perr
from providers.base import Handle, NodeState


class Observer:
    def __init__(self, ctx: JobContext) -> None:
        self.ctx = ctx
        self.progress: dict | None = None
        """The newest ``progress.json`` read (whatever attempt wrote it)."""
        self.last_step: int | None = None
        self.last_progress_at: float | None = None
        """When the step last changed (or a node was recorded, or started running): the idle guard's clock."""

    # ---- the run URI -----------------------------------------------------------------------------
    def latest_committed_step(self) -> int | None:
        try:
            lc = runuri.latest_committed(self.ctx.run_uri)
        except OSError:
            return None
        return lc[0] if lc else None

    def read_progress(self) -> dict | None:
        try:
            p = runuri.read_json(runuri.join(self.ctx.run_uri, runuri.PROGRESS))
        except OSError as e:
            self.ctx.event("warning", f"could not read progress.json: {e}")
            return None
        if not isinstance(p, dict):
            return None
        self.progress = p
        return p

    def done(self) -> dict | None:
        """``DONE``'s record ({} when it is not JSON), or None when the trainer has not finished."""
        try:
            d = runuri.read_text(runuri.join(self.ctx.run_uri, runuri.DONE))
        except OSError:
            return None
        if d is None:
            return None
        try:
            rec = json.loads(d)
        except json.JSONDecodeError:
            rec = {}
        return rec if isinstance(rec, dict) else {}

    def watchdog_reason(self, att: dict) -> str | None:
        """Why the node's watchdog stopped attempt ``att`` (``watchdog.json``), or None."""
        try:
            wd = runuri.read_json(runuri.join(self.ctx.run_uri, runuri.WATCHDOG))
        except OSError:
            return None
        if not isinstance(wd, dict):
            return None
        t = wd.get("time")
        if isinstance(t, (int, float)) and att.get("launched_at") and t < att["launched_at"] - 1:
            return None  # from an earlier attempt
        r = wd.get("reason")
        return r if isinstance(r, str) else None

    def node_records(self, n: int) -> list[dict] | None:
        """Attempt ``n``'s node records (what each node's bootstrap wrote), or None if unreadable."""
        try:
            return runuri.node_records(self.ctx.run_uri, n)
        except OSError:
            return None

    def node_log(self, n: int, rank: int) -> str:
        """Node ``rank``'s output in the run URI (``nodes/a<n>/node-<rank>.log``), '' if none."""
        try:
            return runuri.read_text(runuri.node_uri(self.ctx.run_uri, n, rank, "log")) or ""
        except OSError:
            return ""

    def records(self, n: int) -> tuple[NodeRecord, ...]:
        """Attempt ``n``'s node records, typed; a node that exited 2 with what it said."""
        out = []
        for r in self.node_records(n) or []:
            rec = NodeRecord.from_dict(r)
            if rec.exited and rec.exit_code == runuri.EXIT_BAD_CONFIG:
                rec = NodeRecord.from_dict(r, node_message(self.node_log(n, rec.rank)))
            out.append(rec)
        return tuple(out)

    # ---- the typed view --------------------------------------------------------------------------
    def view(self, att: dict, nodes: list[dict], states: list[NodeState], *, done: bool,
             silent_s: float | None = None, phase: str | None = None) -> AttemptView:
        """What this tick saw of attempt ``att`` (its live ``nodes``, their ``states``)."""
        n = att["n"]
        base = dict(n=n, nnodes=self.ctx.spec.resources.nodes, states=tuple(states), done=done, silent_s=silent_s,
                    heartbeat_timeout=self.ctx.spec.recovery.heartbeat_timeout_seconds, phase=phase)
        if done or not any(s.is_terminal for s in states):
            return AttemptView(**base)
        records = self.records(n)
        code = self.exit_file_code(att)
        failed = NodeState.FAILED in states or code == runuri.EXIT_BAD_CONFIG or any(
            r.exit_code == runuri.EXIT_BAD_CONFIG for r in records)
        return AttemptView(**base, records=records, exit_code=code, watchdog=self.watchdog_reason(att),
                           end_reason=self.end_reasons(nodes), log_tail=self.log_tail(nodes) if failed else "")

    # ---- the providers ---------------------------------------------------------------------------
    def poll_nodes(self, nodes: list[dict]) -> dict[int, NodeState] | None:
        """Each node's state by node id (recorded when it changed), or None when a poll failed."""
        out: dict[int, NodeState] = {}
        for nd in nodes:
            try:
                st = self.ctx.provider(nd["provider"]).poll(Handle.from_dict(nd["handle"]))
            except perr.ProviderError as e:
                self.ctx.event("warning", f"poll {nd['name']}: {type(e).__name__}: {e}; retrying next tick")
                return None
            out[nd["id"]] = st
            if nd["state"] != st.value:
                self.ctx.store.update_node(nd["id"], state=st.value)
        return out

    def end_reasons(self, nodes: list[dict]) -> str:
        """What the providers say ended these nodes (Modal: an eviction), joined; '' if nothing."""
        out: list[str] = []
        for nd in nodes:
            try:
                why = self.ctx.provider(nd["provider"]).end_reason(Handle.from_dict(nd["handle"]))
            except perr.ProviderError:
                why = None
            if why and why not in out:
                out.append(why)
        return "; ".join(out)

    @staticmethod
    def exit_file_code(att: dict) -> int | None:
        """The exit code in ``<attempt log>.exit`` (the local provider writes it), or None."""
        lp = att.get("log_path")
        if not lp:
            return None
        try:
            return int(Path(lp + ".exit").read_text().strip())
        except (OSError, ValueError):
            return None

    def log_tail(self, nodes: list[dict], lines: int = 15) -> str:
        """The last ``lines`` of each node's output: the provider's logs, else the local log file."""
        out = []
        for nd in nodes:
            try:
                text = self.ctx.provider(nd["provider"]).logs(Handle.from_dict(nd["handle"]), tail=lines)
            except perr.ProviderError:
                text = ""
            if not text and nd["handle"].get("data", {}).get("log_path"):
                try:
                    text = "\n".join(Path(nd["handle"]["data"]["log_path"]).read_text(errors="replace")
                                     .splitlines()[-lines:])
                except OSError:
                    text = ""
            if text:
                out.append(text.rstrip())
        return "\n".join(out)

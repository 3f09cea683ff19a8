"""A controller replica: claims jobs through their leases and ticks each one's controller.

The seam (the smallest one ``orchestrator.run`` already has): a ``Controller`` is rebuilt from the
job's spec and the state store alone, and its ``start()`` re-attaches to an active job — it finds
the attempt and the nodes recorded there (provider handle: instance id, name) and watches them; it
never launches again for an attempt whose node is recorded. So a replica keeps one ``Controller``
per job it owns and calls ``tick()`` on each; a replica that takes a job over from a dead one just
builds a new ``Controller`` for it. Spend is booked by the controller's ledger in the state store
per attempt, each row up to ``billed_until``: the new owner books on from where the old one
stopped (no gap) and never re-books time already booked (no double count). After each tick the
replica copies the job's state and booked spend into the server's ``jobs`` row, *fenced* by its
lease epoch (``orchestrator.server.leases.fenced``).

Fencing and launches: a replica ticks a job only right after renewing its lease, and only while
more than half the lease's TTL is left; a tick (launches run in a worker thread the tick waits on
for at most ``launch_wait_seconds``) must take less than that. A replica paused longer than that
between renew and tick is the case this does not cover (the launch itself is not fenced by the
provider).

The controllers' state store. ``dtrun server`` gives every replica a
``orchestrator.server.ctlstore.CtlStore``: the jobs' controller rows, attempts, nodes (provider
handles), events and spend rows live in the server database (``ctl_*`` tables), so replicas on
different machines share them through the database alone — nothing in a replica's own
``$DTRUN_HOME``. A replica that takes a job over records itself as its controller
(``CtlStore.adopt``: the lease, not a pid, says who runs it), finds the attempt and the node the
dead owner recorded, re-attaches to it (no second launch) and books on from that attempt's
``billed_until``. Any ``StateStore`` works here too (the tests give one SQLite file to replicas
of one machine). Store reads happen outside the replica's own server-database transactions: on a
SQLite server database the store's transaction would wait on the replica's (one writer).

While another replica is healthy a replica claims nothing of its jobs: it renews the leases it
holds and polls for free or expired ones every tick — one ``SKIP LOCKED`` query — and builds no
controller, so it reads nothing of those jobs and launches nothing. A job is adopted within one
lease TTL (``leases.TTL_S``, 15 s) of its owner's last renew, plus at most one tick.

Team credentials: each controller's launcher gets the job's team's decrypted secrets at launch
time (``orchestrator.server.teamsecrets.team_node_storage``), never the server's environment.
Team cap: before ticking, the replica checks each team it runs jobs for
(``orchestrator.server.budget.cap_check``) and stops that team's jobs it owns with a checkpoint —
the job's own budget stop (``Teardown.begin_stop`` → OVER_BUDGET), its reason naming the team cap.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Callable

from sqlalchemy import select

from orchestrator.plan.spec import parse_spec
from orchestrator.run.clock import Clock, RealClock
from orchestrator.run.controller import Controller
from orchestrator.run.state import TERMINAL_STATES, StateStore
from orchestrator.server import budget, leases, teamsecrets
from orchestrator.server.db import session_scope
from orchestrator.server.jobs import add_event
from orchestrator.server.models import Attempt, Job, Team

# the controller's states → the server's (orchestrator.server.models.JOB_STATES)
_STATE = {"PENDING": "queued", "PROVISIONING": "running", "RUNNING": "running", "RECOVERING": "running",
          "STOPPING": "stopping", "SUCCEEDED": "finished", "FAILED": "failed", "CANCELLED": "stopped",
          "OVER_BUDGET": "stopped"}


class Replica:
    def __init__(self, engine: Any, store: StateStore, providers: dict[str, Any], clock: Clock | None = None,
                 *, replica_id: str | None = None, ttl: float = leases.TTL_S, max_jobs: int = 50,
                 make_plan: Callable[[Any], Any] | None = None, secret_key: bytes | None = None,
                 tick_seconds: float = 5.0, **controller_kw: Any) -> None:
        self.engine, self.store, self.providers = engine, store, providers
        self.clock = clock or RealClock()
        self.id = replica_id or f"replica-{uuid.uuid4().hex[:8]}"
        self.ttl, self.max_jobs = ttl, max_jobs
        self.make_plan = make_plan
        self.controller_kw = controller_kw
        self.owned: dict[int, int] = {}  # job id → epoch
        self.controllers: dict[int, Controller] = {}
        self.team_of: dict[int, int] = {}  # job id → team id
        self.secret_key, self.tick_seconds = secret_key, tick_seconds
        self._attempts_seen: dict[int, tuple] = {}  # job id → what its server attempt rows last said
        self._state: dict[int, str] = {}  # job id → the state its controller's last tick returned

    def tick(self) -> None:
        """Renew, claim what is free, tick every owned job's controller, write the results back."""
        now = self.clock.now()
        with session_scope(self.engine) as s:
            self.owned = leases.renew(s, self.id, self.owned, now, self.ttl)
            room = self.max_jobs - len(self.owned)
            if room > 0:
                self.owned.update(leases.claim(s, self.id, now, room, self.ttl))
            specs = {j.id: (j.spec, j.plan, j.team_id) for j in s.scalars(select(Job).where(Job.id.in_(self.owned)))}
        for jid in list(self.controllers):
            if jid not in self.owned:  # lost the lease: drop the controller, touch nothing more
                del self.controllers[jid]
                self.team_of.pop(jid, None)
                self._state.pop(jid, None)
        self.team_cap(now)
        renewed_at = now
        for jid, epoch in list(self.owned.items()):
            if self.clock.now() - renewed_at > self.ttl / 2:
                break  # too close to expiry: the next tick renews first
            ctl = self.controllers.get(jid)
            if ctl is None:
                spec = parse_spec(specs[jid][0])
                plan = self.make_plan(spec) if self.make_plan else None
                ctl = self.controllers[jid] = Controller(spec, self.store, clock=self.clock, providers=self.providers,
                                                         plan=plan, **self.controller_kw)
                if hasattr(self.store, "adopt"):  # the server database's store: the lease says it is ours now
                    self.store.adopt(ctl.name, ctl.pid)
                self.team_of[jid] = specs[jid][2]
                ctl.launcher.storage = self._team_storage(specs[jid][2])
            with (self.store.one_tick() if hasattr(self.store, "one_tick") else contextlib.nullcontext()):
                try:
                    state = ctl.tick()
                    err = None
                except Exception as e:  # one bad job never stops the replica's other jobs
                    state, err = None, f"{type(e).__name__}: {e}"
                self._state[jid] = state  # only its controller moves a job's state: team_cap reads it here
                self._write_back(jid, epoch, ctl, state, err)
        self.request_actions()

    def _write_back(self, jid: int, epoch: int, ctl: Controller, state: str | None, err: str | None) -> None:
        # the store is read before the server's transaction opens: on a SQLite server database the
        # store's own transaction would wait on that one (one writer at a time)
        row = (self.store.get_job(ctl.name) or {}) if err is None else {}
        spent = self.store.spend_total(ctl.name) if err is None else 0.0
        burn = ctl.burn_per_hour() if err is None and state not in TERMINAL_STATES else 0.0
        att = ctl.current_attempt() if err is None else None
        atts = self.store.attempts(ctl.name) if err is None else []
        spend = {r["attempt"]: r for r in self.store.spend_by_attempt(ctl.name)} if err is None else {}
        try:
            with session_scope(self.engine) as s, leases.fenced(s, self.id, jid, epoch) as job:
                if err is not None:
                    add_event(s, job, "error", f"{self.id}: tick failed: {err}")
                    return
                new = _STATE.get(state or "", job.state)
                if new != job.state:
                    add_event(s, job, "state", f"{new} ({row.get('reason') or state})")
                job.state, job.reason = new, row.get("reason")
                job.spend_usd = spent
                job.price_per_hour = burn
                job.booked_until = self.clock.now()
                job.attempt = att["n"] if att else 0
                seen = self._sync_attempts(s, jid, atts, spend)
                if state in TERMINAL_STATES:
                    leases.release(s, self.id, jid, epoch)
        except leases.LeaseLost:
            self._forget(jid)
            return
        if seen is not None:
            self._attempts_seen[jid] = seen
        if state in TERMINAL_STATES:
            self._forget(jid)

    def _forget(self, jid: int) -> None:
        self.owned.pop(jid, None)
        self.controllers.pop(jid, None)
        self.team_of.pop(jid, None)
        self._attempts_seen.pop(jid, None)
        self._state.pop(jid, None)

    def _sync_attempts(self, s: Any, jid: int, atts: list[dict], spend: dict[int, dict]) -> tuple | None:
        """Copy the job's attempts (outcome, booked spend) from the controllers' state store into the
        server's ``attempts`` table, so ``dtrun cost`` through the server shows them from any laptop;
        written only when an attempt's state, outcome or booked cents changed. Returns what was
        written (None: nothing new). ``atts``, ``spend``: read from the store by the caller."""
        key = tuple((a["n"], a["state"], a.get("outcome"), round(float((spend.get(a["n"]) or {}).get("usd") or 0), 2),
                     bool((spend.get(a["n"]) or {}).get("closed"))) for a in atts)
        if self._attempts_seen.get(jid) == key:
            return None
        have = {a.n: a for a in s.scalars(select(Attempt).where(Attempt.job_id == jid))}
        for a in atts:
            sp = spend.get(a["n"]) or {}
            row = have.get(a["n"]) or Attempt(job_id=jid, n=a["n"])
            row.provider, row.state, row.outcome, row.reason = a["provider"], a["state"], a.get("outcome"), a.get("reason")
            row.created, row.launched_at, row.ended_at = a["created"], a.get("launched_at"), a.get("ended_at")
            row.price_per_hour, row.seconds = sp.get("price_per_hour"), float(sp.get("seconds") or 0.0)
            row.spend_usd = float(sp.get("usd") or 0.0)
            if a["n"] not in have:
                s.add(row)
        return key

    def _team_storage(self, team_id: int) -> Callable[[Any, str], tuple[dict[str, str], dict[str, str]]]:
        """The launcher's ``storage`` for one team's job: its team's secrets, read at each launch."""
        def storage(spec: Any, provider: str) -> tuple[dict[str, str], dict[str, str]]:
            with session_scope(self.engine) as s:
                team = s.get(Team, team_id)
                found = teamsecrets.team_secrets(s, team_id, self.secret_key)
                name = team.name if team is not None else str(team_id)
            return teamsecrets.team_node_storage(found, name, spec, provider)
        return storage

    def team_cap(self, now: float) -> None:
        """Stop (with a checkpoint) this replica's jobs of every team whose month would be crossed."""
        teams: dict[int, list[Controller]] = {}
        for jid, ctl in self.controllers.items():
            # the state its last tick returned (no store read per job per tick); the store's when unknown
            if jid in self.owned and ctl.started and (self._state.get(jid) or ctl.state) not in TERMINAL_STATES:
                teams.setdefault(self.team_of[jid], []).append(ctl)
        for tid, ctls in teams.items():
            grace = max(c.stop_grace for c in ctls)
            with session_scope(self.engine) as s:
                team = s.get(Team, tid)
                verdict = budget.cap_check(s, team, now, self.tick_seconds, grace) if team is not None else None
            if verdict is None:
                continue
            how, reason = verdict
            for ctl in ctls:
                if ctl.state == "STOPPING":
                    if how == "hard" and not (self.store.get_job(ctl.name) or {}).get("stop_now"):
                        self.store.update_job(ctl.name, stop_now=1)
                        ctl.event("guard", f"terminating now: {reason}")
                    continue
                ctl.event("guard", reason)
                ctl.teardown.begin_stop("OVER_BUDGET", reason, hard=how == "hard")

    def request_actions(self) -> None:
        """Pass ``request_stop`` from the server's rows to the controllers' store (read each tick)."""
        started = [j for j, c in self.controllers.items() if c.started]
        with session_scope(self.engine) as s:
            asked = [(j.id, j.spec["name"], j.requested_action) for j in s.scalars(
                select(Job).where(Job.id.in_(started), Job.requested_action.is_not(None)))]
        for jid, name, action in asked:  # into the store first, then cleared: a crash between repeats it
            self.store.request_action(name, action)
            with session_scope(self.engine) as s:
                job = s.get(Job, jid)
                if job is not None and job.requested_action == action:
                    job.requested_action = None

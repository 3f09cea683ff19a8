"""Launching an attempt: the checks before it, the request, the thread, and what its result means.

:meth:`Launcher.start` launches the next attempt on the strategy's current offer — or says why the
job must end instead (:class:`EndJob`: no offer, ``recovery.max_attempts`` used up, a preemption
storm, the budget or deadline) — committing the attempt before it acts, then runs
``provider.launch`` in a :class:`~orchestrator.run.launchthread.LaunchInFlight`. Once the launch
returns, :meth:`Launcher.record` records its node (billed from the request on) or maps its error
(:func:`launch_failure`): no capacity → the next offer at once; ``Transient`` and unclassified
errors → the same offer after backoff (and an orphan sweep: a failed create may still bill);
``AuthError`` → that provider's offers dropped; ``NotSupported`` → the job FAILs.

The node environment is ``orchestrator.contract.nodeenv``'s (one definition for the controller,
``dtrun export`` and the node); :meth:`Launcher.request` adds what only a launch knows.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract import nodeenv, runuri
from orchestrator.contract.errors import ProviderRefused
from orchestrator.run.context import JobContext, describe_error
from orchestrator.run.guard import Guard, attempt_price_per_hour
from orchestrator.run.launchthread import LaunchInFlight, Launches
from orchestrator.run.nodecreds import ON_THIS_MACHINE, node_storage
from orchestrator.run.observe import Observer
from orchestrator.run.outcome import Outcome
from orchestrator.run.recovery import Recovery
from orchestrator.run.state import dtrun_home
from providers import errors as perr
from providers.base import LaunchRequest, Offer

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The project a node on this machine runs from (``ON_THIS_MACHINE``: this interpreter, this
checkout). Every other provider runs the bootstrap on a remote node, inside the project copy it
received as the launch's workdir (SkyPilot workdir sync, the Modal image), with its own python."""
LAUNCH_WAIT_CAP_SECONDS = 30.0
"""The tick that starts a launch waits for it up to one poll interval (at most this many real
seconds), so a quick launch is recorded in the same tick; a slower one keeps running in its
thread while the loop goes on ticking (the guard acts within one tick either way)."""


@dataclass(frozen=True)
class EndJob:
    """The job must end instead of launching. ``how``: ``give_up`` (a recovery limit: stop, FAILED),
    ``finish`` (end now in ``target``: the guard, a provider that refused), ``fail`` (FAILED at
    once: there is nothing to launch on)."""

    how: str
    target: str
    reason: str


@dataclass(frozen=True)
class LaunchFailure:
    """What a launch's error means: ``outcome`` (the attempt's), ``retry`` (``next_offer``: the
    next offer at once or after a full round; ``backoff``: the same offer after backoff; ``drop``:
    drop the provider's offers; ``fail``: end the job), ``sweep`` (it may have created an instance)."""

    outcome: Outcome
    retry: str
    reason: str
    sweep: bool = False


def launch_failure(e: BaseException) -> LaunchFailure:
    """Map a launch's exception to what the controller does next (pure)."""
    if isinstance(e, (perr.NoCapacity, perr.QuotaExceeded)):
        return LaunchFailure(Outcome.NO_CAPACITY, "next_offer", f"{type(e).__name__}: {e}")
    if isinstance(e, perr.Transient):
        return LaunchFailure(Outcome.LAUNCH_ERROR, "backoff", f"transient: {e}", sweep=True)
    if isinstance(e, perr.AuthError):
        return LaunchFailure(Outcome.REFUSED, "drop", str(e))
    if isinstance(e, perr.NotSupported):
        return LaunchFailure(Outcome.REFUSED, "fail", str(e))
    if isinstance(e, perr.ProviderError):  # an API error the provider did not classify: retry, bounded
        return LaunchFailure(Outcome.LAUNCH_ERROR, "backoff", f"{type(e).__name__}: {e}", sweep=True)
    # a provider bug: like an unclassified API error
    return LaunchFailure(Outcome.LAUNCH_ERROR, "backoff", describe_error(e), sweep=True)


class Launcher:
    def __init__(self, ctx: JobContext, launches: Launches, recovery: Recovery, guard: Guard,
                 observer: Observer, launch_wait: float) -> None:
        self.ctx = ctx
        self.launches = launches
        self.recovery = recovery
        self.guard = guard
        self.observer = observer
        self.launch_wait = launch_wait
        self.storage = node_storage
        """``(spec, provider) -> (env, secrets)`` of a launch's S3 access (``nodecreds.node_storage``:
        this process's environment); ``dtrun server`` puts the job's team's credentials here instead."""

    def start(self, now: float, plan: Any) -> EndJob | None:
        """Launch the next attempt (recorded before ``provider.launch`` is called); or why not."""
        ctx, store, spec = self.ctx, self.ctx.store, self.ctx.spec
        if plan is None or not plan.offers:
            return EndJob("fail", "FAILED", "no offer fits: " + ("; ".join(getattr(plan, "refusals", [])) or "none"))
        if self.recovery.strategy is None:
            self.recovery.make_strategy(list(plan.offers))
        strategy = self.recovery.strategy
        assert strategy is not None
        # Preemptions and planned restarts (the provider's lifetime cap, e.g. Modal's 24 h) do not
        # use up the job: max_attempts counts failed launches and crashes (recovery.py).
        why = self.recovery.launch_refusal(ctx.session_attempts(), now)
        if why:
            return EndJob("give_up", "FAILED", why)
        job = ctx.job()
        if job["deadline"] is None and spec.budget.max_hours:
            store.update_job(ctx.name, deadline=now + spec.budget.max_hours * 3600.0, started_at=now)
            job = ctx.job()
        elif job["started_at"] is None:
            store.update_job(ctx.name, started_at=now)
        self.recovery.begin(now)  # provisioning is bounded by max_recovery_minutes too
        offer = strategy.current
        try:
            node_env, node_secrets = self.storage(spec, offer.provider)
        except ProviderRefused as e:
            return self.provider_refused(offer.provider, str(e))
        price = attempt_price_per_hour(spec, offer)
        spent = store.spend_total(ctx.name)
        v = self.guard.may_launch(now=now, spent=spent, price_per_hour=price, deadline=job["deadline"])
        if v.stop:
            ctx.event("guard", v.reason)
            return EndJob("finish", v.target, v.reason)
        n = store.last_attempt_number(ctx.name) + 1
        log_path = str(dtrun_home() / "logs" / ctx.name / f"attempt-{n}.log")
        start_step = self.observer.latest_committed_step()
        # Commit first, act second.
        store.new_attempt(ctx.name, n, offer.to_dict(), offer.provider, now, start_step=start_step,
                          log_path=log_path)
        ctx.transition("PROVISIONING", f"attempt {n} on {offer.key()} (${price:.2f}/h)")
        for stale in (runuri.STOP, runuri.WATCHDOG):
            runuri.remove(runuri.join(ctx.run_uri, stale))
        req = self.request(n, offer, log_path, spent, job["deadline"], node_env, node_secrets)
        # The launch runs in a worker thread (provisioning takes minutes on a real cloud): the
        # loop keeps ticking meanwhile (guard, deadline, STOP, `dtrun down`).
        inf = LaunchInFlight(ctx.provider(offer.provider), req, price, now, clock=ctx.clock.now).start()
        self.launches.inflight = inf
        inf.done.wait(self.launch_wait)
        if inf.done.is_set():
            return self.record()
        return None

    def show_build(self, inf: LaunchInFlight) -> None:
        """A ``build`` event when the launch's image build reaches a new layer (the live view
        shows "building image: layer k of n, elapsed" from the newest one)."""
        p = inf.progress()
        if not p or p.get("phase") != "image":
            return
        at = (int(p.get("layer") or 0), int(p.get("layers") or 0))
        if at == inf.shown_layer:
            return
        inf.shown_layer = at
        self.ctx.event("build", f"attempt {inf.n}: building image: layer {at[0]} of {at[1]} ({p.get('label')})",
                       {"attempt": inf.n, "layer": at[0], "layers": at[1], "label": p.get("label"),
                        "since": p.get("since")})

    def record(self) -> EndJob | None:
        """Record the result of the launch that just returned (a node, or why it failed)."""
        ctx, store = self.ctx, self.ctx.store
        inf = self.launches.inflight
        strategy = self.recovery.strategy
        assert inf is not None and inf.done.is_set() and strategy is not None
        self.launches.inflight = None
        n, offer, price, t0 = inf.n, inf.offer, inf.price_per_hour, inf.t0
        if inf.error is not None and not isinstance(inf.error, Exception):
            raise inf.error  # KeyboardInterrupt, SystemExit, …: this process is being stopped
        if inf.error is not None or inf.handle is None:
            f = launch_failure(inf.error if inf.error is not None else RuntimeError("the launch returned nothing"))
            if f.sweep:
                self.launches.sweep_due = True
            if f.retry in ("drop", "fail"):
                store.update_attempt(ctx.name, n, state="ENDED", outcome=f.outcome.value, reason=f.reason,
                                     ended_at=ctx.now())
                if f.retry == "fail":
                    return EndJob("finish", "FAILED", f"{offer.provider} refused: {f.reason}")
                return self.provider_refused(offer.provider, f"{offer.provider} refused: {f.reason}")
            delay = strategy.no_capacity() if f.retry == "next_offer" else strategy.transient()
            self._failed(n, f.outcome, f.reason, delay)
            return None
        handle = inf.handle
        t = ctx.now()
        store.add_node(ctx.name, n, handle.to_dict(), t)
        store.open_spend(ctx.name, n, price, t0)  # billed from the launch request on
        store.update_attempt(ctx.name, n, state="PENDING", launched_at=t0)
        strategy.launched()
        self.observer.last_progress_at = t
        ctx.event("launch", f"attempt {n}: {handle.name} ({handle.instance_id}) on {offer.key()}",
                  {"attempt": n, "instance_id": handle.instance_id, "provider": offer.provider,
                   "data": {k: v for k, v in handle.data.items() if k in ("pid", "pgid", "log_path")}})
        return None

    def provider_refused(self, provider: str, reason: str) -> EndJob | None:
        """``provider`` cannot be used (credentials): drop its offers and launch the next one at
        once; the job FAILs only when no offer is left."""
        strategy = self.recovery.strategy
        assert strategy is not None
        if not strategy.drop_provider(provider):
            return EndJob("finish", "FAILED", reason)
        self.recovery.retry_in(self.ctx.now(), 0.0)
        nxt = strategy.current.key()
        self.ctx.event("refused", f"{reason}; skipping {provider}, next offer {nxt}", {"provider": provider})
        self.ctx.transition("RECOVERING", f"{reason}; next offer {nxt}")
        return None

    def _failed(self, n: int, outcome: Outcome, reason: str, delay: float) -> None:
        now = self.ctx.now()
        self.ctx.store.update_attempt(self.ctx.name, n, state="ENDED", outcome=outcome.value, reason=reason,
                                      ended_at=now)
        self.recovery.retry_in(now, delay)
        self.ctx.transition("RECOVERING", f"attempt {n}: {reason}" + (f"; retry in {delay:.0f} s" if delay else ""))

    def request(self, n: int, offer: Offer, log_path: str, spent: float, deadline: float | None,
                node_env: dict[str, str] | None = None,
                node_secrets: dict[str, str] | None = None) -> LaunchRequest:
        """Attempt ``n``'s launch request on ``offer``: the node environment (nodeenv), the S3
        access a remote node needs (``node_env``; the AWS keys in ``node_secrets``, never logged,
        never stored — nothing for a file:// run URI: nodes on this machine inherit the process
        environment), the bootstrap command, the image."""
        s = self.ctx.spec
        rec = nodeenv.for_launch(
            run_uri=self.ctx.run_uri, job=self.ctx.name, attempt=n, gpus_per_node=s.resources.gpus_per_node,
            nodes=s.resources.nodes, idle_minutes=s.teardown.idle_minutes,
            price_per_hour=offer.price_per_gpu_hour * offer.gpus_per_node, max_usd=s.budget.max_usd,
            spent_usd=spent, deadline=deadline, controller_lost_minutes=s.teardown.controller_lost_minutes,
            launched_at=self.ctx.now(),
            # wheels kept on a volume across nodes (infra/node_setup.py)
            pip_cache_dir=os.environ.get(nodeenv.PIP_CACHE_DIR))
        env = nodeenv.to_env(rec)
        env.update(node_env or {})
        if offer.provider in ON_THIS_MACHINE:
            command = nodeenv.bootstrap_command(sys.executable, str(REPO_ROOT))
        else:
            command = nodeenv.bootstrap_command()
        from orchestrator.plan.estimate import node_image

        return LaunchRequest(job=self.ctx.name, attempt=n, offer=offer, nodes=s.resources.nodes,
                             command=command, env=env, deadline=deadline,
                             workdir=str(REPO_ROOT), log_path=log_path, secrets=dict(node_secrets or {}),
                             cpu_per_gpu=s.resources.cpu_per_gpu, memory_gb_per_gpu=s.resources.memory_gb_per_gpu,
                             image=node_image(s, offer.provider), owner=self.ctx.store.owner_id)

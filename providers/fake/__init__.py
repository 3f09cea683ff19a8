"""The fake cloud: an in-memory provider on a clock the caller advances.

It powers the controller's tests and ``dtrun simulate``: offers with prices, a provisioning
delay, capacity and API faults, preemptions (scripted or a seeded rate), terminates that need
confirming, and a **bill** — every instance's seconds × price, from the start of provisioning
until the cloud confirms it gone — that tests read to prove nothing leaked or was overcharged.

Time
    Everything happens on ``clock()`` (default ``time.time``). Nothing runs in the background:
    each call first advances every instance to ``clock()`` (provisioning → running, scheduled
    preemptions and exits, self-removal), so a test moves a virtual clock by hours and the next
    call sees what happened, with exact timestamps on the bill.

What a fake node "does"
    Fake nodes run no trainer. Their life is scripted:

    * ``script(name, exit_after=…, exit_code=…, preempt_after=…)`` before launch, keyed by the
      instance name (``dtrun-<job>-a<attempt>``, known in advance); times are seconds after the
      node starts running.
    * ``set_exit(id_or_name, at=…, code=…)`` / ``preempt(id_or_name, at=…)`` for a live instance.
    * ``preemptions_per_hour`` (seeded): every spot instance draws its preemption time at launch.
    * a ``workload(instance, now)`` callback (in-process only): called for each running instance
      whenever the cloud advances; it may write progress/checkpoints into the run URI (the node's
      env, e.g. ``DTRUN_RUN_URI``, is in ``instance.env``) and returns ``None`` (still running),
      an exit code (exit now) or ``(code, at)`` (exited at time ``at``).

    The controller learns progress exactly as with a real node: ``poll`` gives the node state and
    the run URI gives progress.json / COMMITTED checkpoints / DONE — which, on the fake cloud, the
    test or simulator writes itself (for example from ``workload``).

Exit codes map like the local provider: 0 → SUCCEEDED, 75/76 → PREEMPTED (the trainer stopped
asking to be resumed / the watchdog stopped it), anything else → FAILED. A preemption →
PREEMPTED. A terminate before any of these → TERMINATED. A node whose job exited removes itself
``autodown_seconds`` later (None: it stays up, and bills, until terminated).

Faults
    ``inject(op, error, count=1, match="*", create=False)`` makes the next ``count`` calls of
    ``op`` (launch, poll, terminate, list_owned, offers) whose instance name, id, region or offer
    key matches ``match`` raise ``error`` (NoCapacity, QuotaExceeded, AuthError, Transient,
    NotSupported, TerminateNotConfirmed); ``count=None`` means until ``clear_faults()``. With
    ``create=True`` a failing launch still creates (and bills) the instance — the "create call
    timed out but the pod exists" case that only a prefix sweep catches. ``transient_rate`` is a
    seeded probability that any launch/poll/terminate call raises Transient. ``terminate_seconds``
    is how long the cloud takes to confirm a terminate (TerminateNotConfirmed until then).

Sharing between processes
    ``FakeProvider(path=...)`` keeps the whole cloud (config, instances, scripts, faults) in a JSON
    file, locked with ``fcntl.flock`` around every call, so separate CLI processes see one cloud.
    ``providers.registry.get("fake")`` uses ``$DTRUN_FAKE_CLOUD`` or ``$DTRUN_HOME/fake-cloud.json``.
    Without a path the cloud lives in memory. The ``workload`` callback is never persisted.

Modules: ``offers`` (what it sells), ``store`` (the state, in memory or a shared file),
``instances`` (the lifecycle on the virtual clock), ``faults`` (injected and random API
errors), ``bill``, and ``provider`` (:class:`FakeProvider`, the facade). They import
``providers.base``/``errors`` and ``orchestrator.contract`` only.
"""

from __future__ import annotations

from providers.fake.instances import FakeInstance, Workload
from providers.fake.offers import DEFAULT_OFFERS, FakeOfferTemplate
from providers.fake.provider import Clock, FakeProvider, shared_cloud
from providers.fake.store import default_path

__all__ = ["FakeProvider", "FakeOfferTemplate", "FakeInstance", "Workload", "Clock", "DEFAULT_OFFERS",
           "shared_cloud", "default_path"]

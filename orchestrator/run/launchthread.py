"""The launch thread: one ``provider.launch`` running off the controller's loop, and the launches
a job has going (the one in flight, the cancelled ones the loop stopped waiting for).

Provisioning takes minutes on a real cloud; the loop keeps ticking meanwhile (the budget guard
bills the attempt from its launch request on, the deadline, ``recovery.max_recovery_minutes``,
STOP and ``dtrun down`` all act). How a launch is started and what its result means is
``orchestrator.run.launching``; ending what a cancelled launch created is
``orchestrator.run.teardown``. Nothing here is provider-specific.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable

from orchestrator.run.context import describe_error
from providers import errors as perr
from providers.base import Handle, LaunchRequest, OwnedInstance, Provider

ABANDON_TERMINATE_TRIES = 10
"""Tries of the late terminate of what an abandoned launch returned (backoff 0.1 s doubling, capped
at ``ABANDON_RETRY_CAP_S``: about 26 s in all), after which the orphan sweep takes over."""
ABANDON_RETRY_CAP_S = 5.0


class LaunchInFlight:
    """One ``provider.launch(request)`` running in a worker thread, off the controller's loop.

    While it runs, the controller keeps ticking: the budget guard (with the attempt's price
    billed from the launch request on), the deadline, ``recovery.max_recovery_minutes``, STOP
    and ``dtrun down`` all act. Cancelling it does not interrupt the SDK call (no SDK offers
    that for every provider); instead the controller finds what the launch has created so far
    by its deterministic name (``request.instance_name``, via ``provider.list_owned``) and
    terminates it through the ordinary node path. A launch the controller stops waiting for
    (:meth:`abandon`) is ended off the loop thread: whatever it returns later is terminated
    (retried, confirmed) by its worker, or by a cleanup thread when it had already returned;
    ``settled`` is set once nothing of it is left to end, ``ended_at`` is when (what the job is
    booked to). Nothing here is provider-specific.
    """

    def __init__(self, provider: Provider, request: LaunchRequest, price_per_hour: float, t0: float,
                 clock: Callable[[], float] | None = None) -> None:
        self.provider = provider
        self.request = dataclasses.replace(request, on_progress=self._report)
        self.n = request.attempt
        self.offer = request.offer
        self.price_per_hour = price_per_hour
        self.t0 = t0
        self._clock = clock
        self.handle: Handle | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.cancelled_at: float | None = None
        self.adopted: set[str] = set()
        """Instance ids the controller found (list_owned) and recorded as this attempt's nodes."""
        self.abandoned = False
        self.abandoned_at: float | None = None
        self.cleanup_error: str | None = None
        self.settled = threading.Event()
        """Set once an abandoned launch has nothing left to end: it raised (created nothing it
        returned), or what it returned was terminated (``terminated`` True) or the late terminate
        gave up (``cleanup_error``; the orphan sweep takes over)."""
        self.terminating = False
        self.terminated = False
        self.ended_at: float | None = None
        self.booked = False
        self.booked_until: float | None = None
        self._progress: dict[str, Any] | None = None
        self.shown_layer: tuple[int, int] | None = None
        """The image layer last shown as a ``build`` event (the controller's loop only)."""
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"dtrun-launch-{request.instance_name}",
                                       daemon=True)
        self.cleanup_thread: threading.Thread | None = None

    def start(self) -> "LaunchInFlight":
        self.thread.start()
        return self

    def _report(self, where: dict[str, Any]) -> None:
        with self._lock:
            self._progress = dict(where)

    def progress(self) -> dict[str, Any] | None:
        """Where the launch says it is (``LaunchRequest.on_progress``), newest first; None if silent."""
        with self._lock:
            return dict(self._progress) if self._progress is not None else None

    def _now(self) -> float:
        import time as _time

        return self._clock() if self._clock is not None else _time.time()

    def _run(self) -> None:
        try:
            handle = self.provider.launch(self.request)
        except BaseException as e:  # noqa: BLE001 - handed to the controller's thread
            with self._lock:
                self.error = e
                self.ended_at = self._now()
                self.done.set()
                self.settled.set()
            return
        with self._lock:
            self.handle = handle
            self.done.set()
            late = self.abandoned
            self.terminating = late
        if late:
            self._terminate_late(handle)

    def abandon(self, now: float | None = None) -> None:
        """The controller stops waiting: whatever the launch still returns is ended off the loop
        thread (never on it: the late terminate retries for up to ~26 s)."""
        with self._lock:
            self.abandoned = True
            self.abandoned_at = self._now() if now is None else now
            if not self.done.is_set():
                return  # the worker terminates what the launch returns
            handle = self.handle
            late = handle is not None and handle.instance_id not in self.adopted
            self.terminating = late
            if handle is not None and not late:
                self.ended_at = self.abandoned_at  # adopted: the controller's node path ends it
                self.settled.set()
        if late:
            assert handle is not None
            self.cleanup_thread = threading.Thread(target=self._terminate_late, args=(handle,), daemon=True,
                                                   name=f"dtrun-cleanup-{self.request.instance_name}")
            self.cleanup_thread.start()

    def _terminate_late(self, handle: Handle) -> None:
        import time as _time

        try:
            for i in range(ABANDON_TERMINATE_TRIES):
                try:
                    self.provider.terminate(handle)
                    self.terminated = True
                    self.cleanup_error = None
                    return
                except perr.ProviderError as e:  # TerminateNotConfirmed, Transient, …: retried
                    self.cleanup_error = f"{type(e).__name__}: {e}"
                    _time.sleep(min(ABANDON_RETRY_CAP_S, 0.1 * 2 ** i))
                except Exception as e:  # noqa: BLE001 - a provider bug: not retried, the sweep takes over
                    self.cleanup_error = describe_error(e)
                    return
        finally:
            with self._lock:
                self.ended_at = self._now()
                self.terminating = False
                self.settled.set()

    def pending(self) -> bool:
        """An abandoned launch whose worker (or cleanup thread) is still at work."""
        return self.abandoned and not self.settled.is_set()

    def matches(self, inst: OwnedInstance) -> bool:
        """``inst`` was created by this launch (its name, or its name plus a per-node suffix)."""
        name = self.request.instance_name
        return inst.name == name or inst.name.startswith(name + "-")


class Launches:
    """The job's launches: at most one in flight, and the cancelled ones the loop abandoned (their
    workers may still be inside a provider's SDK). ``sweep_due``: a launch raised or was abandoned
    and may have created (and be billing for) an instance: the orphan sweep runs again before the
    next launch and before the job ends."""

    def __init__(self) -> None:
        self.inflight: LaunchInFlight | None = None
        self.abandoned: list[LaunchInFlight] = []
        self.sweep_due = False

    def unbooked(self) -> list[LaunchInFlight]:
        """The launch in flight and abandoned ones not booked yet, none of whose instances was
        recorded as a node (those bill through their spend row)."""
        return [i for i in [self.inflight, *self.abandoned] if i is not None and not i.adopted and not i.booked]

    def late_terminates_pending(self) -> bool:
        """An abandoned launch returned an instance whose terminate (off the loop) is still being
        retried: the job is not recorded finished before it is confirmed or given up on."""
        return any(i.terminating for i in self.abandoned)

    def in_sdk(self) -> bool:
        """A call is still inside a provider's SDK (a launch in flight, or an abandoned one not
        settled): its provider must stay open (e.g. SkyPilot's API server)."""
        return any(i is not None and (not i.done.is_set() or i.pending()) for i in [self.inflight, *self.abandoned])

"""The controller loop inside ``dtrun server``: one :class:`~orchestrator.server.replica.Replica`
ticked every few seconds in a thread beside the HTTP API, so a job submitted through the API is
launched, watched and recovered by the server with no CLI process alive. A second ``dtrun server``
on the same database — on this machine or another — is a second replica: it claims only free or
expired leases, and finds every job's attempts, nodes and spend in the database
(``orchestrator.server.ctlstore``), nothing in its own ``$DTRUN_HOME``.

On shutdown the loop stops between ticks; the jobs' leases then expire and another replica (or this
one, restarted) adopts them and re-attaches to their live nodes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("dtrun.server.runner")

TICK_SECONDS = 5.0
"""How often the replica ticks: the controllers' own poll intervals are ≥ this."""


class ReplicaThread:
    def __init__(self, engine: Any, tick_seconds: float = TICK_SECONDS, store: Any = None, **replica_kw: Any) -> None:
        from orchestrator.server.ctlstore import CtlStore
        from orchestrator.server.replica import Replica

        store = store if store is not None else CtlStore(engine)  # the controllers' rows: in the server database
        self.replica = Replica(engine, store, providers={}, tick_seconds=tick_seconds, **replica_kw)
        self.tick_seconds = tick_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dtrun-{self.replica.id}", daemon=True)

    def start(self) -> "ReplicaThread":
        log.info("controller replica %s: ticking every %.0f s", self.replica.id, self.tick_seconds)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.replica.tick()
            except Exception as e:  # a database hiccup: log it (type and text, no spec, no secret) and go on
                log.warning("replica tick failed: %s: %s", type(e).__name__, str(e).splitlines()[0][:200])
            self._stop.wait(self.tick_seconds)

"""What one node tells the run URI about itself: its record and its output.

The node bootstrap (``infra/node_bootstrap.py``) runs one :class:`NodeReport` per node. It writes
``nodes/a<attempt>/node-<rank>.json`` — rank, node count, private IP, host name, state
(STARTING → RUNNING → EXITED with the exit code) and times — and ``node-<rank>.log``, the last
``runuri.NODE_LOG_BYTES`` of everything the node printed (the bootstrap's own lines, torchrun's
and every local rank's), rewritten every ``DTRUN_NODE_REPORT_SECONDS`` (default 15) while it
changes and once more at exit. The controller copies the records into the job's state (``dtrun
status``: each node's IP, rank and state); ``dtrun logs JOB --node N`` reads the log. Both work
the same on every provider, because the run URI is the only channel the two sides share.

Standard library only (plus ``orchestrator.contract.runuri``): never torch.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import IO, Any, Callable

from orchestrator.contract import nodeenv, runuri


class NodeReport:
    def __init__(self, run_uri: str, attempt: int, rank: int, nnodes: int, *, ip: str | None,
                 master: str | None = None, every: float = 15.0,
                 log: Callable[[str], None] | None = None) -> None:
        self.run_uri, self.attempt, self.rank = run_uri, attempt, rank
        self.every = every
        self._log = log or (lambda _m: None)
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._dirty = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False
        now = time.time()
        self.record: dict[str, Any] = {
            "attempt": attempt, "rank": rank, "nnodes": nnodes, "ip": ip, "host": socket.gethostname(),
            "master": master, "state": "STARTING", "exit_code": None, "started": now, "updated": now,
        }

    # ---- output --------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        with self._lock:
            self._buf += data
            over = len(self._buf) - runuri.NODE_LOG_BYTES
            if over > 0:
                del self._buf[:over]
            self._dirty = True

    def pump(self, src: IO[bytes], dst: IO[bytes]) -> threading.Thread:
        """Copy a child's pipe to ``dst`` (the node's own stdout/stderr) and into the log."""
        def run() -> None:
            for chunk in iter(lambda: src.read1(65536), b""):
                try:
                    dst.write(chunk)
                    dst.flush()
                except (OSError, ValueError):
                    pass
                self.feed(chunk)
        t = threading.Thread(target=run, name="dtrun-node-pump", daemon=True)
        t.start()
        return t

    # ---- record --------------------------------------------------------------------------------
    def set(self, state: str, exit_code: int | None = None) -> None:
        with self._lock:
            self.record.update(state=state, exit_code=exit_code)
            self._dirty = True
        self.flush()

    def flush(self) -> None:
        """Write the record and the log if anything changed (errors are logged once, not raised:
        the report is a view, never a reason for the node to stop)."""
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
            self.record["updated"] = time.time()
            rec = dict(self.record)
            text = self._buf.decode(errors="replace")
        try:
            runuri.write_json(runuri.node_uri(self.run_uri, self.attempt, self.rank), rec)
            runuri.write_text(runuri.node_uri(self.run_uri, self.attempt, self.rank, "log"), text)
        except Exception as e:  # noqa: BLE001 - object store hiccup: next round
            with self._lock:
                self._dirty = True
            if not self._warned:
                self._warned = True
                self._log(f"node report: cannot write to the run URI ({type(e).__name__}: {e}); retrying")

    def start(self) -> None:
        def run() -> None:
            while not self._stop.wait(self.every):
                self.flush()
        self._thread = threading.Thread(target=run, name="dtrun-node-report", daemon=True)
        self._thread.start()

    def close(self, exit_code: int) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.set("EXITED", exit_code)


def report_seconds(env: dict[str, str] | None = None) -> float:
    """``DTRUN_NODE_REPORT_SECONDS`` (default 15; anything but a positive number counts as unset)."""
    raw = (os.environ if env is None else env).get(nodeenv.NODE_REPORT_SECONDS, "").strip()
    try:
        v = float(raw) if raw else 15.0
    except ValueError:
        v = 15.0
    return v if v > 0 else 15.0

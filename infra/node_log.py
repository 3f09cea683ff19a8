"""The node's own log lines: ``[dtrun-node HH:MM:SS] …`` on stderr, and into the node's log in the
run URI once the bootstrap has started its :class:`infra.node_report.NodeReport`.

Every part of the node (the bootstrap, its watchdog and process tree, a ``command:`` job's
checkpoint sync) logs through :func:`log`, so ``dtrun logs JOB --node N`` shows all of it.
Standard library only.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol


class _Sink(Protocol):
    def feed(self, data: bytes) -> None: ...


_SINKS: list[_Sink] = []


def log(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    line = f"[dtrun-node {stamp}] {msg}"
    print(line, file=sys.stderr, flush=True)
    for sink in _SINKS:
        sink.feed((line + "\n").encode())


def also_to(sink: _Sink) -> None:
    """Copy every later line into ``sink`` too (the node's report)."""
    _SINKS.append(sink)

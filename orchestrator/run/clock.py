"""Clocks for the controller: the real one, and a virtual one that tests and ``dtrun simulate``
move by hand so hours of job time pass in milliseconds.

A clock has two methods: ``now() -> float`` (unix seconds) and ``sleep(seconds)``.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RealClock:
    """Wall time (``time.time``) and a real ``time.sleep``."""

    def now(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def __call__(self) -> float:  # usable where a provider wants a ``clock`` callable
        return self.now()


class VirtualClock:
    """Time that moves only when someone sleeps (or calls ``advance``).

    ``on_advance`` hooks run after every move with the new time: a test uses them to play the
    world forward (a simulated trainer writing progress, a fake cloud preempting a node).
    """

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._t = float(start)
        self.on_advance: list[Callable[[float], None]] = []

    def now(self) -> float:
        return self._t

    def __call__(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a virtual clock does not go backwards")
        self._t += seconds
        for hook in list(self.on_advance):
            hook(self._t)

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

"""Polling for the e2e suites: wait until a condition holds, or fail saying what never happened."""

from __future__ import annotations

import time


def wait_until(pred, timeout: float, what: str, every: float = 1.0):
    """``pred()``'s first truthy value, polled every ``every`` seconds for ``timeout`` seconds;
    an AssertionError naming ``what`` after that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"after {timeout:.0f} s: {what}")

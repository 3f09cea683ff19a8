"""Where the fake cloud's state lives: in memory, or in one JSON file that CLI processes share.

The state is one plain dict (config, instances, scripts, faults, counters). :class:`CloudStore`
hands it out under a lock: a thread lock in memory, plus ``fcntl.flock`` on ``<file>.lock``
around every call when the cloud is a file (``providers.registry.get("fake")``:
``$DTRUN_FAKE_CLOUD``, else ``$DTRUN_HOME/fake-cloud.json``), written back atomically if changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
from pathlib import Path
from typing import Any, Iterator

from providers import errors as perr
from providers.fake.offers import DEFAULT_OFFERS


def default_config() -> dict[str, Any]:
    return {
        "offers": [o.to_dict() for o in DEFAULT_OFFERS],
        "provision_seconds": 90.0,
        "autodown_seconds": 0.0,
        "terminate_seconds": 0.0,
        "preemptions_per_hour": 0.0,
        "transient_rate": 0.0,
        "seed": 0,
        "max_gpus_per_node": 8,
        # True once a driver (a test, a simulation) configured this cloud: only then does
        # FakeProvider.check_credentials let `dtrun up` rent on it.
        "driven": False,
    }


def empty_state() -> dict[str, Any]:
    return {"version": 1, "config": default_config(), "seq": 0, "calls": 0,
            "instances": {}, "scripts": {}, "faults": []}


def default_path() -> Path:
    """``$DTRUN_FAKE_CLOUD``, else ``$DTRUN_HOME/fake-cloud.json`` (DTRUN_HOME default ~/.dtrun)."""
    env = os.environ.get("DTRUN_FAKE_CLOUD")
    if env:
        return Path(env).expanduser()
    home = Path(os.environ.get("DTRUN_HOME") or "~/.dtrun").expanduser()
    return home / "fake-cloud.json"


def seeded(st: dict[str, Any], *parts: Any) -> random.Random:
    """A random generator fixed by the cloud's seed and ``parts`` (same draws on every run)."""
    return random.Random(":".join(str(p) for p in (st["config"]["seed"], *parts)))


class CloudStore:
    """The fake cloud's state dict, in memory (``path`` None) or in a locked JSON file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._mem = empty_state()
        self._tlock = threading.RLock()

    @contextlib.contextmanager
    def state(self, write: bool = True) -> Iterator[dict[str, Any]]:
        with self._tlock:
            if self.path is None:
                yield self._mem
                return
            import fcntl

            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock_path = self.path.with_name(self.path.name + ".lock")
            with open(lock_path, "a+") as lf:
                fcntl.flock(lf.fileno(), fcntl.LOCK_EX)
                try:
                    fresh = False
                    try:
                        st = json.loads(self.path.read_text())
                    except FileNotFoundError:
                        st, fresh = empty_state(), True
                    except json.JSONDecodeError as e:
                        raise perr.ProviderError(f"fake cloud file {self.path} is corrupt: {e}",
                                                 provider="fake") from None
                    before = "" if fresh else json.dumps(st, sort_keys=True)
                    try:
                        yield st
                    except perr.ProviderError:
                        # An API error is a result too: keep what led to it (fault counts, an
                        # instance created by a launch that then "timed out").
                        self._write(st, before, write)
                        raise
                    self._write(st, before, write)
                finally:
                    fcntl.flock(lf.fileno(), fcntl.LOCK_UN)

    def _write(self, st: dict[str, Any], before: str, write: bool) -> None:
        assert self.path is not None
        after = json.dumps(st, sort_keys=True)
        if write and after != before:
            tmp = self.path.with_name(f"{self.path.name}.tmp.{os.getpid()}")
            tmp.write_text(after)
            os.chmod(tmp, 0o600)
            os.replace(tmp, self.path)

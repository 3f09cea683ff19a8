"""Restart overhead, phase by phase, from a lab's preemption test: preemption → the first step of
the next attempt, cut at marks that real parts record on their own clock (all on this host):

* ``detected``      — the controller books attempt 1 as preempted/lost (its event in the state store)
* ``requested``     — attempt 2's row is created: the replacement is requested (teardown of attempt
                      1 and the backoff happen in between)
* ``instance``      — the lab's record of attempt 2's instance starting (its bill ``start``), when
                      the test hands it in
* ``ssh``           — SkyPilot's provision log: ``SSH Connection ready`` for attempt 2's cluster
* ``runtime``       — SkyPilot's provision log: ``Cluster launched`` (its runtime and skylet set up)
* ``launched``      — dtrun's ``launch`` event of attempt 2: SkyPilot's launch returned (the task's
                      setup run and the job submitted)
* ``trainer``       — the run URI's progress.json says attempt 2 (the node bootstrap has started the
                      trainer under torchrun; rank 0 wrote its first heartbeat)
* ``load_start``/``load_end`` — progress.json's phase ``loading_checkpoint``/``first_step``
* ``first_step``    — progress.json's phase ``training``, or a step of attempt 2 past its start

progress.json is polled every ``interval`` seconds by :class:`ProgressWatch` (a mark is the first
poll that saw it: up to one interval late; a phase shorter than that may fold into the next).
:func:`phases` returns each phase as the time since the previous mark that exists, and the total.
A line ``RESTART PHASES <lab> {json}`` is printed and, where ``DTRUN_RESTART_PHASES`` names a file,
appended to it (that is how docs/labs.md's table was filled)."""

from __future__ import annotations

import glob
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

ORDER = ["detected", "requested", "instance", "ssh", "runtime", "launched", "trainer", "load_start",
         "load_end", "first_step"]
REQUIRED = [k for k in ORDER if k not in ("load_start", "load_end")]  # the trainer's short phases may fold
NAMES = {"detected": "detection", "requested": "teardown + relaunch decision", "instance": "request → instance",
         "ssh": "instance → SSH", "runtime": "SkyPilot runtime setup", "launched": "task setup + job submit",
         "trainer": "node bootstrap → trainer up", "load_start": "process group + model build",
         "load_end": "checkpoint load", "first_step": "first step"}


class ProgressWatch:
    """Polls ``get(f"{name}/progress.json")`` in a thread; ``seen[(attempt, phase)]`` is the first wall
    time each was seen, ``stepped[attempt]`` the first time a step past the attempt's first one was."""

    def __init__(self, get: Callable[[str], bytes], name: str, interval: float = 0.5) -> None:
        self.get, self.name, self.interval = get, name, interval
        self.seen: dict[tuple[int, str], float] = {}
        self.stepped: dict[int, float] = {}
        self._first_step: dict[int, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ProgressWatch":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                p = json.loads(self.get(f"{self.name}/progress.json"))
            except Exception:  # noqa: BLE001 - not there yet, or a write in flight
                p = {}
            now = time.time()
            a = int(p.get("attempt") or 0)
            if a:
                self.seen.setdefault((a, str(p.get("phase") or "")), now)
                self.seen.setdefault((a, ""), now)
                st = p.get("step")
                if st is not None:
                    self._first_step.setdefault(a, int(st))
                    if int(st) > self._first_step[a]:
                        self.stepped.setdefault(a, now)
            self._stop.wait(self.interval)


def sky_marks(home: str | Path, cluster: str) -> dict[str, float]:
    """``ssh`` and ``runtime`` from the provision log of SkyPilot's launch of ``cluster`` (its lines
    carry ``%m-%d %H:%M:%S.%f`` in local time; the year is this one)."""
    out: dict[str, float] = {}
    year = time.localtime().tm_year
    pat = re.compile(r"^[A-Z] (\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{3}) PID=\d+ \S+\] (.*)$")
    for path in sorted(glob.glob(os.path.join(str(home), "sky_logs", "**", "provision.log"), recursive=True)):
        text = Path(path).read_text(errors="replace")
        if cluster not in text:
            continue
        for line in text.splitlines():
            m = pat.match(line)
            if not m or cluster not in m.group(3):
                continue
            t = time.mktime(time.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
            if "SSH Connection ready" in m.group(3):
                out.setdefault("ssh", t)
            elif "Cluster launched" in m.group(3):
                out.setdefault("runtime", t)
        dest = os.environ.get("DTRUN_RESTART_PHASES")
        if dest:  # kept beside the phases for reading (the lab's HOME is removed when it stops)
            Path(f"{dest}.{cluster}.provision.log").write_text(text)
    return out


def phases(dtrun_home: str | Path, name: str, t_pre: float, watch: ProgressWatch, sky_home: str | Path | None,
           instance_start: float | None = None, attempt: int = 2) -> dict:
    """The marks of ``attempt`` (see the module docstring), the phases between them and the total."""
    from orchestrator.run.state import StateStore

    store = StateStore(Path(dtrun_home) / "state.db")
    ev = store.events(name)
    marks: dict[str, float] = {}
    det = [e["time"] for e in ev if e["type"] in ("preempted", "lost") and e["time"] >= t_pre]
    if det:
        marks["detected"] = det[0]
    att = store.get_attempt(name, attempt)
    if att:
        marks["requested"] = att["created"]
    if instance_start is not None:
        marks["instance"] = instance_start
    if sky_home is not None:
        marks.update(sky_marks(sky_home, f"dtrun-{name}-a{attempt}"))
    launched = [e["time"] for e in ev if e["type"] == "launch" and (e["data"] or {}).get("attempt") == attempt]
    if launched:
        marks["launched"] = launched[0]
    for key, phase in (("trainer", ""), ("load_start", "loading_checkpoint"), ("load_end", "first_step"),
                       ("first_step", "training")):
        if (attempt, phase) in watch.seen:
            marks[key] = watch.seen[(attempt, phase)]
    if attempt in watch.stepped:
        marks["first_step"] = min(marks.get("first_step", watch.stepped[attempt]), watch.stepped[attempt])
    out: dict = {"marks": {k: round(marks[k] - t_pre, 2) for k in ORDER if k in marks}, "phases": {}}
    prev = t_pre
    for k in ORDER:
        if k in marks:
            out["phases"][NAMES[k]] = round(marks[k] - prev, 2)
            prev = max(prev, marks[k])
    out["total_s"] = round(prev - t_pre, 2)
    out["poll_interval_s"] = watch.interval
    return out


def report(lab: str, result: dict) -> None:
    line = json.dumps({"lab": lab, **result})
    print(f"RESTART PHASES {lab} {line}")
    dest = os.environ.get("DTRUN_RESTART_PHASES")
    if dest:
        with open(dest, "a") as f:
            f.write(line + "\n")

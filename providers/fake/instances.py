"""Fake instances on the virtual clock: created by a launch, advanced to "now" on every call.

An instance record (a dict in the cloud's state) goes provisioning → running → exited /
preempted / terminated, then gone. Nothing runs in the background: :func:`advance_all` applies
everything due up to ``now`` (the end of provisioning, a scripted or drawn preemption, a planned
exit, the hard deadline, self-removal ``autodown_seconds`` after the job ended, a terminate the
cloud confirms), each at its own timestamp, so a caller that moves a clock by hours sees exact
times on the bill. A ``workload(instance, now)`` callback may end a running instance's job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from providers import errors as perr
from providers.base import PREEMPT_EXIT_CODES, LaunchRequest, NodeState
from providers.fake.store import seeded

SECRET_RE = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)", re.I)
"""Env keys that look secret: never stored (the cloud's JSON file must hold no secret)."""


@dataclass
class FakeInstance:
    """A snapshot of one fake instance, as the ``workload`` callback and tests see it."""

    id: str
    name: str
    offer: dict[str, Any]
    nodes: int
    spot: bool
    price_per_hour: float
    env: dict[str, str]
    created_at: float
    ready_at: float
    phase: str
    """provisioning | running | exited | preempted | terminated"""
    exit_code: int | None = None
    ended_at: float | None = None
    gone_at: float | None = None
    region: str = ""
    events: list[tuple[float, str]] = field(default_factory=list)

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "FakeInstance":
        return cls(id=r["id"], name=r["name"], offer=dict(r["offer"]), nodes=r["nodes"], spot=r["spot"],
                   price_per_hour=r["price_per_hour"], env=dict(r["env"]), created_at=r["created_at"],
                   ready_at=r["ready_at"], phase=r["phase"], exit_code=r.get("exit_code"),
                   ended_at=r.get("ended_at"), gone_at=r.get("gone_at"), region=r["region"],
                   events=[tuple(e) for e in r.get("events", [])])


Workload = Callable[[FakeInstance, float], "int | tuple[int, float] | None"]


def ordered(st: dict[str, Any]) -> list[dict[str, Any]]:
    """Every instance record, oldest first."""
    return sorted(st["instances"].values(), key=lambda r: r["seq"])


def find(st: dict[str, Any], id_or_name: str) -> dict[str, Any]:
    """The record with this id, else the newest with this name (KeyError if none)."""
    r = st["instances"].get(id_or_name)
    if r is not None:
        return r
    named = [x for x in ordered(st) if x["name"] == id_or_name]
    if not named:
        raise KeyError(f"fake cloud has no instance {id_or_name!r}")
    return named[-1]


def create(st: dict[str, Any], request: LaunchRequest, now: float) -> dict[str, Any]:
    """A new instance for ``request``, provisioning from ``now``, with its script (if any) and
    its drawn preemption time (spot, ``preemptions_per_hour``) applied."""
    cfg = st["config"]
    st["seq"] += 1
    iid = f"fake-{st['seq']:05d}"
    offer = request.offer
    price = offer.price_per_gpu_hour * offer.gpus_per_node * request.nodes
    ready_at = now + float(cfg["provision_seconds"])
    r: dict[str, Any] = {
        "id": iid, "seq": st["seq"], "name": request.instance_name, "job": request.job, "owner": request.owner,
        "attempt": request.attempt, "offer": offer.to_dict(), "offer_key": offer.key(),
        "region": offer.region, "spot": offer.spot, "nodes": request.nodes, "price_per_hour": price,
        "env": {k: v for k, v in request.env.items() if not SECRET_RE.search(k)},
        "command": list(request.command), "deadline": request.deadline,
        "created_at": now, "ready_at": ready_at, "phase": "provisioning",
        "exit_at": None, "exit_code_planned": None, "exit_code": None, "preempt_at": None,
        "ended_at": None, "gone_at": None, "terminate_requested_at": None, "terminate_confirm_at": None,
        "events": [[now, f"created {offer.key()} x{request.nodes} at ${price:.4f}/h"]],
    }
    scripts = st["scripts"].get(r["name"])
    if scripts:
        s = scripts.pop(0)
        if not scripts:
            del st["scripts"][r["name"]]
        if s.get("exit_after") is not None:
            r["exit_at"] = ready_at + float(s["exit_after"])
            r["exit_code_planned"] = int(s.get("exit_code", 0))
        if s.get("preempt_after") is not None:
            r["preempt_at"] = ready_at + float(s["preempt_after"])
    rate = float(cfg["preemptions_per_hour"])
    if offer.spot and rate > 0 and r["preempt_at"] is None:
        r["preempt_at"] = ready_at + seeded(st, "preempt", iid).expovariate(rate / 3600.0)
    if request.deadline is not None:
        # The provider-side hard deadline: the node is removed then, whatever happens.
        r["deadline"] = float(request.deadline)
    st["instances"][iid] = r
    return r


def terminate(st: dict[str, Any], r: dict[str, Any], now: float) -> None:
    """Ask the cloud to remove ``r``: gone once ``terminate_seconds`` have passed since the first
    request; until then every call raises TerminateNotConfirmed."""
    if r["gone_at"] is not None:
        return  # already gone: not an error
    if r["terminate_requested_at"] is None:
        r["terminate_requested_at"] = now
        r["events"].append([now, "terminate requested"])
        if r["phase"] in ("provisioning", "running"):
            r["phase"] = "terminated"
            r["ended_at"] = now
        r["terminate_confirm_at"] = now + float(st["config"]["terminate_seconds"])
    if now < r["terminate_confirm_at"]:
        raise perr.TerminateNotConfirmed(
            f"{r['name']} ({r['id']}): terminate sent, not gone yet", provider="fake")
    gone(r, max(r["terminate_confirm_at"], r["terminate_requested_at"]), "terminated")


def gone(r: dict[str, Any], at: float, why: str) -> None:
    if r["gone_at"] is None:
        r["gone_at"] = at
        r["events"].append([at, f"gone ({why})"])


def _end(r: dict[str, Any], at: float, phase: str, code: int | None, autodown: float | None, msg: str) -> None:
    r["phase"] = phase
    r["ended_at"] = at
    r["exit_code"] = code
    r["events"].append([at, msg])
    if phase == "preempted":
        gone(r, at, "preempted")
    elif autodown is not None:
        r["autodown_at"] = at + float(autodown)


def advance_all(st: dict[str, Any], now: float, workload: Workload | None) -> None:
    for r in ordered(st):
        advance(st, r, now, workload)


def advance(st: dict[str, Any], r: dict[str, Any], now: float, workload: Workload | None) -> None:
    """Apply everything that happened to ``r`` up to ``now``, in time order."""
    if r["gone_at"] is not None:
        return
    autodown = st["config"]["autodown_seconds"]
    if r["phase"] in ("provisioning", "running"):
        # Candidate events, earliest first.
        cands: list[tuple[float, str]] = []
        if r["preempt_at"] is not None:
            cands.append((max(r["preempt_at"], r["created_at"]), "preempt"))
        if r["exit_at"] is not None:
            cands.append((max(r["exit_at"], r["ready_at"]), "exit"))
        if r.get("deadline") is not None:
            cands.append((max(r["deadline"], r["created_at"]), "deadline"))
        cands.sort()
        for t, kind in cands:
            if t > now:
                break
            if r["phase"] == "provisioning" and t >= r["ready_at"]:
                r["phase"] = "running"
                r["events"].append([r["ready_at"], "running"])
            if kind == "preempt":
                _end(r, t, "preempted", None, autodown, "preempted by the cloud")
            elif kind == "exit":
                code = int(r["exit_code_planned"] or 0)
                _end(r, t, "exited", code, autodown, f"job exited with code {code}")
            else:
                _end(r, t, "terminated", None, None, "hard deadline reached")
                gone(r, t, "deadline")
            break
        if r["phase"] == "provisioning" and now >= r["ready_at"]:
            r["phase"] = "running"
            r["events"].append([r["ready_at"], "running"])
        if r["phase"] == "running" and workload is not None:
            out = workload(FakeInstance.from_record(r), now)
            if out is not None:
                code, at = (out if isinstance(out, tuple) else (out, now))
                at = min(max(float(at), r["ready_at"]), now)
                _end(r, at, "exited", int(code), autodown, f"job exited with code {int(code)}")
    if r["gone_at"] is None and r.get("autodown_at") is not None and now >= r["autodown_at"]:
        gone(r, r["autodown_at"], "removed itself after its job ended")
    if (r["gone_at"] is None and r["terminate_confirm_at"] is not None
            and now >= r["terminate_confirm_at"]):
        gone(r, r["terminate_confirm_at"], "terminated")


def node_state(r: dict[str, Any]) -> NodeState:
    """The provider-facing state: exit 0 → SUCCEEDED, 75/76 → PREEMPTED, other codes → FAILED."""
    phase = r["phase"]
    if phase == "provisioning":
        return NodeState.PENDING
    if phase == "running":
        return NodeState.RUNNING
    if phase == "preempted":
        return NodeState.PREEMPTED
    if phase == "exited":
        code = r["exit_code"]
        if code == 0:
            return NodeState.SUCCEEDED
        if code in PREEMPT_EXIT_CODES:
            return NodeState.PREEMPTED
        return NodeState.FAILED
    return NodeState.TERMINATED

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
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from orchestrator.contract.gpus import gpu_matches
from providers import errors as perr
from providers.base import (
    PREEMPT_EXIT_CODES,
    NAME_PREFIX,
    Capabilities,
    Capability,
    Handle,
    LaunchRequest,
    NodeState,
    Offer,
    OwnedInstance,
    Provider,
    Requirements,
)

Clock = Callable[[], float]

"""Exit codes that mean "stopped cleanly, resume me" (runuri.EXIT_PREEMPTED, EXIT_WATCHDOG)."""

_SECRET_RE = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL)", re.I)

_ERRORS: dict[str, type[perr.ProviderError]] = {
    "NoCapacity": perr.NoCapacity,
    "QuotaExceeded": perr.QuotaExceeded,
    "AuthError": perr.AuthError,
    "Transient": perr.Transient,
    "NotSupported": perr.NotSupported,
    "TerminateNotConfirmed": perr.TerminateNotConfirmed,
}
_OPS = ("launch", "poll", "terminate", "list_owned", "offers")


@dataclass(frozen=True)
class FakeOfferTemplate:
    """A priced GPU type in a region; ``offers()`` sizes it to the request."""

    region: str
    gpu: str
    spot: bool
    price_per_gpu_hour: float

    def to_dict(self) -> dict[str, Any]:
        return {"region": self.region, "gpu": self.gpu, "spot": self.spot,
                "price_per_gpu_hour": self.price_per_gpu_hour}


DEFAULT_OFFERS: tuple[FakeOfferTemplate, ...] = (
    FakeOfferTemplate("fake-east", "H100", False, 2.49),
    FakeOfferTemplate("fake-east", "H100", True, 1.29),
    FakeOfferTemplate("fake-west", "H100", False, 2.89),
    FakeOfferTemplate("fake-west", "H100", True, 1.49),
    FakeOfferTemplate("fake-east", "A100-80GB", False, 1.79),
    FakeOfferTemplate("fake-west", "A100-80GB", True, 0.89),
    FakeOfferTemplate("fake-east", "L4", False, 0.59),
    FakeOfferTemplate("fake-west", "L4", True, 0.29),
    FakeOfferTemplate("fake-east", "cpu", False, 0.05),
    FakeOfferTemplate("fake-west", "cpu", True, 0.02),
)


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


def _default_config() -> dict[str, Any]:
    return {
        "offers": [o.to_dict() for o in DEFAULT_OFFERS],
        "provision_seconds": 90.0,
        "autodown_seconds": 0.0,
        "terminate_seconds": 0.0,
        "preemptions_per_hour": 0.0,
        "transient_rate": 0.0,
        "seed": 0,
        "max_gpus_per_node": 8,
    }


def _empty_state() -> dict[str, Any]:
    return {"version": 1, "config": _default_config(), "seq": 0, "calls": 0,
            "instances": {}, "scripts": {}, "faults": []}


def default_path() -> Path:
    """``$DTRUN_FAKE_CLOUD``, else ``$DTRUN_HOME/fake-cloud.json`` (DTRUN_HOME default ~/.dtrun)."""
    env = os.environ.get("DTRUN_FAKE_CLOUD")
    if env:
        return Path(env).expanduser()
    home = Path(os.environ.get("DTRUN_HOME") or "~/.dtrun").expanduser()
    return home / "fake-cloud.json"


class FakeProvider(Provider):
    """The fake cloud as a provider. See the module docstring for the model.

    Config arguments left as None keep what the shared file already says (or the defaults).
    """

    name = "fake"

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        clock: Clock | None = None,
        *,
        offers: list[FakeOfferTemplate] | None = None,
        provision_seconds: float | None = None,
        autodown_seconds: float | None | object = ...,
        terminate_seconds: float | None = None,
        preemptions_per_hour: float | None = None,
        transient_rate: float | None = None,
        seed: int | None = None,
        max_gpus_per_node: int | None = None,
        workload: Workload | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.clock: Clock = clock or time.time
        self.workload = workload
        self._mem = _empty_state()
        self._tlock = threading.RLock()
        updates: dict[str, Any] = {}
        if offers is not None:
            updates["offers"] = [o.to_dict() for o in offers]
        for k, v in (("provision_seconds", provision_seconds), ("terminate_seconds", terminate_seconds),
                     ("preemptions_per_hour", preemptions_per_hour), ("transient_rate", transient_rate),
                     ("seed", seed), ("max_gpus_per_node", max_gpus_per_node)):
            if v is not None:
                updates[k] = v
        if autodown_seconds is not ...:
            updates["autodown_seconds"] = autodown_seconds
        if updates or self.path is not None:
            with self._state() as st:
                st["config"].update(updates)

    # ---- state: in memory or a locked JSON file ------------------------------------------------
    @contextlib.contextmanager
    def _state(self, write: bool = True) -> Iterator[dict[str, Any]]:
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
                        st, fresh = _empty_state(), True
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

    @contextlib.contextmanager
    def _op(self, op: str, subject: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any], float]]:
        """Lock the cloud, advance it to now, then apply faults for ``op``; yields (state, now).

        A fault raised here still persists the advance (and the fault's used count)."""
        with self._state() as st:
            now = float(self.clock())
            self._advance_all(st, now)
            st["calls"] += 1
            err = self._fault(st, op, subject)
            if err is not None:
                raise err
            yield st, now

    # ---- configuration and scripting -----------------------------------------------------------
    def config(self) -> dict[str, Any]:
        with self._state(write=False) as st:
            return copy.deepcopy(st["config"])

    def configure(self, **kwargs: Any) -> None:
        """Change config keys (see ``_default_config``) in the shared cloud."""
        unknown = set(kwargs) - set(_default_config())
        if unknown:
            raise ValueError(f"unknown fake cloud config keys: {sorted(unknown)}")
        if "offers" in kwargs:
            kwargs["offers"] = [o.to_dict() if isinstance(o, FakeOfferTemplate) else dict(o)
                                for o in kwargs["offers"]]
        with self._state() as st:
            st["config"].update(kwargs)

    def script(self, name: str, *, exit_after: float | None = None, exit_code: int = 0,
               preempt_after: float | None = None) -> None:
        """Script what the next instance called ``name`` does: exit with ``exit_code`` or be
        preempted, that many seconds after it starts running. Consumed by the next launch."""
        with self._state() as st:
            st["scripts"].setdefault(name, []).append(
                {"exit_after": exit_after, "exit_code": exit_code, "preempt_after": preempt_after})

    def set_exit(self, id_or_name: str, *, at: float | None = None, code: int = 0) -> None:
        """The live instance's job exits with ``code`` at time ``at`` (default now)."""
        with self._state() as st:
            now = float(self.clock())
            self._advance_all(st, now)
            r = self._find(st, id_or_name)
            r["exit_at"] = now if at is None else float(at)
            r["exit_code_planned"] = int(code)
            self._advance(st, r, now)

    def preempt(self, id_or_name: str, *, at: float | None = None) -> None:
        """The cloud takes the live instance away at time ``at`` (default now)."""
        with self._state() as st:
            now = float(self.clock())
            self._advance_all(st, now)
            r = self._find(st, id_or_name)
            r["preempt_at"] = now if at is None else float(at)
            self._advance(st, r, now)

    def inject(self, op: str, error: str, *, count: int | None = 1, match: str = "*",
               create: bool = False) -> None:
        """The next ``count`` calls of ``op`` matching ``match`` raise ``error`` (see module doc)."""
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS}, not {op!r}")
        if error not in _ERRORS:
            raise ValueError(f"error must be one of {sorted(_ERRORS)}, not {error!r}")
        with self._state() as st:
            st["faults"].append({"op": op, "error": error, "remaining": count, "match": match,
                                 "create": bool(create)})

    def clear_faults(self) -> None:
        with self._state() as st:
            st["faults"] = []

    # ---- inspection ------------------------------------------------------------------------------
    def instances(self) -> list[FakeInstance]:
        """Every instance the cloud ever had (advanced to now), oldest first."""
        with self._state() as st:
            self._advance_all(st, float(self.clock()))
            return [FakeInstance.from_record(r) for r in self._ordered(st)]

    def instance(self, id_or_name: str) -> FakeInstance:
        with self._state() as st:
            self._advance_all(st, float(self.clock()))
            return FakeInstance.from_record(self._find(st, id_or_name))

    def running_instances(self) -> list[FakeInstance]:
        """Instances not yet gone — still billing (provisioning, running, exited but not removed,
        or terminating)."""
        return [i for i in self.instances() if i.gone_at is None]

    def bill(self) -> dict[str, Any]:
        """Per-instance rows (seconds × price, start of provisioning → confirmed gone; still-live
        instances count up to now) and the total, in USD."""
        with self._state() as st:
            now = float(self.clock())
            self._advance_all(st, now)
            rows = []
            for r in self._ordered(st):
                end = r["gone_at"] if r["gone_at"] is not None else now
                seconds = max(0.0, end - r["created_at"])
                cost = seconds / 3600.0 * r["price_per_hour"]
                rows.append({"id": r["id"], "name": r["name"], "offer": r["offer_key"],
                             "price_per_hour": r["price_per_hour"], "start": r["created_at"],
                             "end": r["gone_at"], "live": r["gone_at"] is None,
                             "seconds": seconds, "cost_usd": cost})
            return {"rows": rows, "total_usd": sum(x["cost_usd"] for x in rows), "time": now}

    # ---- Provider interface --------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        with self._state(write=False) as st:
            mx = int(st["config"]["max_gpus_per_node"])
        return Capabilities(spot=Capability(True), multi_node=Capability(True), max_gpus_per_node=mx)

    def offers(self, req: Requirements) -> list[Offer]:
        if self.refuse(req) is not None:
            return []
        with self._op("offers") as (st, _now):
            templates = [FakeOfferTemplate(**o) for o in st["config"]["offers"]]
        out = []
        for t in templates:
            if not gpu_matches(req.gpu, t.gpu):  # `H100` takes either variant, as on a real cloud
                continue
            if (req.spot is True and not t.spot) or (req.spot is False and t.spot):
                continue
            if req.regions and t.region not in req.regions:
                continue
            if req.max_price_per_gpu_hour is not None and t.price_per_gpu_hour > req.max_price_per_gpu_hour:
                continue
            out.append(Offer("fake", t.region, t.gpu, req.gpus_per_node, t.spot, t.price_per_gpu_hour,
                             price_source="fake cloud", nodes=req.nodes))
        return sorted(out, key=lambda o: o.price_per_hour)

    def launch(self, request: LaunchRequest) -> Handle:
        # ``request.secrets`` is accepted and dropped: the fake cloud's nodes run nothing, and
        # its JSON file must never hold a secret (env keys that look secret are dropped too).
        offer = request.offer
        req = Requirements(gpu=offer.gpu, gpus_per_node=offer.gpus_per_node, nodes=request.nodes,
                           spot=offer.spot)
        reason = self.refuse(req)
        if reason:
            raise perr.NotSupported(reason, provider="fake")
        name = request.instance_name
        subject = {"name": name, "region": offer.region, "offer": offer.key(), "id": ""}
        with self._state() as st:
            now = float(self.clock())
            self._advance_all(st, now)
            st["calls"] += 1
            fault = self._fault(st, "launch", subject, want_create=True)
            err, create = fault if isinstance(fault, tuple) else (fault, False)
            if err is not None and not create:
                raise err
            known = {(o["region"], o["gpu"], o["spot"]) for o in st["config"]["offers"]}
            if (offer.region, offer.gpu, offer.spot) not in known:
                raise perr.NoCapacity(f"fake cloud has no {offer.key()} offer", provider="fake")
            r = self._create(st, request, now)
            if err is not None:
                raise err
        return self._handle(r)

    def poll(self, handle: Handle) -> NodeState:
        subject = {"name": handle.name, "id": handle.instance_id, "region": handle.region, "offer": ""}
        with self._op("poll", subject) as (st, _now):
            r = st["instances"].get(handle.instance_id)
            if r is None:
                return NodeState.PREEMPTED  # vanished without our terminate
            return _node_state(r)

    def terminate(self, handle: Handle) -> None:
        subject = {"name": handle.name, "id": handle.instance_id, "region": handle.region, "offer": ""}
        with self._op("terminate", subject) as (st, now):
            r = st["instances"].get(handle.instance_id)
            if r is None or r["gone_at"] is not None:
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
            self._gone(r, max(r["terminate_confirm_at"], r["terminate_requested_at"]), "terminated")

    def list_owned(self, prefix: str = NAME_PREFIX) -> list[OwnedInstance]:
        with self._op("list_owned") as (st, _now):
            return [OwnedInstance(r["name"], r["id"], _node_state(r), r["region"], r["created_at"])
                    for r in self._ordered(st) if r["gone_at"] is None and r["name"].startswith(prefix)]

    def logs(self, handle: Handle, tail: int = 200) -> str:
        with self._state() as st:
            self._advance_all(st, float(self.clock()))
            r = st["instances"].get(handle.instance_id)
            if r is None:
                return ""
            lines = [f"[{t:.1f}] {msg}" for t, msg in r["events"]]
            return "\n".join(lines[-tail:])

    # ---- internals -----------------------------------------------------------------------------
    @staticmethod
    def _ordered(st: dict[str, Any]) -> list[dict[str, Any]]:
        return sorted(st["instances"].values(), key=lambda r: r["seq"])

    def _find(self, st: dict[str, Any], id_or_name: str) -> dict[str, Any]:
        r = st["instances"].get(id_or_name)
        if r is not None:
            return r
        named = [x for x in self._ordered(st) if x["name"] == id_or_name]
        if not named:
            raise KeyError(f"fake cloud has no instance {id_or_name!r}")
        return named[-1]

    def _handle(self, r: dict[str, Any]) -> Handle:
        return Handle(provider="fake", name=r["name"], instance_id=r["id"], region=r["region"],
                      launched_at=r["created_at"],
                      data={"offer": r["offer_key"], "nodes": r["nodes"], "price_per_hour": r["price_per_hour"]})

    def _rng(self, st: dict[str, Any], *parts: Any) -> random.Random:
        return random.Random(":".join(str(p) for p in (st["config"]["seed"], *parts)))

    def _fault(self, st: dict[str, Any], op: str, subject: dict[str, Any] | None,
               want_create: bool = False) -> Any:
        subject = subject or {}
        for f in st["faults"]:
            if f["op"] != op or f["remaining"] == 0:
                continue
            if f["match"] != "*" and f["match"] not in {v for v in subject.values() if v} and not (
                    subject.get("name", "").startswith(f["match"])):
                continue
            if f["remaining"] is not None:
                f["remaining"] -= 1
            what = subject.get("name") or subject.get("id") or op
            err = _ERRORS[f["error"]](f"fake cloud: injected {f['error']} on {op} ({what})", provider="fake")
            return (err, f["create"]) if want_create else err
        st["faults"] = [f for f in st["faults"] if f["remaining"] != 0]
        rate = float(st["config"]["transient_rate"])
        if rate > 0 and op in ("launch", "poll", "terminate"):
            if self._rng(st, "transient", st["calls"]).random() < rate:
                err = perr.Transient(f"fake cloud: random API fault on {op} (HTTP 503)", provider="fake")
                return (err, False) if want_create else err
        return (None, False) if want_create else None

    def _create(self, st: dict[str, Any], request: LaunchRequest, now: float) -> dict[str, Any]:
        cfg = st["config"]
        st["seq"] += 1
        iid = f"fake-{st['seq']:05d}"
        offer = request.offer
        price = offer.price_per_gpu_hour * offer.gpus_per_node * request.nodes
        ready_at = now + float(cfg["provision_seconds"])
        r: dict[str, Any] = {
            "id": iid, "seq": st["seq"], "name": request.instance_name, "job": request.job,
            "attempt": request.attempt, "offer": offer.to_dict(), "offer_key": offer.key(),
            "region": offer.region, "spot": offer.spot, "nodes": request.nodes, "price_per_hour": price,
            "env": {k: v for k, v in request.env.items() if not _SECRET_RE.search(k)},
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
            r["preempt_at"] = ready_at + self._rng(st, "preempt", iid).expovariate(rate / 3600.0)
        if request.deadline is not None:
            # The provider-side hard deadline: the node is removed then, whatever happens.
            r["deadline"] = float(request.deadline)
        st["instances"][iid] = r
        return r

    def _gone(self, r: dict[str, Any], at: float, why: str) -> None:
        if r["gone_at"] is None:
            r["gone_at"] = at
            r["events"].append([at, f"gone ({why})"])

    def _end(self, r: dict[str, Any], at: float, phase: str, code: int | None, autodown: float | None,
             msg: str) -> None:
        r["phase"] = phase
        r["ended_at"] = at
        r["exit_code"] = code
        r["events"].append([at, msg])
        if phase == "preempted":
            self._gone(r, at, "preempted")
        elif autodown is not None:
            r["autodown_at"] = at + float(autodown)

    def _advance_all(self, st: dict[str, Any], now: float) -> None:
        for r in self._ordered(st):
            self._advance(st, r, now)

    def _advance(self, st: dict[str, Any], r: dict[str, Any], now: float) -> None:
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
                    self._end(r, t, "preempted", None, autodown, "preempted by the cloud")
                elif kind == "exit":
                    code = int(r["exit_code_planned"] or 0)
                    self._end(r, t, "exited", code, autodown, f"job exited with code {code}")
                else:
                    self._end(r, t, "terminated", None, None, "hard deadline reached")
                    self._gone(r, t, "deadline")
                break
            if r["phase"] == "provisioning" and now >= r["ready_at"]:
                r["phase"] = "running"
                r["events"].append([r["ready_at"], "running"])
            if r["phase"] == "running" and self.workload is not None:
                out = self.workload(FakeInstance.from_record(r), now)
                if out is not None:
                    code, at = (out if isinstance(out, tuple) else (out, now))
                    at = min(max(float(at), r["ready_at"]), now)
                    self._end(r, at, "exited", int(code), autodown, f"job exited with code {int(code)}")
        if r["gone_at"] is None and r.get("autodown_at") is not None and now >= r["autodown_at"]:
            self._gone(r, r["autodown_at"], "removed itself after its job ended")
        if (r["gone_at"] is None and r["terminate_confirm_at"] is not None
                and now >= r["terminate_confirm_at"]):
            self._gone(r, r["terminate_confirm_at"], "terminated")


def _node_state(r: dict[str, Any]) -> NodeState:
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


def shared_cloud(path: str | os.PathLike[str] | None = None, clock: Clock | None = None,
                 **kwargs: Any) -> FakeProvider:
    """The fake cloud that CLI processes share (``providers.registry.get("fake")``): the file
    ``path``, else ``$DTRUN_FAKE_CLOUD``, else ``$DTRUN_HOME/fake-cloud.json``."""
    return FakeProvider(path if path is not None else default_path(), clock, **kwargs)

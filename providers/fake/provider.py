"""The fake cloud as a :class:`~providers.base.Provider`: the facade tests and ``dtrun simulate`` use.

Every call locks the cloud's state (``store``), advances every instance to ``clock()``
(``instances``), applies injected faults (``faults``), then does its part. Scripting (``script``,
``set_exit``, ``preempt``, ``inject``) and inspection (``instances``, ``bill``) sit beside the
provider interface. See the package docstring for the model.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from providers import errors as perr
from providers.base import (
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
from providers.fake import instances as inst
from providers.fake.bill import bill as bill_of
from providers.fake.faults import new_fault, next_fault
from providers.fake.instances import FakeInstance, Workload
from providers.fake.offers import FakeOfferTemplate, matching_offers
from providers.fake.store import CloudStore, default_config, default_path

Clock = Callable[[], float]


class FakeProvider(Provider):
    """The fake cloud as a provider. See the package docstring for the model.

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
        self._store = CloudStore(self.path)
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
        if updates or workload is not None:
            updates["driven"] = True  # a driver set this cloud up (see check_credentials)
        if updates or self.path is not None:
            with self._store.state() as st:
                st["config"].update(updates)

    # ---- state: locked, advanced to now ----------------------------------------------------------
    @contextlib.contextmanager
    def _now(self) -> Iterator[tuple[dict[str, Any], float]]:
        """Lock the cloud and advance it to now; yields (state, now)."""
        with self._store.state() as st:
            now = float(self.clock())
            inst.advance_all(st, now, self.workload)
            yield st, now

    @contextlib.contextmanager
    def _op(self, op: str, subject: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any], float]]:
        """Lock the cloud, advance it to now, then apply faults for ``op``; yields (state, now).

        A fault raised here still persists the advance (and the fault's used count)."""
        with self._now() as (st, now):
            st["calls"] += 1
            err = next_fault(st, op, subject)
            if err is not None:
                raise err
            yield st, now

    # ---- configuration and scripting -----------------------------------------------------------
    def config(self) -> dict[str, Any]:
        with self._store.state(write=False) as st:
            return copy.deepcopy(st["config"])

    def configure(self, **kwargs: Any) -> None:
        """Change config keys (see ``store.default_config``) in the shared cloud."""
        unknown = set(kwargs) - set(default_config())
        if unknown:
            raise ValueError(f"unknown fake cloud config keys: {sorted(unknown)}")
        if "offers" in kwargs:
            kwargs["offers"] = [o.to_dict() if isinstance(o, FakeOfferTemplate) else dict(o)
                                for o in kwargs["offers"]]
        with self._store.state() as st:
            st["config"].update(kwargs, driven=True)

    def script(self, name: str, *, exit_after: float | None = None, exit_code: int = 0,
               preempt_after: float | None = None) -> None:
        """Script what the next instance called ``name`` does: exit with ``exit_code`` or be
        preempted, that many seconds after it starts running. Consumed by the next launch."""
        with self._store.state() as st:
            st["scripts"].setdefault(name, []).append(
                {"exit_after": exit_after, "exit_code": exit_code, "preempt_after": preempt_after})

    def set_exit(self, id_or_name: str, *, at: float | None = None, code: int = 0) -> None:
        """The live instance's job exits with ``code`` at time ``at`` (default now)."""
        with self._now() as (st, now):
            r = inst.find(st, id_or_name)
            r["exit_at"] = now if at is None else float(at)
            r["exit_code_planned"] = int(code)
            inst.advance(st, r, now, self.workload)

    def preempt(self, id_or_name: str, *, at: float | None = None) -> None:
        """The cloud takes the live instance away at time ``at`` (default now)."""
        with self._now() as (st, now):
            r = inst.find(st, id_or_name)
            r["preempt_at"] = now if at is None else float(at)
            inst.advance(st, r, now, self.workload)

    def inject(self, op: str, error: str, *, count: int | None = 1, match: str = "*",
               create: bool = False) -> None:
        """The next ``count`` calls of ``op`` matching ``match`` raise ``error`` (see ``faults``)."""
        fault = new_fault(op, error, count, match, create)
        with self._store.state() as st:
            st["faults"].append(fault)

    def clear_faults(self) -> None:
        with self._store.state() as st:
            st["faults"] = []

    # ---- inspection ------------------------------------------------------------------------------
    def instances(self) -> list[FakeInstance]:
        """Every instance the cloud ever had (advanced to now), oldest first."""
        with self._now() as (st, _now):
            return [FakeInstance.from_record(r) for r in inst.ordered(st)]

    def instance(self, id_or_name: str) -> FakeInstance:
        with self._now() as (st, _now):
            return FakeInstance.from_record(inst.find(st, id_or_name))

    def running_instances(self) -> list[FakeInstance]:
        """Instances not yet gone — still billing (provisioning, running, exited but not removed,
        or terminating)."""
        return [i for i in self.instances() if i.gone_at is None]

    def bill(self) -> dict[str, Any]:
        """Per-instance rows (seconds × price, start of provisioning → confirmed gone; still-live
        instances count up to now) and the total, in USD."""
        with self._now() as (st, now):
            return bill_of(st, now)

    # ---- Provider interface --------------------------------------------------------------------
    def check_credentials(self) -> None:
        """The fake cloud runs no trainer: its nodes move only when a driver (a test, a
        simulation) set the cloud up and plays it forward. So it is usable in memory (whoever
        made it drives it) and as a shared file once a driver configured it (``FakeProvider``
        with settings, or ``configure``: config ``driven``); the untouched file that
        ``providers: [fake]`` in a job gets is refused — a run on it would stay PROVISIONING
        forever. ``dtrun up`` turns this into its no-usable-provider refusal (exit 5)."""
        if self.path is None:
            return
        with self._store.state(write=False) as st:
            if st["config"].get("driven"):
                return
        raise perr.AuthError(
            "resources.providers: 'fake' is dtrun's test cloud — it runs no trainer and its nodes never "
            "leave PROVISIONING unless a test drives it; use providers: [local] to run on this machine "
            "(or `dtrun simulate` to play a run on the fake cloud)", provider="fake")

    def capabilities(self) -> Capabilities:
        with self._store.state(write=False) as st:
            mx = int(st["config"]["max_gpus_per_node"])
        return Capabilities(spot=Capability(True), multi_node=Capability(True), max_gpus_per_node=mx)

    def offers(self, req: Requirements) -> list[Offer]:
        if self.refuse(req) is not None:
            return []
        with self._op("offers") as (st, _now):
            templates = [FakeOfferTemplate(**o) for o in st["config"]["offers"]]
        return matching_offers(templates, req)

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
        with self._now() as (st, now):
            st["calls"] += 1
            err, create = next_fault(st, "launch", subject, want_create=True)
            if err is not None and not create:
                raise err
            known = {(o["region"], o["gpu"], o["spot"]) for o in st["config"]["offers"]}
            if (offer.region, offer.gpu, offer.spot) not in known:
                raise perr.NoCapacity(f"fake cloud has no {offer.key()} offer", provider="fake")
            r = inst.create(st, request, now)
            if err is not None:
                raise err
        return self._handle(r)

    def poll(self, handle: Handle) -> NodeState:
        subject = {"name": handle.name, "id": handle.instance_id, "region": handle.region, "offer": ""}
        with self._op("poll", subject) as (st, _now):
            r = st["instances"].get(handle.instance_id)
            if r is None:
                return NodeState.PREEMPTED  # vanished without our terminate
            return inst.node_state(r)

    def terminate(self, handle: Handle) -> None:
        subject = {"name": handle.name, "id": handle.instance_id, "region": handle.region, "offer": ""}
        with self._op("terminate", subject) as (st, now):
            r = st["instances"].get(handle.instance_id)
            if r is not None:  # a missing instance is already gone: not an error
                inst.terminate(st, r, now)

    def list_owned(self, prefix: str = NAME_PREFIX) -> list[OwnedInstance]:
        with self._op("list_owned") as (st, _now):
            return [OwnedInstance(r["name"], r["id"], inst.node_state(r), r["region"], r["created_at"],
                                  r.get("owner"))
                    for r in inst.ordered(st) if r["gone_at"] is None and r["name"].startswith(prefix)]

    def logs(self, handle: Handle, tail: int = 200) -> str:
        with self._now() as (st, _now):
            r = st["instances"].get(handle.instance_id)
            if r is None:
                return ""
            lines = [f"[{t:.1f}] {msg}" for t, msg in r["events"]]
            return "\n".join(lines[-tail:])

    @staticmethod
    def _handle(r: dict[str, Any]) -> Handle:
        return Handle(provider="fake", name=r["name"], instance_id=r["id"], region=r["region"],
                      launched_at=r["created_at"],
                      data={"offer": r["offer_key"], "nodes": r["nodes"], "price_per_hour": r["price_per_hour"]})


def shared_cloud(path: str | os.PathLike[str] | None = None, clock: Clock | None = None,
                 **kwargs: Any) -> FakeProvider:
    """The fake cloud that CLI processes share (``providers.registry.get("fake")``): the file
    ``path``, else ``$DTRUN_FAKE_CLOUD``, else ``$DTRUN_HOME/fake-cloud.json``."""
    return FakeProvider(path if path is not None else default_path(), clock, **kwargs)

"""The provider interface: a small required core, capabilities declared with reasons.

Every place nodes come from (the fake cloud, this machine, RunPod/Lambda/Vast through SkyPilot,
Modal) implements :class:`Provider`. Records crossing the boundary are typed dataclasses, never
free-form dicts. Importing this module imports no provider SDK.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from orchestrator.contract.runuri import EXIT_PREEMPTED, EXIT_WATCHDOG

# Node exit codes that mean "stopped cleanly, resume me": the trainer's SIGTERM exit and the node
# watchdog's stop (orchestrator/runuri.py is the source of both numbers).
PREEMPT_EXIT_CODES = (EXIT_PREEMPTED, EXIT_WATCHDOG)


class NodeState(str, enum.Enum):
    PENDING = "PENDING"          # requested, not running yet (provisioning, setup)
    RUNNING = "RUNNING"          # the node bootstrap is running
    PREEMPTED = "PREEMPTED"      # taken away (spot), or stopped cleanly asking to be resumed
    SUCCEEDED = "SUCCEEDED"      # the node's job exited 0
    FAILED = "FAILED"            # the node's job exited non-zero (not a preemption)
    TERMINATED = "TERMINATED"    # gone after terminate(), or never found

    @property
    def is_terminal(self) -> bool:
        return self in (NodeState.PREEMPTED, NodeState.SUCCEEDED, NodeState.FAILED, NodeState.TERMINATED)


@dataclass(frozen=True)
class Offer:
    """One way to rent the job's nodes: a price per GPU-hour for a GPU type in a region."""

    provider: str
    region: str
    gpu: str
    gpus_per_node: int
    spot: bool
    price_per_gpu_hour: float
    price_source: str = "snapshot"
    """Where the price came from: 'snapshot <date>', 'skypilot catalog <file mtime>', 'live', …"""
    price_date: str = ""
    nodes: int = 1
    instance_type: str | None = None
    regions: tuple[str, ...] = ()
    """Where the provider may place it, in order (cheapest first): one launch tries them all
    (SkyPilot fails over across them). Empty = anywhere the provider sells it (``region`` is
    then "any", or the only region)."""
    price_known: bool = True
    """False for a spot offer without a spot figure (priced at on-demand as an upper bound): the
    plan ranks it after every offer whose price is known."""
    spot_bid: float | None = None
    """USD per GPU-hour SkyPilot will bid for this spot offer (RunPod ``bid_per_gpu``; Vast
    ``price`` ÷ GPUs), when dtrun knows it; the quote is this figure."""
    price_fetched_at: float | None = None
    """When the price was fetched from the provider's API (epoch seconds); None = a snapshot or a
    catalog dtrun did not fetch (``price_date`` dates it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.regions, tuple):  # from JSON: a list
            object.__setattr__(self, "regions", tuple(self.regions or ()))

    @property
    def price_per_node_hour(self) -> float:
        return self.price_per_gpu_hour * self.gpus_per_node

    @property
    def price_per_hour(self) -> float:
        return self.price_per_node_hour * self.nodes

    def key(self) -> str:
        return f"{self.provider}/{self.region}/{self.gpu}x{self.gpus_per_node}{'/spot' if self.spot else ''}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["price_per_hour"] = round(self.price_per_hour, 6)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Offer":
        keys = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in keys})


@dataclass(frozen=True)
class Requirements:
    """What the job needs, from the spec's resources section."""

    gpu: str
    gpus_per_node: int
    nodes: int = 1
    spot: bool | str = False          # True, False or "prefer"
    regions: tuple[str, ...] = ()
    max_price_per_gpu_hour: float | None = None


@dataclass(frozen=True)
class Capability:
    supported: bool
    reason: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What a provider can do, each with the reason a user reads when it cannot."""

    spot: Capability
    multi_node: Capability
    max_gpus_per_node: int
    stop: Capability = Capability(False, "dtrun never stops instances: only terminate ends billing")

    def refuse(self, req: Requirements, provider: str) -> str | None:
        """The reason this provider cannot serve ``req``, or None."""
        if req.spot is True and not self.spot.supported:
            return f"spot is not available on {provider}: {self.spot.reason}"
        if req.nodes > 1 and not self.multi_node.supported:
            return f"multi-node is not available on {provider}: {self.multi_node.reason}"
        if req.gpus_per_node > self.max_gpus_per_node:
            return f"{provider} offers at most {self.max_gpus_per_node} GPUs per node (asked {req.gpus_per_node})"
        return None


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a provider needs to start one attempt's nodes."""

    job: str
    attempt: int
    offer: Offer
    nodes: int
    command: list[str]
    """The node bootstrap command (argv), run once per node."""
    env: dict[str, str] = field(default_factory=dict)
    """Non-secret environment for the bootstrap (recorded by some providers; never put a secret
    here: secrets go in ``secrets``)."""
    deadline: float | None = None
    """Unix time after which the node must be gone whatever happens (provider-side timeout)."""
    workdir: str | None = None
    """Directory synced to the node (the project), when the provider supports it."""
    log_path: str | None = None
    cpu_per_gpu: float | None = None
    """Physical CPU cores to request per GPU (providers that size containers: Modal)."""
    memory_gb_per_gpu: float | None = None
    """Host memory (GiB) to request per GPU (providers that size containers: Modal)."""
    image: str | None = None
    """Container image the node runs (``resources.image`` resolved: a registry reference with Python
    and torch preinstalled), for providers that run one (RunPod/Vast: SkyPilot ``image_id:
    docker:<image>``; Modal: the sandbox's base image). None: the provider's own image or VM."""
    secrets: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    """Secret environment for the bootstrap (the object store's AWS keys for an ``s3://`` run URI
    or data on a remote node). Never logged, never persisted: not in the state store, the fake
    cloud's file, a Handle, a provider's memo file or an exported YAML; ``repr`` leaves it out.
    Remote providers hand it to their SDK's secret mechanism (SkyPilot task ``secrets``, a Modal
    ``Secret``); nodes on this machine (local, fake) get nothing here: they inherit the process
    environment."""
    on_progress: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False, compare=False)
    """Called from the launching thread as a long launch moves on, with where it is: Modal's image
    build ``{"phase": "image", "layer": k, "layers": n, "label": what the layer adds, "since": unix
    time it started, "line": the build's newest log line}``. Providers with nothing to say never
    call it; it must not block."""
    owner: str | None = None
    """Who launched it: the launching state store's (or server's) owner id (``StateStore.owner_id``).
    Providers keep it with the instance where the provider keeps it too (fake: the instance's
    record; local: its registry; Modal: the sandbox tag ``dtrun_owner``; SkyPilot: the provider's
    memo of the clusters it launched) and report it in ``list_owned``, so the orphan sweep of one
    store never terminates another store's nodes on a shared account. Not part of the name: the
    name stays ``dtrun-<job>-a<N>`` (SkyPilot's cluster-name length limit)."""

    @property
    def instance_name(self) -> str:
        """Every instance is named with the job's prefix so orphans can be swept."""
        return instance_name(self.job, self.attempt)


NAME_PREFIX = "dtrun-"


def instance_name(job: str, attempt: int) -> str:
    return f"{NAME_PREFIX}{job}-a{attempt}"


def job_of_instance(name: str) -> str | None:
    """The job name encoded in an instance name, or None if it is not dtrun's."""
    if not name.startswith(NAME_PREFIX):
        return None
    rest = name[len(NAME_PREFIX):]
    job, sep, att = rest.rpartition("-a")
    return job if sep and att.split("-")[0].isdigit() else None


@dataclass
class Handle:
    """A launched attempt: enough to poll and terminate it, also from another process."""

    provider: str
    name: str
    instance_id: str
    region: str = ""
    launched_at: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    """Provider specifics (local: pid, pgid, log path; skypilot: cluster name; modal: sandbox id)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Handle":
        return cls(**d)


@dataclass(frozen=True)
class OwnedInstance:
    name: str
    instance_id: str
    state: NodeState
    region: str = ""
    created_at: float | None = None
    owner: str | None = None
    """``LaunchRequest.owner`` as the provider kept it; None: launched without one (dtrun before
    owners) or by a provider that does not keep it."""


class Provider(ABC):
    """A place nodes come from. Implementations must keep these contracts:

    - ``terminate`` is idempotent: an instance already gone is not an error. When the request was
      sent but the instance is not confirmed gone, raise ``TerminateNotConfirmed`` so the caller
      polls again; never report an instance gone before the provider says so.
    - ``poll`` reports a vanished instance as PREEMPTED unless it was terminated by us (TERMINATED).
    - Every instance carries ``request.instance_name`` (prefix ``dtrun-<job>-``) from creation, so a
      crash between "created" and "recorded" is caught by ``list_owned``; and ``request.owner``
      where the provider can keep it, reported back as ``OwnedInstance.owner``.
    - Errors are the hierarchy in ``providers.errors``; only ``Transient`` is retried.
    """

    name: str = ""

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def offers(self, req: Requirements) -> list[Offer]:
        """Offers that could serve ``req`` (capabilities already checked; empty if none)."""

    @abstractmethod
    def launch(self, request: LaunchRequest) -> Handle: ...

    @abstractmethod
    def poll(self, handle: Handle) -> NodeState: ...

    @abstractmethod
    def terminate(self, handle: Handle) -> None: ...

    @abstractmethod
    def list_owned(self, prefix: str = NAME_PREFIX) -> list[OwnedInstance]:
        """Live (not yet gone) instances whose name starts with ``prefix``."""

    def logs(self, handle: Handle, tail: int = 200) -> str:
        return ""

    def end_reason(self, handle: Handle) -> str | None:
        """Why a finished instance ended, in the provider's words, when it says more than the
        state does (Modal: evicted, OOM-killed, timed out). Default: None."""
        return None

    def check_credentials(self) -> None:
        """Raise AuthError naming what to set if credentials are missing. Default: none needed."""

    def cancel_launch(self, name: str) -> None:
        """The launch of instance ``name`` running in another thread is cancelled: if it has not
        created anything yet, it should create nothing (Modal: the create after the image build
        is skipped). Must not block. Default: nothing (the controller finds what the launch
        created by name through ``list_owned`` and terminates it)."""

    def close(self) -> None:
        """The controller using this provider is exiting: release what this process started
        for it (SkyPilot: the local API server, if dtrun started it). Default: nothing."""

    def refuse(self, req: Requirements) -> str | None:
        return self.capabilities().refuse(req, self.name)

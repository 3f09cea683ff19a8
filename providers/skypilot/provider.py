"""RunPod, Lambda and Vast through SkyPilot (0.14.1).

One attempt = one SkyPilot cluster named ``request.instance_name`` (``dtrun-<job>-a<N>``):

* **Task** (:func:`build_task_config`): ``setup`` (``infra/node_setup.py``) installs only what
  the node lacks, then the project (synced as ``workdir``) with --no-deps; RunPod/Vast nodes run
  ``request.image`` (``image_id: docker:<image>``: Python and the pinned torch preinstalled),
  ``run`` is the node bootstrap (it echoes ``DTRUN_EXIT_CODE=<rc>`` as its last line so a FAILED
  job can still be told apart from a clean "resume me" exit 75/76), ``envs`` = the request's env
  plus ``DTRUN_DEADLINE``, ``resources = {accelerators: "H100:8", use_spot, infra:
  "<cloud>[/<region>]"}``, ``num_nodes``, ``secrets`` = the request's secrets (the AWS keys for an
  ``s3://`` run URI; SkyPilot redacts task secrets wherever it logs or stores the task; dtrun
  keeps the task dict in memory only). Every generated task is validated with SkyPilot's own
  ``sky.Task.from_yaml_config`` (``dtrun export --skypilot`` prints the same dict).
* **Launch**: ``sky.launch(..., down=True, idle_minutes_to_autostop=N)`` — the cluster removes
  itself N minutes after its job ends, with or without a controller; the node bootstrap's
  watchdog enforces the hard deadline and the budget (SkyPilot has no provider-side timeout).
  ``launch`` blocks until SkyPilot has submitted the job (provisioning takes minutes).
* **Poll**: ``sky.status(refresh)`` then the job queue. Cluster UP → the job's status (PENDING /
  RUNNING / SUCCEEDED / FAILED, with exit 75/76 → PREEMPTED); cluster gone, STOPPED, or back in
  INIT after it was up → PREEMPTED, unless dtrun took it down (TERMINATED) or its job had
  already ended (that outcome: ``down=True`` removes clusters after their job). The last job
  status seen is remembered in ``$DTRUN_HOME/skypilot/clusters.json`` for other processes.
* **Terminate**: ``sky.down``; a cluster that does not exist is fine; confirmed by status.
* **list_owned**: clusters of this cloud whose name starts with the prefix.

Every SDK call goes through :class:`providers.skypilot.api.SkyAPI` (tests pass a recorded fake).
Credentials are checked from each cloud's standard place before anything is rented; the
message names what to set and never contains a secret.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from providers import errors as perr
from providers._jsonstore import dtrun_home, locked_json
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
from providers.skypilot import credentials
from providers.skypilot.api import ClusterRecord, JobRecord, SkyAPI

DEFAULT_IDLE_MINUTES = 3
EXIT_MARKER = "DTRUN_EXIT_CODE="
_EXIT_RE = re.compile(r"DTRUN_EXIT_CODE=(-?\d+)")

# dtrun GPU → SkyPilot accelerator name per cloud, where it is not the same name. A variant a
# cloud names by instance type only (Lambda/Vast H100) also needs the offer's instance type.
SKY_ACCELERATORS: dict[str, dict[str, str]] = {
    "runpod": {"H100-PCIe": "H100", "H100-SXM": "H100-SXM"},
    "lambda": {"H100-PCIe": "H100", "H100-SXM": "H100"},
    "vast": {"H100-PCIe": "H100", "H100-SXM": "H100", "A100-80GB": "A100"},
}
_RUNPOD_TYPE = re.compile(r"^\d+x_(.+)_(SECURE|COMMUNITY)$")


def sky_accelerator(cloud: str, gpu: str, instance_type: str | None = None) -> str:
    """SkyPilot's accelerator name for dtrun's ``gpu`` on ``cloud`` (RunPod's instance types
    spell it: ``8x_H100-SXM_SECURE`` → ``H100-SXM``)."""
    if cloud == "runpod" and instance_type:
        m = _RUNPOD_TYPE.match(instance_type)
        if m:
            return m.group(1)
    return SKY_ACCELERATORS.get(cloud, {}).get(gpu, gpu)


@dataclass(frozen=True)
class CloudInfo:
    name: str
    sky_name: str
    capabilities: Capabilities
    credential_file: str
    """The one file SkyPilot reads this cloud's key from (``providers.skypilot.credentials``)."""


CLOUDS: dict[str, CloudInfo] = {
    "runpod": CloudInfo(
        "runpod", "runpod",
        Capabilities(
            spot=Capability(True, "interruptible pods (RunPod dropped spot from its docs in May 2026: may not be sold)"),
            multi_node=Capability(False, "SkyPilot: multi-node is not supported on RunPod (no interconnect between pods)"),
            max_gpus_per_node=8,
        ),
        credentials.RUNPOD_FILE,
    ),
    "lambda": CloudInfo(
        "lambda", "lambda",
        Capabilities(
            spot=Capability(False, "Lambda sells no spot/interruptible capacity"),
            multi_node=Capability(True),
            max_gpus_per_node=8,
        ),
        credentials.LAMBDA_FILE,
    ),
    "vast": CloudInfo(
        "vast", "vast",
        Capabilities(
            spot=Capability(True, "interruptible bids: outbid → stopped with no notice"),
            multi_node=Capability(False, "SkyPilot: multi-node is not supported on Vast"),
            max_gpus_per_node=8,
        ),
        credentials.VAST_FILE,
    ),
}


# ---- the task ------------------------------------------------------------------------------------

def run_script(command: list[str]) -> str:
    """The task's run: the node bootstrap, then its exit code on the last line of the job log."""
    return (f"{shlex.join(command)}\n"
            f"rc=$?\n"
            f'echo "{EXIT_MARKER}$rc"\n'
            f"exit $rc\n")


SAVED_LOG_LINES = 500
SAVED_LOG_CHARS = 200_000
"""How much of a job log :meth:`SkyPilotProvider.terminate` keeps for ``dtrun logs`` after the cluster is gone."""
SETUP = "python infra/node_setup.py"
"""Installs only what the node is missing (torch checked against the pin, then the other
dependencies), then dtrun with --no-deps: seconds on a prebuilt image, minutes on a bare one."""
IMAGE_CLOUDS = ("runpod", "vast")
"""Clouds whose nodes are containers: ``request.image`` becomes ``image_id: docker:<image>``.
Lambda runs VMs (its Lambda Stack image ships PyTorch); the setup step checks it."""


def task_resources(cloud: str, offer: Offer) -> dict[str, Any]:
    """The task's ``resources``: the offer's accelerator (and instance type, which pins the
    variant), spot or not, and where: ``infra: <cloud>`` lets SkyPilot fail over across every
    region that sells it; ``offer.regions`` (a spec's ``resources.regions``) become ``ordered``
    candidates, cheapest first — one launch tries them all (SkyPilot's own failover)."""
    accel = sky_accelerator(cloud, offer.gpu, offer.instance_type)
    res: dict[str, Any] = {"accelerators": f"{accel}:{offer.gpus_per_node}", "use_spot": bool(offer.spot)}
    if offer.instance_type:
        res["instance_type"] = offer.instance_type
    sky = CLOUDS[cloud].sky_name
    regions = list(offer.regions)
    if not regions and offer.region and offer.region not in ("any", ""):
        regions = [offer.region]
    if len(regions) > 1:
        res["ordered"] = [{"infra": f"{sky}/{r}"} for r in regions]
    elif regions:
        res["infra"] = f"{sky}/{regions[0]}"
    else:
        res["infra"] = sky
    return res


def build_task_config(cloud: str, request: LaunchRequest) -> dict[str, Any]:
    """The SkyPilot task dict for one attempt (what ``sky launch`` would read from YAML)."""
    offer = request.offer
    envs = {k: str(v) for k, v in request.env.items()}
    if request.deadline is not None:
        envs.setdefault("DTRUN_DEADLINE", str(int(request.deadline)))
    envs.setdefault("DTRUN_JOB", request.job)
    envs.setdefault("DTRUN_ATTEMPT", str(request.attempt))
    envs.setdefault("DTRUN_NNODES", str(request.nodes))
    cfg: dict[str, Any] = {
        "name": request.instance_name,
        "resources": task_resources(cloud, offer),
        "num_nodes": request.nodes,
        "envs": envs,
        "run": run_script(request.command),
    }
    if request.image and cloud in IMAGE_CLOUDS:
        cfg["resources"]["image_id"] = f"docker:{request.image}"
    if request.workdir:
        cfg["workdir"] = request.workdir
        cfg["setup"] = SETUP
    if request.secrets:
        # SkyPilot's task ``secrets``: set in the node's environment like ``envs``, but redacted
        # in SkyPilot's logs, its cluster records and every YAML it writes.
        cfg["secrets"] = {k: str(v) for k, v in request.secrets.items()}
    if cloud == "vast" and offer.spot and offer.spot_bid:
        # SkyPilot 0.14.1 bids Vast's `min_bid` of the offer its launch search finds, and that
        # search's chunking floors every min_bid to 0 (vastai.utils): it would bid $0. dtrun's
        # quote is the live bid it fetched (providers.skypilot.fetch); SkyPilot places it through
        # the task-level `vast.create_instance_kwargs.price` (USD per instance-hour).
        cfg["config"] = {"vast": {"create_instance_kwargs": {
            "price": round(offer.spot_bid * offer.gpus_per_node, 4)}}}
    return cfg


# ---- errors --------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
MAX_MESSAGE = 3000

# SkyPilot's exception classes (``sky.exceptions``, 0.14.1) → dtrun's error, checked in order
# (subclasses before their bases). A test asserts every name exists in SkyPilot, so a rename
# there fails here instead of silently falling through to a generic error.
ERROR_TABLE: tuple[tuple[str, type[perr.ProviderError]], ...] = (
    ("NoCloudAccessError", perr.AuthError),                 # no cloud enabled at all
    ("InvalidCloudCredentials", perr.AuthError),
    ("CloudUserIdentityError", perr.AuthError),
    ("ClusterOwnerIdentityMismatchError", perr.AuthError),
    ("InvalidCloudConfigs", perr.AuthError),
    ("ApiServerAuthenticationError", perr.AuthError),
    ("NoWorkspaceAccessError", perr.AuthError),
    ("PermissionDeniedError", perr.AuthError),
    ("ProvisionUnsupportedError", perr.NotSupported),       # this offer can never be served
    ("NotSupportedError", perr.NotSupported),
    ("ResourcesMismatchError", perr.NotSupported),
    ("InvalidClusterNameError", perr.NotSupported),
    ("UserRequestRejectedByPolicy", perr.NotSupported),
    ("APIVersionMismatchError", perr.NotSupported),
    ("APINotSupportedError", perr.NotSupported),
    ("ApiServerConnectionError", perr.Transient),            # the local API server: retry
    ("ServerTemporarilyUnavailableError", perr.Transient),
    ("RequestInterruptedError", perr.Transient),
    ("RequestCancelled", perr.Transient),
    ("ConcurrentWorkerExhaustedError", perr.Transient),
    ("ExecutionRetryableError", perr.Transient),
    ("CloudError", perr.Transient),                          # a cloud API / catalog fetch fault
    ("NetworkError", perr.Transient),
    ("ClusterStatusFetchingError", perr.Transient),
    ("FetchClusterInfoError", perr.Transient),
    ("SkyletUnavailableError", perr.Transient),
)
# ``requests``/``urllib3``/builtin network faults (by class name: they come through the SDK).
_TRANSIENT_NAMES = {"ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout", "TimeoutError",
                    "ConnectionResetError", "ConnectionRefusedError", "ChunkedEncodingError"}
_QUOTA_RE = re.compile(r"quota|limit exceeded|insufficient (funds|balance|credit)|spend(ing)? limit|"
                       r"balance|not enough (funds|credit)", re.I)
_AUTH_RE = re.compile(r"credential|unauthori[sz]ed|forbidden|api key|\b401\b|\b403\b", re.I)
_NOT_ENABLED_RE = re.compile(r"which (is|are) not enabled|sky check", re.I)
HALF_DEAD = ("SkyPilot's local API server did not answer or could not start (a half-dead server: "
             "a leftover process on its port or executors still running). Run `sky api stop` (then, "
             "if `sky api status` still shows one, end the leftover `sky.server` processes) and "
             "retry; its log: ~/.sky/api_server/server.log")


def clean(text: str) -> str:
    """ANSI colour codes and SkyPilot's payload markers stripped, whitespace trimmed."""
    text = _ANSI.sub("", text or "")
    text = re.sub(r"<sky-payload>.*?</sky-payload>", "", text, flags=re.S)
    return text.strip()


def _sky_exceptions() -> Any:
    try:
        from sky import exceptions
    except ImportError:  # pragma: no cover - the skypilot extra is part of the install
        return None
    return exceptions


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def _is(e: BaseException, name: str) -> bool:
    return name in _names(e)


def _classify(e: BaseException) -> type[perr.ProviderError] | None:
    exc = _sky_exceptions()
    for name, target in ERROR_TABLE:
        cls = getattr(exc, name, None) if exc is not None else None
        if (cls is not None and isinstance(e, cls)) or (cls is None and _is(e, name)):
            return target
    return None


def _unavailable(e: BaseException, provider: str, msg: str) -> perr.ProviderError:
    """``ResourcesUnavailableError``: what SkyPilot's failover over the allowed regions found."""
    text = clean(str(e))
    if _NOT_ENABLED_RE.search(text):
        # SkyPilot's check for this cloud failed (missing or rejected key): not capacity.
        why = credentials.problem(provider) if provider in credentials.FILES else None
        fix = credentials.message(provider, why or "SkyPilot reports the cloud as not enabled (its "
                                  "credential check failed: the key may be wrong or revoked)")
        return perr.AuthError(f"{fix} (SkyPilot: {text.splitlines()[0]})", provider=provider)
    history = list(getattr(e, "failover_history", None) or [])
    if history and all(_is(h, "ProvisionUnsupportedError") for h in history):
        return perr.NotSupported(msg, provider=provider)
    reasons = [clean(str(h)) for h in history] or [text]
    if reasons and all(_QUOTA_RE.search(r) for r in reasons):
        return perr.QuotaExceeded(msg, provider=provider)
    return perr.NoCapacity(msg, provider=provider)


def map_sky_error(e: BaseException, provider: str) -> perr.ProviderError:
    """SkyPilot's exception → dtrun's provider error, keeping every region's reason (ANSI
    stripped, at most ``MAX_MESSAGE`` characters)."""
    if isinstance(e, perr.ProviderError):
        return e
    text = clean(str(e))
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + " …"
    msg = f"{provider} (SkyPilot): {type(e).__name__}" + (f": {text}" if text else "")
    if _is(e, "ResourcesUnavailableError"):
        return _unavailable(e, provider, msg)
    if _is(e, "NoCloudAccessError") and provider in credentials.FILES:
        why = credentials.problem(provider) or "SkyPilot has no cloud enabled"
        return perr.AuthError(f"{credentials.message(provider, why)} (SkyPilot: {text})", provider=provider)
    if _is(e, "ProvisionPrechecksError"):
        reasons = getattr(e, "reasons", []) or []
        if any(_classify(r) is perr.AuthError or _AUTH_RE.search(str(r)) for r in reasons):
            return perr.AuthError(msg + "".join(f"; {clean(str(r))}" for r in reasons), provider=provider)
        return perr.NotSupported(msg + "".join(f"; {clean(str(r))}" for r in reasons), provider=provider)
    target = _classify(e)
    if target is not None:
        return target(msg, provider=provider)
    if _names(e) & _TRANSIENT_NAMES:
        return perr.Transient(msg, provider=provider)
    if isinstance(e, RuntimeError) and "API server" in text:
        return perr.Transient(f"{provider} (SkyPilot): {HALF_DEAD} ({text.splitlines()[0]})", provider=provider)
    if isinstance(e, ValueError) and re.search(r"Invalid (region|zone|instance type)", text):
        return perr.NotSupported(msg, provider=provider)  # SkyPilot's optimizer rejected a name
    if _QUOTA_RE.search(text):
        return perr.QuotaExceeded(msg, provider=provider)
    return perr.ProviderError(msg, provider=provider)


# ---- the provider --------------------------------------------------------------------------------

_JOB_STATE = {
    "INIT": NodeState.PENDING, "PENDING": NodeState.PENDING, "SETTING_UP": NodeState.PENDING,
    "RUNNING": NodeState.RUNNING, "SUCCEEDED": NodeState.SUCCEEDED,
    "FAILED": NodeState.FAILED, "FAILED_SETUP": NodeState.FAILED, "FAILED_DRIVER": NodeState.FAILED,
    "CANCELLED": NodeState.TERMINATED,
}
"""Every ``sky.skylet.job_lib.JobStatus`` → the node's state (a test checks the enum is covered)."""
CLUSTER_STATES = ("INIT", "UP", "STOPPED", "AUTOSTOPPING", "PENDING")
"""Every ``sky.utils.status_lib.ClusterStatus`` :meth:`SkyPilotProvider.poll` handles: UP and
AUTOSTOPPING → the job's status; PENDING, and INIT before the cluster was ever up → PENDING;
STOPPED, INIT after being up, or gone → PREEMPTED unless dtrun took it down (TERMINATED) or its
job had already ended (that outcome)."""


class SkyPilotProvider(Provider):
    """One SkyPilot cloud (runpod, lambda or vast) as a dtrun provider."""

    def __init__(self, cloud: str, api: SkyAPI | None = None, *, idle_minutes: int = DEFAULT_IDLE_MINUTES,
                 home: str | os.PathLike[str] | None = None) -> None:
        if cloud not in CLOUDS:
            raise ValueError(f"unknown SkyPilot cloud {cloud!r}; known: {', '.join(CLOUDS)}")
        self.cloud = cloud
        self.name = cloud
        self.info = CLOUDS[cloud]
        self.api = api if api is not None else SkyAPI()
        self.idle_minutes = idle_minutes
        self._home = Path(home) if home is not None else None

    # ---- remembered cluster facts (other processes see them too) ---------------------------------
    @property
    def _memo_path(self) -> Path:
        return (self._home or dtrun_home()) / "skypilot" / "clusters.json"

    def _memo(self, cluster: str, **update: Any) -> dict[str, Any]:
        with locked_json(self._memo_path) as data:
            rec = data.setdefault(cluster, {})
            rec.update(update)
            return dict(rec)

    # ---- interface ---------------------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return self.info.capabilities

    def check_credentials(self) -> None:
        """SkyPilot's own offline check for this cloud (``credentials``): the file it reads the
        key from, never a variable it does not read. AuthError names the file and the fix."""
        why = credentials.problem(self.cloud)
        if why is not None:
            raise perr.AuthError(credentials.message(self.cloud, why), provider=self.cloud)

    def refuse(self, req: Requirements) -> str | None:
        why = super().refuse(req)
        if why is None and req.regions:
            from providers.catalog import region_problem

            why = region_problem(self.cloud, req.regions)
        return why

    def offers(self, req: Requirements) -> list[Offer]:
        if self.refuse(req) is not None:
            return []
        from providers.catalog import catalog_offers

        spot_ok = self.info.capabilities.spot.supported
        return [o for o in catalog_offers(self.cloud, req)
                if o.provider == self.cloud and (spot_ok or not o.spot)
                and (req.max_price_per_gpu_hour is None or o.price_per_gpu_hour <= req.max_price_per_gpu_hour)]

    def close(self) -> None:
        """The controller is done with SkyPilot: stop the local API server if dtrun started it."""
        close = getattr(self.api, "close", None)
        if close is not None:
            close()

    def task_config(self, request: LaunchRequest) -> dict[str, Any]:
        """The validated task dict for ``request`` (raises NotSupported if SkyPilot rejects it)."""
        from providers.skypilot.api import task_from_config

        cfg = build_task_config(self.cloud, request)
        try:
            task_from_config(cfg)
        except Exception as e:  # SkyPilot's validation raises ValueError/SchemaError subclasses
            raise perr.NotSupported(f"{self.cloud}: SkyPilot rejected the task: {e}", provider=self.cloud) from None
        return cfg

    def launch(self, request: LaunchRequest) -> Handle:
        offer = request.offer
        req = Requirements(gpu=offer.gpu, gpus_per_node=offer.gpus_per_node, nodes=request.nodes,
                           spot=offer.spot)
        reason = self.refuse(req)
        if reason:
            raise perr.NotSupported(reason, provider=self.cloud)
        self.check_credentials()
        cfg = self.task_config(request)
        cluster = request.instance_name
        self._memo(cluster, cloud=self.cloud, job_state=None, terminated=False, ever_up=False)
        started = time.time()  # billing may start as soon as the request is sent
        try:
            job_id = self.api.launch(cfg, cluster, self.idle_minutes)
        except Exception as e:
            raise map_sky_error(e, self.cloud) from None
        self._memo(cluster, job_id=job_id, ever_up=True)
        data: dict[str, Any] = {"cluster": cluster, "job_id": job_id, "cloud": self.cloud}
        from providers.skypilot import api as sky_api

        with sky_api._PRICES_LOCK:
            launched = sky_api.LAUNCHED_PRICES.pop(cluster, None)
        if launched is not None:
            data["launched_price_per_hour"] = round(launched, 6)  # what SkyPilot says it rented
        return Handle(provider=self.cloud, name=cluster, instance_id=cluster, region=offer.region,
                      launched_at=started, data=data)

    def poll(self, handle: Handle) -> NodeState:
        cluster = handle.data.get("cluster", handle.instance_id)
        try:
            recs = [r for r in self.api.status([cluster], refresh=True) if r.name == cluster]
        except Exception as e:
            if _is(e, "ClusterDoesNotExist"):
                recs = []
            else:
                raise map_sky_error(e, self.cloud) from None
        memo = self._memo(cluster)
        if not recs:
            return self._gone_state(memo)
        rec = recs[0]
        if rec.status in ("UP", "AUTOSTOPPING"):
            # AUTOSTOPPING: the job ended and the cluster is taking itself down (down=True):
            # the job's own status says how it ended.
            self._memo(cluster, ever_up=True)
            return self._job_state(cluster, handle.data.get("job_id"), memo)
        if rec.status == "PENDING" or (rec.status == "INIT" and not (rec.ever_up or memo.get("ever_up"))):
            return NodeState.PENDING  # waiting to be scheduled / provisioning
        if memo.get("terminated"):
            return NodeState.TERMINATED
        # STOPPED, or INIT after being up (a node was lost): preempted, unless the job had ended.
        return self._gone_state(memo)

    def _gone_state(self, memo: dict[str, Any]) -> NodeState:
        done = memo.get("job_state")
        if done in (NodeState.SUCCEEDED.value, NodeState.FAILED.value, NodeState.PREEMPTED.value):
            return NodeState(done)
        if memo.get("terminated"):
            return NodeState.TERMINATED
        return NodeState.PREEMPTED

    def _job_state(self, cluster: str, job_id: int | None, memo: dict[str, Any]) -> NodeState:
        try:
            jobs = self.api.queue(cluster)
        except Exception as e:
            if _is(e, "ClusterDoesNotExist") or _is(e, "ClusterNotUpError"):
                return self._gone_state(memo)
            raise map_sky_error(e, self.cloud) from None
        mine = [j for j in jobs if job_id is None or j.job_id == job_id]
        if not mine:
            return NodeState.PENDING
        job = max(mine, key=lambda j: j.job_id)
        state = _JOB_STATE.get(job.status, NodeState.PENDING)
        if state is NodeState.FAILED:
            code = self._exit_code(cluster, job.job_id)
            if code in PREEMPT_EXIT_CODES:
                state = NodeState.PREEMPTED
        if memo.get("terminated") and not state.is_terminal:
            state = NodeState.TERMINATED
        if state.is_terminal:
            self._memo(cluster, job_state=state.value)
        return state

    def _exit_code(self, cluster: str, job_id: int | None) -> int | None:
        try:
            text = self.api.tail(cluster, job_id, 50)
        except Exception:  # logs are a hint only; the cluster may be going away
            return None
        codes = _EXIT_RE.findall(text or "")
        return int(codes[-1]) if codes else None

    def terminate(self, handle: Handle) -> None:
        cluster = handle.data.get("cluster", handle.instance_id)
        self._memo(cluster, terminated=True)
        self._save_log(cluster, handle.data.get("job_id"))
        try:
            self.api.down(cluster)
        except Exception as e:
            if _is(e, "ClusterDoesNotExist"):
                return  # already gone: not an error
            err = map_sky_error(e, self.cloud)
            if type(err) is perr.ProviderError:  # e.g. RuntimeError "failed to tear down": try again
                raise perr.TerminateNotConfirmed(str(err), provider=self.cloud) from None
            raise err from None
        try:
            still = [r for r in self.api.status([cluster], refresh=False) if r.name == cluster]
        except Exception as e:
            if _is(e, "ClusterDoesNotExist"):
                return
            raise map_sky_error(e, self.cloud) from None
        if still:
            raise perr.TerminateNotConfirmed(f"{cluster}: sky.down returned but the cluster is still "
                                             f"listed ({still[0].status})", provider=self.cloud)

    def list_owned(self, prefix: str = NAME_PREFIX) -> list[OwnedInstance]:
        try:
            recs = self.api.status(None, refresh=True)
        except Exception as e:
            raise map_sky_error(e, self.cloud) from None
        out = []
        for r in recs:
            if not r.name.startswith(prefix) or (r.cloud and r.cloud != self.cloud):
                continue
            if not r.cloud:  # unknown cloud: ours only if we launched it from here
                with locked_json(self._memo_path) as data:
                    if data.get(r.name, {}).get("cloud") != self.cloud:
                        continue
            state = {"UP": NodeState.RUNNING, "AUTOSTOPPING": NodeState.RUNNING, "INIT": NodeState.PENDING,
                     "PENDING": NodeState.PENDING}.get(r.status, NodeState.PREEMPTED)
            out.append(OwnedInstance(r.name, r.name, state, "", r.launched_at))
        return out

    def _save_log(self, cluster: str, job_id: int | None) -> None:
        """Keep the job log's tail before the cluster goes: the log lives only on the node, so
        after ``sky.down`` (or autodown) ``dtrun logs`` would have nothing to show."""
        try:
            text = self.api.tail(cluster, job_id, SAVED_LOG_LINES)
        except Exception:  # already gone (preempted): nothing to save
            return
        if text:
            self._memo(cluster, log_tail=text[-SAVED_LOG_CHARS:])

    def logs(self, handle: Handle, tail: int = 200) -> str:
        cluster = handle.data.get("cluster", handle.instance_id)
        err = None
        try:
            text = self.api.tail(cluster, handle.data.get("job_id"), tail)
        except Exception as e:
            text, err = "", e
        if text:
            return text
        saved = self._memo(cluster).get("log_tail")
        if saved:
            return "\n".join(saved.splitlines()[-tail:]) + "\n(saved when dtrun took the cluster down)\n"
        return text if err is None else f"(logs unavailable: {map_sky_error(err, self.cloud)})"


__all__ = ["SkyPilotProvider", "SkyAPI", "ClusterRecord", "JobRecord", "build_task_config", "map_sky_error",
           "CLOUDS", "run_script", "task_resources", "sky_accelerator", "ERROR_TABLE", "CLUSTER_STATES"]

"""The SkyPilot provider: one cloud (RunPod, Lambda or Vast) as a dtrun provider.

One attempt = one SkyPilot cluster named ``request.instance_name``. ``launch`` validates the
task (``providers.skypilot.task``) with SkyPilot itself and calls ``sky.launch(down=True)``;
``poll`` maps the cluster's and then its job's status to a :class:`NodeState`; ``terminate``
takes the cluster down and confirms it is gone; ``list_owned`` lists this cloud's clusters by
name prefix. Facts that outlive this process (the last job status seen, whether dtrun took the
cluster down, the job log's tail) go to ``$DTRUN_HOME/skypilot/clusters.json``.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from providers import errors as perr
from providers._jsonstore import dtrun_home, locked_json
from providers.base import (
    PREEMPT_EXIT_CODES,
    NAME_PREFIX,
    Capabilities,
    Handle,
    LaunchRequest,
    NodeState,
    Offer,
    OwnedInstance,
    Provider,
    Requirements,
)
from providers.skypilot import api as sky_api
from providers.skypilot import catalog, credentials, runpodcheck, vastcheck
from providers.skypilot.api import SkyAPI
from providers.skypilot.clouds import CLOUDS
from providers.skypilot.errors import is_named, map_sky_error
from providers.skypilot.task import EXIT_RE, build_task_config

log = logging.getLogger("dtrun.providers.skypilot")
DEFAULT_IDLE_MINUTES = 3
SSH_UNREACHABLE = 255
"""ssh's exit status when it cannot reach the node (what SkyPilot's CommandError then carries)."""
SAVED_LOG_LINES = 500
SAVED_LOG_CHARS = 200_000
"""How much of a job log :meth:`SkyPilotProvider.terminate` keeps for ``dtrun logs`` after the cluster is gone."""

JOB_STATES = {
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
            why = catalog.region_problem(self.cloud, req.regions)
        return why

    def offers(self, req: Requirements) -> list[Offer]:
        if self.refuse(req) is not None:
            return []
        spot_ok = self.info.capabilities.spot.supported
        return [o for o in catalog.catalog_offers(self.cloud, req)
                if o.provider == self.cloud and (spot_ok or not o.spot)
                and (req.max_price_per_gpu_hour is None or o.price_per_gpu_hour <= req.max_price_per_gpu_hour)]

    def close(self) -> None:
        """The controller is done with SkyPilot: stop the local API server if dtrun started it."""
        close = getattr(self.api, "close", None)
        if close is not None:
            close()

    def task_config(self, request: LaunchRequest) -> dict[str, Any]:
        """The validated task dict for ``request`` (raises NotSupported if SkyPilot rejects it)."""
        cfg = build_task_config(self.cloud, request)
        try:
            sky_api.task_from_config(cfg)
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
        self._memo(cluster, cloud=self.cloud, job_state=None, terminated=False, ever_up=False, owner=request.owner)
        started = time.time()  # billing may start as soon as the request is sent
        try:
            job_id = self.api.launch(cfg, cluster, self.idle_minutes)
        except Exception as e:
            raise map_sky_error(e, self.cloud) from None
        with sky_api._PRICES_LOCK:
            launched = sky_api.LAUNCHED_PRICES.pop(cluster, None)
            on_cloud = sky_api.LAUNCHED_NAMES.get(cluster)
        self._memo(cluster, job_id=job_id, ever_up=True, name_on_cloud=on_cloud)
        data: dict[str, Any] = {"cluster": cluster, "job_id": job_id, "cloud": self.cloud}
        if launched is not None:
            data["launched_price_per_hour"] = round(launched, 6)  # what SkyPilot says it rented
        if self.cloud == "vast":
            data["vast_check"] = self._check_vast(cluster, offer)
        return Handle(provider=self.cloud, name=cluster, instance_id=cluster, region=offer.region,
                      launched_at=started, data=data)

    def _check_vast(self, cluster: str, offer: Offer) -> str:
        """SkyPilot 0.14.1's Vast search drops its filters (:mod:`providers.skypilot.vastcheck`):
        the instance it rented is read back; not the offer's GPU, count or kind (bid/on-demand) →
        destroyed at once and the offer refused. Returns what was checked, for the handle."""
        look = getattr(self.api, "vast_instance", None)
        if look is None:
            return "unverified: this SkyPilot seam cannot read Vast instances"
        try:
            row = look(cluster)
        except Exception as e:  # noqa: BLE001 - a read-back fault must not fail a launch that worked
            return f"unverified: reading the instance back failed ({type(e).__name__})"
        if row is None:
            return "unverified: the instance is not listed"
        why = vastcheck.mismatch(row, offer)
        if why is None:
            return f"ok: {row.get('num_gpus')}x {row.get('gpu_name')}, {'bid' if row.get('is_bid') else 'on-demand'}"
        try:
            self.api.down(cluster)
        except Exception as e:
            raise map_sky_error(e, self.cloud) from None
        self._memo(cluster, terminated=True)
        raise perr.NotSupported(
            f"vast: SkyPilot 0.14.1 rented {why} for {offer.gpus_per_node}x {offer.gpu} "
            f"({offer.instance_type or 'no instance type'}, {'spot' if offer.spot else 'on-demand'}): its Vast "
            f"offer search sends no GPU filter (the vastai SDK drops quoted values) and rents the market's top "
            f"offer, unless its API server loads dtrun's search plugin (one dtrun starts does: `sky api stop` a "
            f"server of your own); dtrun destroyed instance {row.get('id')} at once", provider=self.cloud)

    def poll(self, handle: Handle) -> NodeState:
        cluster = handle.data.get("cluster", handle.instance_id)
        try:
            recs = [r for r in self.api.status([cluster], refresh=True) if r.name == cluster]
        except Exception as e:
            if is_named(e, "ClusterDoesNotExist"):
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
            if is_named(e, "ClusterDoesNotExist") or is_named(e, "ClusterNotUpError"):
                return self._gone_state(memo)
            if is_named(e, "CommandError") and getattr(e, "returncode", None) == SSH_UNREACHABLE:
                # The cluster is UP to SkyPilot but its node does not answer SSH. On RunPod an
                # interruptible pod taken back is EXITED, which 0.14.1's status query cannot map
                # (KeyError): the refresh fails and keeps the record UP (seen on the RunPod lab).
                # dtrun asks RunPod for the pod (:mod:`providers.skypilot.runpodcheck`): EXITED or
                # gone is a preemption now. Elsewhere, or when RunPod cannot say, RUNNING (the last
                # state known) lets the heartbeat bound end it: failing every poll would hide the
                # attempt from the heartbeat check forever.
                if self.cloud == "runpod" and self._runpod_taken_back(memo):
                    return self._gone_state(memo)
                return NodeState.RUNNING
            raise map_sky_error(e, self.cloud) from None
        mine = [j for j in jobs if job_id is None or j.job_id == job_id]
        if not mine:
            return NodeState.PENDING
        job = max(mine, key=lambda j: j.job_id)
        state = JOB_STATES.get(job.status, NodeState.PENDING)
        if state is NodeState.FAILED:
            code = self._exit_code(cluster, job.job_id)
            if code in PREEMPT_EXIT_CODES:
                state = NodeState.PREEMPTED
        if memo.get("terminated") and not state.is_terminal:
            state = NodeState.TERMINATED
        if state.is_terminal:
            self._memo(cluster, job_state=state.value)
        return state

    def _runpod_taken_back(self, memo: dict[str, Any]) -> bool:
        look = getattr(self.api, "runpod_pod", None)
        on_cloud = memo.get("name_on_cloud")
        if look is None or not on_cloud:
            return False
        try:
            why = runpodcheck.taken_back(look(on_cloud))
        except Exception as e:  # noqa: BLE001 - RunPod not answering: the heartbeat bound decides
            log.info("runpod: could not ask RunPod for %s-head (%s); the heartbeat bound decides", on_cloud,
                     type(e).__name__)
            return False
        if why:
            log.info("runpod: %s (%s-head): preempted", why, on_cloud)
        return why is not None

    def _exit_code(self, cluster: str, job_id: int | None) -> int | None:
        try:
            text = self.api.tail(cluster, job_id, 50)
        except Exception:  # logs are a hint only; the cluster may be going away
            return None
        codes = EXIT_RE.findall(text or "")
        return int(codes[-1]) if codes else None

    def terminate(self, handle: Handle) -> None:
        cluster = handle.data.get("cluster", handle.instance_id)
        self._memo(cluster, terminated=True)
        self._save_log(cluster, handle.data.get("job_id"))
        try:
            self.api.down(cluster)
        except Exception as e:
            if is_named(e, "ClusterDoesNotExist"):
                return  # already gone: not an error
            err = map_sky_error(e, self.cloud)
            if type(err) is perr.ProviderError:  # e.g. RuntimeError "failed to tear down": try again
                raise perr.TerminateNotConfirmed(str(err), provider=self.cloud) from None
            raise err from None
        try:
            still = [r for r in self.api.status([cluster], refresh=False) if r.name == cluster]
        except Exception as e:
            if is_named(e, "ClusterDoesNotExist"):
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
        with locked_json(self._memo_path) as data:
            memo = {k: dict(v) for k, v in data.items() if isinstance(v, dict)}
        for r in recs:
            if not r.name.startswith(prefix) or (r.cloud and r.cloud != self.cloud):
                continue
            if not r.cloud and memo.get(r.name, {}).get("cloud") != self.cloud:
                continue  # unknown cloud: ours only if we launched it from here
            state = {"UP": NodeState.RUNNING, "AUTOSTOPPING": NodeState.RUNNING, "INIT": NodeState.PENDING,
                     "PENDING": NodeState.PENDING}.get(r.status, NodeState.PREEMPTED)
            # The owner is what this dtrun home's memo kept at launch (SkyPilot keeps no tags on
            # RunPod/Lambda/Vast); a cluster this home never launched has none: not ours.
            out.append(OwnedInstance(r.name, r.name, state, "", r.launched_at, memo.get(r.name, {}).get("owner")))
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

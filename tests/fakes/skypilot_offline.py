"""SkyPilot's own code, offline: real catalog rows, enabled clouds, and an SDK stand-in whose
records are SkyPilot's own classes passed through its client's encode/decode.

* :func:`seed_catalogs` copies ``tests/fakes/data/skypilot_catalogs/v8`` (real rows, dated)
  to ``<HOME>/.sky/catalogs/v8`` — no ``.meta`` directory, so SkyPilot never refreshes them —
  and points SkyPilot's already-imported catalog modules at them.
* :func:`enable_clouds` enables RunPod, Lambda and Vast the way SkyPilot's own tests do
  (``sky.check.get_cached_enabled_clouds_or_refresh`` and ``sky.check.check_capability``).
* :func:`optimize` runs ``sky.optimizer.Optimizer.optimize`` in-process on a task dict.
* :class:`SdkStandIn` replaces ``sky.launch/status/queue/down/tail_logs/get`` (the network
  calls the real ``SkyAPI`` makes — no API server is ever started): status and queue records
  are ``StatusResponse`` / ``ClusterJobRecord`` with a real ``CloudVmRayResourceHandle``,
  encoded by the API server's encoder and decoded by the client's decoder, as over HTTP;
  errors are SkyPilot's exception classes with the messages its code builds.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "skypilot_catalogs" / "v8"
CLOUD_CLASSES = {"runpod": "RunPod", "lambda": "Lambda", "vast": "Vast"}


def seed_catalogs(home: Path, monkeypatch) -> Path:
    """Real catalog rows under ``home/.sky/catalogs/v8``; SkyPilot and dtrun both read them."""
    import sky  # noqa: F401 - SkyPilot's modules below need the package initialised
    from sky.catalog import common as cat_common
    from sky.catalog import lambda_catalog, runpod_catalog, vast_catalog
    from sky.utils import accelerator_registry

    root = home / ".sky" / "catalogs" / "v8"
    shutil.copytree(DATA, root, dirs_exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(root))
    monkeypatch.setattr(cat_common, "_ABSOLUTE_VERSIONED_CATALOG_DIR", str(root))
    # The catalog modules opened their files at import (wherever HOME was then): reopen here.
    for mod, name in ((runpod_catalog, "runpod/vms.csv"), (lambda_catalog, "lambda/vms.csv"),
                      (vast_catalog, "vast/vms.csv")):
        monkeypatch.setattr(mod, "_df", cat_common.read_catalog(name))
    monkeypatch.setattr(accelerator_registry, "_accelerator_df", cat_common.read_catalog("common/accelerators.csv"))
    return root


def enable_clouds(monkeypatch, clouds=("runpod", "lambda", "vast")) -> None:
    """SkyPilot's enabled clouds, as its own tests set them (no credential check, no network)."""
    import sky
    from sky import check as sky_check

    enabled = [getattr(sky.clouds, CLOUD_CLASSES[c])() for c in clouds]
    monkeypatch.setattr(sky_check, "get_cached_enabled_clouds_or_refresh", lambda *a, **k: list(enabled))
    monkeypatch.setattr(sky_check, "check_capability",
                        lambda *a, **k: {"default": [CLOUD_CLASSES[c] for c in clouds]})


def optimize(task_config: dict[str, Any]) -> Any:
    """SkyPilot's optimizer on ``task_config`` (its YAML form): the resources it would launch."""
    import copy

    import sky
    from sky import optimizer

    cfg = copy.deepcopy(task_config)
    cfg.setdefault("run", "true")
    cfg.pop("workdir", None)  # a local path: irrelevant to placement
    task = sky.Task.from_yaml_config(cfg)
    dag = sky.Dag()
    dag.add(task)
    optimizer.Optimizer.optimize(dag, quiet=True)
    return task.best_resources


# ---- SkyPilot's own records and errors --------------------------------------------------------

INSTANCE = {"runpod": ("8x_H100-SXM_SECURE", "H100-SXM", "US"), "lambda": ("gpu_8x_h100_sxm5", "H100", "us-east-1"),
            "vast": ("8x-H100_SXM-32-65536", "H100", "Vietnam, VN, AS")}


def _handle(cluster: str, cloud: str, full: bool = True) -> Any:
    """A real handle; ``full`` (needs the seeded catalogs) with instance type and region."""
    import sky
    from sky.backends import cloud_vm_ray_backend

    it, accel, region = INSTANCE[cloud]
    res = (sky.Resources(infra=f"{cloud}/{region}", accelerators={accel: 8}, instance_type=it) if full
           else sky.Resources(infra=cloud))
    return cloud_vm_ray_backend.CloudVmRayResourceHandle(
        cluster_name=cluster, cluster_name_on_cloud=f"{cluster}-abcd", cluster_yaml=None,
        launched_nodes=1, launched_resources=res)


def over_http(name: str, value: Any) -> Any:
    """What the client gets: the API server's encoder, JSON, the client's decoder."""
    from sky.server.requests.serializers import decoders, encoders

    from sky.server import constants as server_constants

    name = server_constants.REQUEST_NAME_PREFIX + name  # how the server names its requests
    wire = json.loads(json.dumps(encoders.get_encoder(name)(value)))
    return decoders.get_decoder(name)(wire)


def status_record(cluster: str, cloud: str, status: str, ever_up: bool = True, full_handle: bool = True) -> Any:
    from sky.schemas.api import responses
    from sky.utils import status_lib

    return responses.StatusResponse(
        name=cluster, launched_at=int(time.time()), handle=_handle(cluster, cloud, full_handle),
        status=status_lib.ClusterStatus(status), autostop=3, to_down=True, cluster_hash="h",
        cluster_ever_up=ever_up, user_hash="u", user_name="dtrun-test", workspace="default",
        is_managed=False, resources_str=f"1x {CLOUD_CLASSES[cloud]}(H100:8)", nodes=1,
        cloud=CLOUD_CLASSES[cloud], region="US")


def job_record(job_id: int, status: str) -> Any:
    from sky.schemas.api import responses
    from sky.skylet import job_lib

    return responses.ClusterJobRecord(
        job_id=job_id, job_name="dtrun", username="u", user_hash="u", submitted_at=time.time(),
        resources="1x[H100:8]", status=job_lib.JobStatus(status), log_path="~/sky_logs/x")


def multi_region_unavailable(cloud: str = "runpod") -> Exception:
    """The error ``sky.launch`` raises when failover over every allowed region failed, built by
    SkyPilot's own formatting code: per region, its reason (here: quota and insufficient funds)."""
    import sky
    from sky import exceptions
    from sky.backends import cloud_vm_ray_backend as b

    reasons = {"US": "Failed to launch instances: quota exceeded: 8 GPUs requested, limit 4 for this account.",
               "CA": "Insufficient funds: your balance of $3.12 does not cover one hour of this pod."}
    per_region = {}
    history = []
    for region, reason in reasons.items():
        res = sky.Resources(infra=f"{cloud}/{region}", accelerators={"H100-SXM": 8},
                            instance_type="8x_H100-SXM_SECURE")
        msg = b.RetryingVmProvisioner._insufficient_resources_msg(  # pylint: disable=protected-access
            None, res, {res}, None, last_error_reason=reason)
        e = exceptions.ResourcesUnavailableError(msg)
        per_region[res] = e
        history.append(e)
    blocks = b._format_provision_failure_blocks(per_region)  # pylint: disable=protected-access
    return exceptions.ResourcesUnavailableError(
        "\x1b[1m" + b._RESOURCES_UNAVAILABLE_LOG + "\x1b[0m\n" + blocks, failover_history=history)


def cloud_not_enabled(cloud: str = "runpod") -> Exception:
    """The optimizer's own error for a task on a cloud whose credential check failed."""
    import sky
    from sky import exceptions, optimizer

    task = sky.Task.from_yaml_config({"resources": {"infra": cloud, "accelerators": "H100:8"}, "run": "true"})
    dag = sky.Dag()
    dag.add(task)
    try:
        optimizer._check_specified_clouds(dag)  # pylint: disable=protected-access
    except exceptions.ResourcesUnavailableError as e:
        return e
    raise AssertionError("expected SkyPilot to refuse a disabled cloud")


class SdkStandIn:
    """``sky.launch/status/queue/down/tail_logs/get`` for the real ``SkyAPI`` (no server)."""

    def __init__(self, monkeypatch) -> None:
        import sky
        from providers.skypilot import api as sky_api

        self.clusters: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, Any]] = []
        self.errors: dict[str, list[BaseException]] = {}
        self.logs: dict[str, str] = {}
        self._pending: dict[str, tuple[str, Any]] = {}
        self.next_job = 1
        self.hold_launch: Any = None
        """A threading.Event: while set to one, ``sky.get`` of a launch waits for it (provisioning
        in progress: the cluster is listed in INIT meanwhile, as SkyPilot lists it)."""
        monkeypatch.setitem(sky_api._SERVER, "checked", True)  # pylint: disable=protected-access
        for name in ("launch", "status", "queue", "down", "get", "tail_logs"):
            monkeypatch.setattr(sky, name, getattr(self, "_" + name))

    def fail(self, op: str, exc: BaseException) -> None:
        self.errors.setdefault(op, []).append(exc)

    def _req(self, op: str, payload: Any) -> str:
        rid = f"req-{len(self._pending)}"
        self._pending[rid] = (op, payload)
        return rid

    def _launch(self, task, **kw):
        self.calls.append(("launch", {"task": task, **kw}))
        if self.hold_launch is not None:
            res = list(task.resources)[0]
            cloud = str(res.cloud).lower() if res.cloud is not None else "runpod"
            self.clusters[kw["cluster_name"]] = {"cloud": cloud, "status": "INIT", "jobs": {}, "ever_up": False}
        return self._req("launch", (task, kw))

    def _status(self, names, refresh):
        self.calls.append(("status", names))
        return self._req("status", names)

    def _queue(self, name, skip_finished):
        self.calls.append(("queue", name))
        return self._req("queue", name)

    def _down(self, name):
        self.calls.append(("down", name))
        return self._req("down", name)

    def _tail_logs(self, cluster, job_id, follow, tail, output_stream):
        output_stream.write("\n".join(self.logs.get(cluster, "").splitlines()[-tail:]))
        return 0

    def _get(self, rid):
        from sky import exceptions

        op, payload = self._pending.pop(rid)
        if self.errors.get(op):
            raise self.errors[op].pop(0)
        if op == "launch" and self.hold_launch is not None:
            assert self.hold_launch.wait(30.0), "the test never released the launch"
            if payload[1]["cluster_name"] not in self.clusters:  # taken down while provisioning
                raise exceptions.ResourcesUnavailableError(
                    f"Failed to provision {payload[1]['cluster_name']}: the cluster was terminated")
        if op == "launch":
            task, kw = payload
            cluster = kw["cluster_name"]
            (res,) = list(task.resources) if len(task.resources) == 1 else [list(task.resources)[0]]
            cloud = str(res.cloud).lower() if res.cloud is not None else "runpod"
            job = self.next_job
            self.next_job += 1
            self.clusters[cluster] = {"cloud": cloud, "status": "UP", "jobs": {job: "RUNNING"}, "ever_up": True}
            return over_http("launch", (job, _handle(cluster, cloud)))
        if op == "status":
            recs = [status_record(n, c["cloud"], c["status"], c["ever_up"]) for n, c in self.clusters.items()
                    if payload is None or n in payload]
            return over_http("status", recs)
        if op == "queue":
            c = self.clusters.get(payload)
            if c is None:
                raise exceptions.ClusterDoesNotExist(f"Cluster {payload!r} does not exist.")
            return over_http("queue", [job_record(j, s) for j, s in c["jobs"].items()])
        if op == "down":
            if payload not in self.clusters:
                raise exceptions.ClusterDoesNotExist(f"Cluster {payload!r} does not exist.")
            del self.clusters[payload]
            return None
        raise AssertionError(op)

"""The one seam between dtrun and SkyPilot's SDK (skypilot 0.14.1).

Every SkyPilot call dtrun makes goes through :class:`SkyAPI`: each SDK function returns a request
id and ``sky.get(request_id)`` waits for the API server's answer (and re-raises its exception on
this side). The first call starts SkyPilot's local API server — so nothing here runs at import
time, and tests replace the whole class with a recorded fake (``tests/providers``): the adapter's
logic (task building, state mapping, error mapping) is exercised without a server or a cloud.

Records come back as small dataclasses of plain values, never SkyPilot objects, so the adapter
and the fake share one vocabulary.

**The local API server.** Every SDK call needs SkyPilot's API server (8–11 s to start, ~425 MiB,
plus executor processes). Before the first call :meth:`SkyAPI.ensure_server` reuses a healthy
one (the user's: never stopped by dtrun) or starts one with ``sky.api_start()`` — with SkyPilot's
plugins file naming dtrun's Vast search fix (:mod:`providers.skypilot.vastquery`) — and remembers
that dtrun did; :meth:`SkyAPI.close` (the controller's exit) stops only that one, with
``sky.api_stop()``, which kills the server's whole process tree. A server that cannot start
(the half-dead case: a leftover process on its port) becomes one ``RuntimeError`` that says
what to run (``providers.skypilot.errors.HALF_DEAD``).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from providers.skypilot.errors import HALF_DEAD, clean


@dataclass(frozen=True)
class ClusterRecord:
    name: str
    status: str
    """SkyPilot's ClusterStatus value: INIT, UP or STOPPED."""
    cloud: str = ""
    """Lower-case cloud name (runpod, lambda, vast), '' if unknown."""
    launched_at: float | None = None
    ever_up: bool = True


@dataclass(frozen=True)
class JobRecord:
    job_id: int
    status: str
    """SkyPilot's JobStatus value: INIT, PENDING, SETTING_UP, RUNNING, SUCCEEDED, FAILED,
    FAILED_SETUP, FAILED_DRIVER, CANCELLED."""


def task_from_config(config: dict[str, Any]) -> Any:
    """``sky.Task.from_yaml_config(config)``: SkyPilot's own validation of a task dict."""
    import copy

    import sky

    return sky.Task.from_yaml_config(copy.deepcopy(config))  # it pops keys from the dict it gets


def _enum_value(v: Any) -> str:
    return str(getattr(v, "value", v))


def _cloud_of(rec: Any) -> str:
    handle = rec.get("handle") if hasattr(rec, "get") else getattr(rec, "handle", None)
    res = getattr(handle, "launched_resources", None)
    cloud = getattr(res, "cloud", None)
    if cloud is not None:
        return str(cloud).lower()
    text = (rec.get("resources_str") if hasattr(rec, "get") else None) or ""
    for name in ("runpod", "lambda", "vast"):
        if name in text.lower():
            return name
    return ""


def parse_status(records: Any) -> list[ClusterRecord]:
    """``sky.status`` results (the client's decoded ``StatusResponse`` records) → ClusterRecords."""
    return [ClusterRecord(name=r["name"], status=_enum_value(r["status"]), cloud=_cloud_of(r),
                          launched_at=r.get("launched_at"), ever_up=bool(r.get("cluster_ever_up", True)))
            for r in records]


def parse_queue(jobs: Any) -> list[JobRecord]:
    """``sky.queue`` results (decoded ``ClusterJobRecord``s) → JobRecords."""
    return [JobRecord(int(j["job_id"]), _enum_value(j["status"])) for j in jobs]


HALF_DEAD_WAIT_SECONDS = 20.0
"""How long a server process that holds the port may take to answer before it counts as half-dead."""
_SERVER_LOCK = threading.Lock()
_SERVER = {"checked": False, "started_by_dtrun": False}
"""One per process: every SkyAPI (one per cloud) shares the one local server."""


LAUNCHED_PRICES: dict[str, float] = {}
"""cluster → USD per hour of what SkyPilot launched (its ``launched_resources`` priced from the
catalog it launched from: spot or on-demand, region, nodes), for the launch's ``Handle``."""
_PRICES_LOCK = threading.Lock()
LAUNCHED_NAMES: dict[str, str] = {}
"""cluster → SkyPilot's name for it on the cloud (its handle's ``cluster_name_on_cloud``: the
Vast instance is labelled ``<that>-head``), under ``_PRICES_LOCK``."""


def launched_price_per_hour(handle: Any) -> float | None:
    """SkyPilot's own price for a launched cluster handle (None when it cannot say)."""
    try:
        res = handle.launched_resources
        return float(res.get_cost(3600.0)) * int(handle.launched_nodes or 1)
    except Exception:  # noqa: BLE001 — a handle without resources or a catalog miss: no figure
        return None


@contextlib.contextmanager
def _vast_search_plugin() -> Iterator[None]:
    """The environment a local API server dtrun starts gets: SkyPilot's plugins file with dtrun's
    Vast search fix (:mod:`providers.skypilot.vastquery`; the user's plugins kept), for the
    ``Popen`` inside ``sky.api_start`` only."""
    from providers._jsonstore import dtrun_home
    from providers.skypilot import vastquery

    path = vastquery.plugins_config(dtrun_home() / "skypilot" / "plugins.yaml")
    before = os.environ.get(vastquery.PLUGINS_ENV)
    if path is not None:
        os.environ[vastquery.PLUGINS_ENV] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(vastquery.PLUGINS_ENV, None)
        else:
            os.environ[vastquery.PLUGINS_ENV] = before


class SkyAPI:
    """Thin wrapper over ``sky.launch/status/queue/down/tail_logs`` + ``sky.get``.

    Methods raise SkyPilot's own exceptions; the adapter maps them to ``providers.errors``.
    """

    def ensure_server(self) -> None:
        """Reuse a running local API server, or start one (and remember dtrun did)."""
        with _SERVER_LOCK:
            if _SERVER["checked"]:
                return
            from sky.server import common as server_common

            if not server_common.is_api_server_local():
                _SERVER["checked"] = True  # a remote server (the user's `sky api login`)
                return
            if self._healthy(server_common):
                _SERVER["checked"] = True  # the user's, or another dtrun's: reused, never stopped
                return
            import sky
            from sky.client import sdk as sky_sdk

            if sky_sdk._local_api_server_running():  # pylint: disable=protected-access
                # A server process holds the port: one starting up answers within the wait; one
                # that does not is half-dead, and starting another would fail on the port.
                deadline = time.monotonic() + HALF_DEAD_WAIT_SECONDS
                while time.monotonic() < deadline:
                    time.sleep(1.0)
                    if self._healthy(server_common):
                        _SERVER["checked"] = True
                        return
                raise RuntimeError(f"{HALF_DEAD} (a SkyPilot API server process holds the port but has "
                                   f"not answered for {HALF_DEAD_WAIT_SECONDS:.0f} s)")

            try:
                with _vast_search_plugin():
                    sky.api_start()
            except RuntimeError as e:
                raise RuntimeError(f"{HALF_DEAD} (SkyPilot API server: {clean(str(e)).splitlines()[0]})") from None
            _SERVER["checked"] = True
            _SERVER["started_by_dtrun"] = True

    @staticmethod
    def _healthy(server_common: Any) -> bool:
        try:
            server_common.get_api_server_status_response.cache_clear()  # fresh, not a cached miss
        except AttributeError:
            pass
        return server_common.get_api_server_status().status == server_common.ApiServerStatus.HEALTHY

    def close(self) -> None:
        """Stop the local API server if this process started it (idempotent)."""
        with _SERVER_LOCK:
            if not _SERVER["started_by_dtrun"]:
                return
            import sky

            _SERVER["started_by_dtrun"] = False
            _SERVER["checked"] = False
            sky.api_stop()

    def launch(self, config: dict[str, Any], cluster_name: str, idle_minutes: int) -> int | None:
        """Provision the cluster, run setup, submit the run command as a job; returns its job id.

        ``down=True``: the cluster tears itself down ``idle_minutes`` after its job ends.
        Blocks until the job is submitted (provisioning takes minutes)."""
        self.ensure_server()
        import sky

        task = task_from_config(config)
        request_id = sky.launch(task, cluster_name=cluster_name, idle_minutes_to_autostop=idle_minutes,
                                down=True, retry_until_up=False)
        job_id, handle = sky.get(request_id)
        price = launched_price_per_hour(handle)
        with _PRICES_LOCK:
            if price is not None:
                LAUNCHED_PRICES[cluster_name] = price
            on_cloud = getattr(handle, "cluster_name_on_cloud", None)
            if on_cloud:
                LAUNCHED_NAMES[cluster_name] = str(on_cloud)
        return job_id

    def vast_instance(self, cluster_name: str) -> dict[str, Any] | None:
        """The Vast instance SkyPilot rented for ``cluster_name`` (its REST row), None when this
        process did not launch it or no key is readable (:mod:`providers.skypilot.vastcheck`)."""
        from providers.skypilot import credentials, vastcheck

        with _PRICES_LOCK:
            on_cloud = LAUNCHED_NAMES.pop(cluster_name, None)
        key = credentials.read_key("vast")
        if not on_cloud or not key:
            return None
        return vastcheck.instance_row(on_cloud, key)

    def runpod_pod(self, name_on_cloud: str) -> dict[str, Any] | None:
        """RunPod's row for the head pod SkyPilot named ``<name_on_cloud>-head`` (None: not listed);
        raises when no key is readable or RunPod does not answer (:mod:`providers.skypilot.runpodcheck`)."""
        from providers.skypilot import credentials, runpodcheck

        key = credentials.read_key("runpod")
        if not key:
            raise RuntimeError("no RunPod key readable")
        return runpodcheck.head_pod(name_on_cloud, key)

    def status(self, cluster_names: list[str] | None = None, refresh: bool = True) -> list[ClusterRecord]:
        self.ensure_server()
        import sky
        from sky.utils.common import StatusRefreshMode

        mode = StatusRefreshMode.FORCE if refresh else StatusRefreshMode.NONE
        return parse_status(sky.get(sky.status(cluster_names, refresh=mode)))

    def queue(self, cluster_name: str) -> list[JobRecord]:
        self.ensure_server()
        import sky

        return parse_queue(sky.get(sky.queue(cluster_name, skip_finished=False)))

    def down(self, cluster_name: str) -> None:
        self.ensure_server()
        import sky

        sky.get(sky.down(cluster_name))

    def tail(self, cluster_name: str, job_id: int | None, lines: int) -> str:
        self.ensure_server()
        import sky

        buf = io.StringIO()
        sky.tail_logs(cluster_name, job_id, follow=False, tail=lines, output_stream=buf)
        return buf.getvalue()

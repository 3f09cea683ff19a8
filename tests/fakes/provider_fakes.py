"""Fakes for the provider SDK seams, and ``make_env``: any provider set up for the contract suite.

``FakeSkyAPI`` and ``FakeModalAPI`` stand in for SkyPilot's API server and Modal's control plane
(the only fakes: everything above the seam is the real adapter). They record every call, keep
clusters/sandboxes in memory, and raise the SDKs' own exception classes when told to.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from providers.base import LaunchRequest, Offer, Provider
from providers.modal.api import SandboxRecord, SandboxResult, SandboxSpec
from providers.skypilot.api import ClusterRecord, JobRecord  # noqa: F401 - re-exported for tests


class FakeSkyAPI:
    """Recorded stand-in for ``providers.skypilot.api.SkyAPI`` (no API server, no cloud).

    Its status and queue answers are SkyPilot's own records (``StatusResponse`` with a real
    ``CloudVmRayResourceHandle``, ``ClusterJobRecord``) passed through the API server's encoder
    and the client's decoder, then read by the real seam's parsers; its errors are SkyPilot's
    exception classes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.clusters: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, list[BaseException]] = {}
        self.next_job = 1

    def fail(self, op: str, exc: BaseException) -> None:
        self.errors.setdefault(op, []).append(exc)

    def _maybe_fail(self, op: str) -> None:
        if self.errors.get(op):
            raise self.errors[op].pop(0)

    # seam methods
    def launch(self, config: dict[str, Any], cluster_name: str, idle_minutes: int) -> int:
        self.calls.append(("launch", {"config": config, "cluster": cluster_name, "idle": idle_minutes}))
        self._maybe_fail("launch")
        job = self.next_job
        self.next_job += 1
        res = config["resources"]
        cloud = (res.get("infra") or res["ordered"][0]["infra"]).split("/")[0]
        self.clusters[cluster_name] = {"status": "UP", "cloud": cloud, "jobs": {job: "RUNNING"},
                                       "log": "", "launched_at": time.time()}
        return job

    def status(self, cluster_names: list[str] | None = None, refresh: bool = True) -> list[ClusterRecord]:
        self.calls.append(("status", {"names": cluster_names, "refresh": refresh}))
        self._maybe_fail("status")
        from providers.skypilot.api import parse_status
        from skypilot_offline import over_http, status_record

        recs = [status_record(n, c["cloud"], c["status"], True, full_handle=False)
                for n, c in self.clusters.items() if cluster_names is None or n in cluster_names]
        return parse_status(over_http("status", recs))

    def queue(self, cluster_name: str) -> list[JobRecord]:
        self.calls.append(("queue", cluster_name))
        self._maybe_fail("queue")
        c = self.clusters.get(cluster_name)
        if c is None:
            from sky.exceptions import ClusterDoesNotExist

            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        from providers.skypilot.api import parse_queue
        from skypilot_offline import job_record, over_http

        return parse_queue(over_http("queue", [job_record(j, s) for j, s in c["jobs"].items()]))

    def down(self, cluster_name: str) -> None:
        self.calls.append(("down", cluster_name))
        self._maybe_fail("down")
        if cluster_name not in self.clusters:
            from sky.exceptions import ClusterDoesNotExist

            raise ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
        del self.clusters[cluster_name]

    def tail(self, cluster_name: str, job_id: int | None, lines: int) -> str:
        self.calls.append(("tail", cluster_name))
        return self.clusters.get(cluster_name, {}).get("log", "")

    # what the cloud does on its own
    def preempt(self, cluster_name: str, how: str = "gone") -> None:
        if how == "gone":
            del self.clusters[cluster_name]
        else:
            self.clusters[cluster_name]["status"] = how  # "STOPPED" or "INIT"

    def job_exits(self, cluster_name: str, code: int, autodown: bool = False) -> None:
        c = self.clusters[cluster_name]
        for j in c["jobs"]:
            c["jobs"][j] = "SUCCEEDED" if code == 0 else "FAILED"
        c["log"] += f"training...\nDTRUN_EXIT_CODE={code}\n"
        if autodown:
            del self.clusters[cluster_name]


class FakeModalAPI:
    """Recorded stand-in for ``providers.modal.api.ModalAPI``, for controller-level tests that need
    no SDK. The provider contract suite drives the real SDK against ``fake_modal_server`` instead."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.sandboxes: dict[str, dict[str, Any]] = {}
        self.errors: dict[str, list[BaseException]] = {}
        self.n = 0

    def fail(self, op: str, exc: BaseException) -> None:
        self.errors.setdefault(op, []).append(exc)

    def _maybe_fail(self, op: str) -> None:
        if self.errors.get(op):
            raise self.errors[op].pop(0)

    def create(self, spec: SandboxSpec, should_cancel=None, on_progress=None) -> str:
        self.calls.append(("create", spec))
        self._maybe_fail("create")
        self.n += 1
        sid = f"sb-{self.n:04d}"
        self.sandboxes[sid] = {"spec": spec, "code": None, "status": "running"}
        return sid

    def result(self, sandbox_id: str) -> SandboxResult:
        self.calls.append(("result", sandbox_id))
        self._maybe_fail("poll")
        if sandbox_id not in self.sandboxes:
            from modal.exception import NotFoundError

            raise NotFoundError(f"Sandbox {sandbox_id} not found")
        sb = self.sandboxes[sandbox_id]
        return SandboxResult(sb["status"], sb["code"])

    def find(self, name: str) -> str:
        for sid, sb in reversed(list(self.sandboxes.items())):
            if sb["spec"].name == name:
                return sid
        from modal.exception import NotFoundError

        raise NotFoundError(f"Sandbox with name {name!r} not found")

    def terminate(self, sandbox_id: str) -> None:
        self.calls.append(("terminate", sandbox_id))
        self._maybe_fail("terminate")
        sb = self.sandboxes.get(sandbox_id)
        if sb is not None and sb["code"] is None:
            sb["code"], sb["status"] = 137, "terminated"

    def list(self, tags: dict[str, str]) -> list[SandboxRecord]:
        self.calls.append(("list", tags))
        self._maybe_fail("list")
        return [SandboxRecord(sid, sb["spec"].name, sb["spec"].tags) for sid, sb in self.sandboxes.items()
                if sb["code"] is None and all(sb["spec"].tags.get(k) == v for k, v in tags.items())]

    def logs(self, sandbox_id: str, tail: int) -> str:
        return ""

    def exits(self, sandbox_id: str, code: int, status: str | None = None) -> None:
        self.sandboxes[sandbox_id]["code"] = code
        self.sandboxes[sandbox_id]["status"] = status or ("success" if code == 0 else "failure")


_MODAL_SERVER = None


def modal_server():
    """One fake Modal control plane for the session (tests/fakes/fake_modal_server.py), the
    real ``modal`` client pointed at it through MODAL_SERVER_URL; its state is reset per use."""
    global _MODAL_SERVER
    from fake_modal_server import FakeModal

    if _MODAL_SERVER is None:
        import modal.client

        _MODAL_SERVER = FakeModal().start()
        modal.client._Client._client_from_env = None  # a client made earlier would talk elsewhere
    _MODAL_SERVER.reset()
    os.environ["MODAL_SERVER_URL"] = _MODAL_SERVER.url
    os.environ.setdefault("MODAL_TOKEN_ID", "ak-fake")
    os.environ.setdefault("MODAL_TOKEN_SECRET", "as-fake")
    return _MODAL_SERVER


class VClock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@dataclass
class ProviderEnv:
    """A provider under test plus the knobs the contract suite needs."""

    name: str
    provider: Provider
    offer: Offer
    command: list[str]
    to_running: Callable[[Any], None]
    preempt: Callable[[Any], None]
    exits: Callable[[Any, int], None]
    fake: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    def request(self, attempt: int = 1, job: str = "ctest", **kw: Any) -> LaunchRequest:
        return LaunchRequest(job=job, attempt=attempt, offer=kw.pop("offer", self.offer), nodes=kw.pop("nodes", 1),
                             command=kw.pop("command", self.command), env={"DTRUN_RUN_URI": "file:///tmp/r"},
                             **kw)


PROVIDERS = ["fake", "local", "runpod", "lambda", "vast", "modal"]


def _wait(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def make_env(name: str, tmp_path) -> ProviderEnv:
    from providers.base import Requirements

    if name == "fake":
        from providers.fake import FakeProvider

        clock = VClock()
        cloud = FakeProvider(clock=clock, provision_seconds=60)
        offer = cloud.offers(Requirements("H100", 8, 1, "prefer"))[0]
        return ProviderEnv(
            name, cloud, offer, ["python", "infra/node_bootstrap.py"],
            to_running=lambda h: clock.advance(61),
            preempt=lambda h: cloud.preempt(h.instance_id),
            exits=lambda h, code: cloud.set_exit(h.instance_id, code=code),
            fake=cloud, extra={"clock": clock},
        )
    if name == "local":
        from providers.local import LocalProvider, _group_alive

        p = LocalProvider(tmp_path / "dtrun-home", grace_seconds=2.0, confirm_wait_seconds=5.0)
        offer = p.offers(Requirements("cpu", 2))[0]
        ready = tmp_path / "ready"
        code = ("import os,sys,time,pathlib; pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))\n"
                "for _ in range(600):\n"
                "    time.sleep(0.05)\n"
                "    if os.path.exists(sys.argv[2]): sys.exit(int(open(sys.argv[2]).read()))\n")
        exit_file = tmp_path / "exit-code"

        def to_running(h):
            _wait(lambda: ready.exists())

        def preempt(h):  # killed from outside: the whole group, no exit code recorded
            os.killpg(h.data["pgid"], signal.SIGKILL)
            p._reap(h.instance_id)
            _wait(lambda: not _group_alive(h.data["pgid"]))

        def exits(h, c):
            exit_file.write_text(str(c))
            _wait(lambda: p.poll(h).is_terminal)

        return ProviderEnv(name, p, offer, [sys.executable, "-c", code, str(ready), str(exit_file)], to_running,
                           preempt, exits)
    if name in ("runpod", "lambda", "vast"):
        from providers.skypilot import SkyPilotProvider

        api = FakeSkyAPI()
        p = SkyPilotProvider(name, api, home=tmp_path / "dtrun-home")
        offer = Offer(name, "any", "H100", 8, name != "lambda", 2.5)
        return ProviderEnv(
            name, p, offer, ["python", "infra/node_bootstrap.py"],
            to_running=lambda h: None,
            preempt=lambda h: api.preempt(h.name),
            exits=lambda h, c: api.job_exits(h.name, c),
            fake=api,
        )
    if name == "modal":
        from providers.modal import ModalProvider

        from providers.modal.api import ModalAPI

        server = modal_server()  # the real SDK, against the local fake control plane
        p = ModalProvider(ModalAPI(), home=tmp_path / "dtrun-home", confirm_wait_seconds=2.0,
                          gpu_wait_seconds=2.0)
        offer = Offer("modal", "any", "H100", 8, False, 3.95)
        return ProviderEnv(
            name, p, offer, ["python", "infra/node_bootstrap.py"],
            to_running=lambda h: None,
            preempt=lambda h: server.finish(h.instance_id, 137, "terminated"),  # Modal took it
            exits=lambda h, c: server.finish(h.instance_id, c),
            fake=server,
        )
    raise ValueError(name)



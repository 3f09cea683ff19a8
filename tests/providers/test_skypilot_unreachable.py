"""A SkyPilot cluster that is UP to SkyPilot but whose node no longer answers SSH (the RunPod lab:
an interruptible pod taken back is EXITED, SkyPilot 0.14.1's refresh raises KeyError('EXITED')
and keeps the record UP). On RunPod dtrun then asks RunPod for the pod: EXITED or gone is a
preemption at once. Otherwise poll says RUNNING — the last state known — so the controller's
heartbeat bound ends the attempt, instead of every poll failing and hiding it from that check."""

from __future__ import annotations

import pytest

from providers import errors as perr
from providers.base import Handle, NodeState

from provider_fakes import FakeSkyAPI


@pytest.fixture
def up_cluster(tmp_path, credentials):
    from providers.skypilot import SkyPilotProvider

    api = FakeSkyAPI()
    prov = SkyPilotProvider("runpod", api, home=tmp_path / "dtrun-home")
    api.clusters["dtrun-u-a1"] = {"status": "UP", "cloud": "runpod", "jobs": {1: "RUNNING"}, "log": "",
                                  "launched_at": 0.0}
    return api, prov, Handle("runpod", "dtrun-u-a1", "dtrun-u-a1",
                             data={"cluster": "dtrun-u-a1", "job_id": 1, "cloud": "runpod"})


def test_ssh_unreachable_node_of_an_up_cluster_polls_running(up_cluster):
    from sky.exceptions import CommandError

    api, prov, h = up_cluster
    api.fail("queue", CommandError(255, "skylet queue", "Failed to get job queue on cluster dtrun-u-a1.",
                                   "ssh: connect to host 10.78.0.1 port 40010: Connection refused"))
    assert prov.poll(h) is NodeState.RUNNING
    assert prov.poll(h) is NodeState.RUNNING  # the queue answers again: the job's own state


def test_other_command_failures_still_raise(up_cluster):
    from sky.exceptions import CommandError

    api, prov, h = up_cluster
    api.fail("queue", CommandError(1, "skylet queue", "Failed to get job queue", "boom"))
    with pytest.raises(perr.ProviderError):
        prov.poll(h)


class PodAPI(FakeSkyAPI):
    """The SkyPilot seam plus RunPod's row for the head pod (or a fault asking for it)."""

    def __init__(self, row=None, fault=None):
        super().__init__()
        self.row, self.fault, self.asked = row, fault, []

    def runpod_pod(self, name_on_cloud):
        self.asked.append(name_on_cloud)
        if self.fault:
            raise self.fault
        return self.row


def _unreachable(tmp_path, api, name_on_cloud="dtrun-u-a1-2ea4"):
    from sky.exceptions import CommandError
    from providers.skypilot import SkyPilotProvider

    prov = SkyPilotProvider("runpod", api, home=tmp_path / "dtrun-home")
    api.clusters["dtrun-u-a1"] = {"status": "UP", "cloud": "runpod", "jobs": {1: "RUNNING"}, "log": "",
                                  "launched_at": 0.0}
    prov._memo("dtrun-u-a1", name_on_cloud=name_on_cloud)  # what launch() records from SkyPilot's handle
    api.fail("queue", CommandError(255, "skylet queue", "Failed to get job queue on cluster dtrun-u-a1.",
                                   "ssh: connect to host 10.78.0.1 port 40010: Connection refused"))
    return prov.poll(Handle("runpod", "dtrun-u-a1", "dtrun-u-a1",
                            data={"cluster": "dtrun-u-a1", "job_id": 1, "cloud": "runpod"}))


@pytest.mark.parametrize("row", [
    {"id": "p1", "name": "dtrun-u-a1-2ea4-head", "desiredStatus": "EXITED", "podType": "INTERRUPTABLE"},
    None,  # RunPod no longer lists it
])
def test_a_pod_runpod_took_back_is_preempted_at_the_first_unreachable_poll(tmp_path, credentials, row):
    api = PodAPI(row)
    assert _unreachable(tmp_path, api) is NodeState.PREEMPTED
    assert api.asked == ["dtrun-u-a1-2ea4"]


@pytest.mark.parametrize("api", [
    PodAPI({"id": "p1", "name": "dtrun-u-a1-2ea4-head", "desiredStatus": "RUNNING", "podType": "INTERRUPTABLE"}),
    PodAPI(fault=OSError("connection refused")),
])
def test_a_running_pod_or_runpod_not_answering_leaves_it_to_the_heartbeat(tmp_path, credentials, api):
    assert _unreachable(tmp_path, api) is NodeState.RUNNING


def test_a_cluster_whose_name_on_the_cloud_is_unknown_is_not_asked_about(tmp_path, credentials):
    api = PodAPI(None)
    assert _unreachable(tmp_path, api, name_on_cloud=None) is NodeState.RUNNING
    assert api.asked == []


def test_head_pod_asks_runpods_graphql_as_the_sdk_does(monkeypatch):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from providers.skypilot import runpodcheck

    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["Authorization"], body["query"]))
            pods = [{"id": "a", "name": "other-head", "desiredStatus": "RUNNING", "podType": "RESERVED"},
                    {"id": "b", "name": "dtrun-j-a1-2ea4-head", "desiredStatus": "EXITED", "podType": "INTERRUPTABLE"}]
            out = json.dumps({"data": {"myself": {"pods": pods}}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("RUNPOD_API_BASE_URL", f"http://127.0.0.1:{srv.server_port}")
        row = runpodcheck.head_pod("dtrun-j-a1-2ea4", "rp-key")
        assert runpodcheck.head_pod("dtrun-j-a9-0000", "rp-key") is None
    finally:
        srv.shutdown()
        srv.server_close()
    assert row["id"] == "b"
    assert runpodcheck.taken_back(row) == "RunPod reports the interruptible pod b EXITED"
    path, auth, query = seen[0]
    assert path == "/graphql" and auth == "Bearer rp-key" and "desiredStatus" in query

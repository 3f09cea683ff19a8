"""The real SDK seams (SkyAPI, ModalAPI) call the SDKs the way dtrun relies on — checked by
replacing the SDK functions themselves (no API server, no network), plus the SkyPilot task."""

from __future__ import annotations

import pytest

from providers.base import LaunchRequest, NodeState, Offer


def _request(cloud="runpod", spot=True, nodes=1, region="any"):
    return LaunchRequest(job="gpt", attempt=2, offer=Offer(cloud, region, "H100", 8, spot, 2.5, nodes=nodes),
                         nodes=nodes, command=["python", "infra/node_bootstrap.py"],
                         env={"DTRUN_RUN_URI": "s3://b/gpt"}, deadline=2_000_000_000.0, workdir=".")


def test_task_config_is_valid_skypilot_and_carries_the_bootstrap():
    from providers.skypilot import build_task_config
    from providers.skypilot.api import task_from_config

    cfg = build_task_config("runpod", _request(region="US"))
    assert cfg["name"] == "dtrun-gpt-a2"
    assert cfg["resources"] == {"accelerators": "H100:8", "use_spot": True, "infra": "runpod/US"}
    assert cfg["num_nodes"] == 1 and cfg["workdir"] == "."
    assert "python infra/node_bootstrap.py" in cfg["run"] and "DTRUN_EXIT_CODE=" in cfg["run"]
    assert cfg["envs"]["DTRUN_DEADLINE"] == "2000000000" and cfg["envs"]["DTRUN_RUN_URI"] == "s3://b/gpt"
    task = task_from_config(cfg)
    assert task.num_nodes == 1 and task.name == "dtrun-gpt-a2"
    (res,) = list(task.resources)
    assert res.use_spot and res.accelerators == {"H100": 8} and str(res.cloud) == "RunPod"
    lam = task_from_config(build_task_config("lambda", _request("lambda", spot=False, nodes=2)))
    assert lam.num_nodes == 2
    assert cfg["resources"]["infra"] != build_task_config("vast", _request("vast"))["resources"]["infra"]


def test_skyapi_calls_the_sdk_as_documented(monkeypatch):
    import sky
    from sky.utils.common import StatusRefreshMode

    from providers.skypilot import SkyPilotProvider, build_task_config
    from providers.skypilot import api as sky_api
    from providers.skypilot.api import SkyAPI

    # The API server is checked once per process; here it counts as checked (nothing real runs).
    monkeypatch.setitem(sky_api._SERVER, "checked", True)

    calls = []

    def fake_launch(task, **kw):
        calls.append(("launch", task, kw))
        return "req-launch"

    def fake_status(names, refresh):
        calls.append(("status", names, refresh))
        return "req-status"

    def fake_get(rid):
        calls.append(("get", rid))
        return {"req-launch": (7, object()),
                "req-status": [{"name": "dtrun-gpt-a2", "status": sky.ClusterStatus.UP, "launched_at": 5,
                                "cluster_ever_up": True, "resources_str": "1x RunPod(H100:8)", "handle": None}],
                "req-queue": [{"job_id": 7, "status": sky.JobStatus.RUNNING}],
                "req-down": None}[rid]

    monkeypatch.setattr(sky, "launch", fake_launch)
    monkeypatch.setattr(sky, "status", fake_status)
    monkeypatch.setattr(sky, "queue", lambda name, skip_finished: calls.append(("queue", name)) or "req-queue")
    monkeypatch.setattr(sky, "down", lambda name: calls.append(("down", name)) or "req-down")
    monkeypatch.setattr(sky, "get", fake_get)

    api = SkyAPI()
    cfg = build_task_config("runpod", _request())
    assert api.launch(cfg, "dtrun-gpt-a2", 3) == 7
    _, task, kw = calls[0]
    assert isinstance(task, sky.Task)
    assert kw == {"cluster_name": "dtrun-gpt-a2", "idle_minutes_to_autostop": 3, "down": True, "retry_until_up": False}
    (rec,) = api.status(["dtrun-gpt-a2"], refresh=True)
    assert calls[-2] == ("status", ["dtrun-gpt-a2"], StatusRefreshMode.FORCE)
    assert (rec.name, rec.status, rec.cloud, rec.ever_up) == ("dtrun-gpt-a2", "UP", "runpod", True)
    (job,) = api.queue("dtrun-gpt-a2")
    assert (job.job_id, job.status) == (7, "RUNNING")
    api.down("dtrun-gpt-a2")
    assert ("down", "dtrun-gpt-a2") in calls

    # and the adapter on top of the real seam
    p = SkyPilotProvider("runpod", api)
    monkeypatch.setenv("RUNPOD_API_KEY", "x")
    from providers.base import Handle

    h = Handle("runpod", "dtrun-gpt-a2", "dtrun-gpt-a2", data={"cluster": "dtrun-gpt-a2", "job_id": 7})
    assert p.poll(h) is NodeState.RUNNING


def test_skypilot_poll_edge_cases(tmp_path, credentials):
    from providers.skypilot import SkyPilotProvider

    from provider_fakes import FakeSkyAPI

    api = FakeSkyAPI()
    p = SkyPilotProvider("vast", api, home=tmp_path)
    h = p.launch(_request("vast"))
    assert api.calls[0][1]["idle"] == 3
    api.preempt(h.name, "STOPPED")  # vast: outbid → stopped
    assert p.poll(h) is NodeState.PREEMPTED
    assert [o.state for o in p.list_owned()] == [NodeState.PREEMPTED]  # still listed: still billing storage
    p.terminate(h)
    assert p.list_owned() == []
    # a job that succeeded and whose cluster then removed itself (down=True) stays SUCCEEDED,
    # also for another process (the memo is on disk)
    h2 = p.launch(_request("vast", spot=False))
    assert p.poll(h2) is NodeState.RUNNING
    api.job_exits(h2.name, 0)
    assert p.poll(h2) is NodeState.SUCCEEDED
    api.clusters.pop(h2.name)
    assert SkyPilotProvider("vast", api, home=tmp_path).poll(h2) is NodeState.SUCCEEDED
    # a node lost after being up (INIT again) → preempted
    h3 = p.launch(_request("vast", spot=False))
    api.preempt(h3.name, "INIT")
    assert p.poll(h3) is NodeState.PREEMPTED
    # other clouds' clusters are not ours
    rp = SkyPilotProvider("runpod", api, home=tmp_path)
    assert rp.list_owned() == []
    assert [o.name for o in p.list_owned()] == [h3.name]


def test_modalapi_calls_the_sdk_as_documented(monkeypatch, tmp_path):
    """The real SDK builds and sends the requests, to the local fake control plane: what reaches
    Modal is what dtrun means (entrypoint, GPU, name, tags, timeout, environment)."""
    from providers.modal import ModalProvider
    from providers.modal.api import ModalAPI

    from provider_fakes import modal_server

    server = modal_server()
    monkeypatch.setenv("MODAL_TOKEN_ID", "i")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "s")
    p = ModalProvider(ModalAPI(), home=tmp_path)
    req = _request("modal", spot=False)
    req = LaunchRequest(req.job, req.attempt, req.offer, 1, req.command, req.env, deadline=None, workdir=None)
    h = p.launch(req)
    sb = server.sandboxes[h.instance_id]
    d = sb.definition
    assert list(d.entrypoint_args) == ["python", "infra/node_bootstrap.py"]
    assert d.name == "dtrun-gpt-a2" and sb.app_id == server.apps["dtrun"]
    assert d.resources.gpu_config.gpu_type == "H100" and d.resources.gpu_config.count == 8
    assert sb.tags == {"dtrun": "1", "dtrun_job": "gpt", "dtrun_name": "dtrun-gpt-a2"}
    assert d.timeout_secs == 24 * 3600
    (env,) = [server.secrets[s] for s in d.secret_ids]  # V1 sends `env` as an ephemeral secret
    assert env["DTRUN_RUN_URI"] == "s3://b/gpt" and env["DTRUN_NPROC_PER_NODE"] == "8"
    assert env["DTRUN_NODE_TIMEOUT_SECONDS"] == str(24 * 3600)
    assert p.poll(h) is NodeState.RUNNING
    assert [o.name for o in p.list_owned()] == ["dtrun-gpt-a2"]
    p.terminate(h)


def test_modal_timeout_is_the_hard_deadline(tmp_path):
    import time

    from providers import errors as perr
    from providers.modal import ModalProvider

    from provider_fakes import FakeModalAPI

    p = ModalProvider(FakeModalAPI(), home=tmp_path)
    now = time.time()
    req = _request("modal", spot=False)
    spec = p.sandbox_spec(LaunchRequest(req.job, 1, req.offer, 1, req.command, deadline=now + 3600), now=now)
    assert spec.timeout == 3600 and spec.gpu == "H100:8"
    spec = p.sandbox_spec(LaunchRequest(req.job, 1, req.offer, 1, req.command, deadline=now + 99 * 3600), now=now)
    assert spec.timeout == 24 * 3600  # Modal's maximum
    with pytest.raises(perr.NotSupported, match="deadline"):
        p.sandbox_spec(LaunchRequest(req.job, 1, req.offer, 1, req.command, deadline=now - 1), now=now)


def test_importing_providers_imports_no_sdk():
    import subprocess
    import sys

    code = ("import sys, providers.registry as r, providers.base, providers.skypilot, providers.modal, "
            "providers.local, providers.fake; "
            "print(sorted(m for m in ('sky', 'modal', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

"""`dtrun logs JOB [--attempt N] [-f]` shows a remote (SkyPilot) attempt's node output: the job
log of the attempt's cluster, through the provider (the SDK seam is the recorded fake)."""

from __future__ import annotations

import pytest

from orchestrator.cli.app import main
from orchestrator.run.state import StateStore
from providers import registry
from providers.base import Handle

from provider_fakes import FakeSkyAPI


@pytest.fixture
def two_attempts(tmp_path, monkeypatch, credentials):
    from providers.skypilot import SkyPilotProvider

    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun-home"))
    api = FakeSkyAPI()
    prov = SkyPilotProvider("runpod", api, home=tmp_path / "dtrun-home")
    registry.register("runpod", prov)
    store = StateStore()
    store.create_job("lj", "name: lj\n", "s3://b/lj", providers=["runpod"], t=1.0)
    for n in (1, 2):
        cluster = f"dtrun-lj-a{n}"
        store.new_attempt("lj", n, {"provider": "runpod"}, "runpod", float(n))
        api.clusters[cluster] = {"status": "UP", "cloud": "runpod", "jobs": {1: "RUNNING"},
                                 "log": f"attempt {n} step 1\nattempt {n} step 2\n", "launched_at": 0.0}
        h = Handle("runpod", cluster, cluster, data={"cluster": cluster, "job_id": 1, "cloud": "runpod"})
        store.add_node("lj", n, h.to_dict(), float(n))
    store.set_state("lj", "SUCCEEDED", "done", t=5.0)
    yield api
    registry.unregister("runpod")


def test_logs_shows_each_remote_attempts_output(two_attempts, capsys):
    assert main(["logs", "lj"]) == 0
    out = capsys.readouterr().out
    assert "attempt 1 step 2" in out and "attempt 2 step 2" in out
    assert "runpod node output" in out


def test_logs_attempt_selects_one(two_attempts, capsys):
    assert main(["logs", "lj", "--attempt", "1"]) == 0
    out = capsys.readouterr().out
    assert "attempt 1 step 1" in out and "attempt 2" not in out.split("--- controller events ---")[0]
    assert ("tail", "dtrun-lj-a1") in two_attempts.calls


def test_logs_follow_prints_a_remote_attempt_then_stops_with_the_job(two_attempts, capsys):
    assert main(["logs", "lj", "-f", "--attempt", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("attempt 2 step 1") == 1  # a sliding tail is printed once


def test_logs_unknown_attempt_is_exit_6(two_attempts, capsys):
    assert main(["logs", "lj", "--attempt", "9"]) == 6
    assert "no attempt 9" in capsys.readouterr().err


def test_logs_releases_what_it_started(two_attempts, capsys, monkeypatch):
    """Reading a SkyPilot attempt's output starts SkyPilot's local API server when none runs; like
    every other command that touches SkyPilot (`dtrun gc`, the controller), `dtrun logs` stops the
    one it started when it is done (``Provider.close``), instead of leaving it running."""
    closed = []
    monkeypatch.setattr(two_attempts, "close", lambda: closed.append(True), raising=False)
    assert main(["logs", "lj"]) == 0
    assert closed
    closed.clear()
    assert main(["logs", "lj", "-f", "--attempt", "2"]) == 0
    assert closed


def test_down_of_a_finished_job_with_a_live_node_releases_what_it_started(two_attempts, capsys, monkeypatch):
    """`dtrun down` with no controller running, of a finished job whose node is still recorded
    alive, terminates it here through SkyPilot, then stops the API server that started (if any)."""
    from orchestrator.plan.spec import parse_spec, spec_to_yaml

    spec = parse_spec({"name": "lj", "resources": {"providers": ["runpod"], "gpu": "H100", "gpus_per_node": 1},
                       "trainer": {"model": "tiny", "steps": 10, "batch_size": 8, "seq_len": 64},
                       "checkpoint": {"uri": "s3://b/lj"}})
    store = StateStore()
    store.update_job("lj", spec_yaml=spec_to_yaml(spec))
    closed = []
    monkeypatch.setattr(two_attempts, "close", lambda: closed.append(True), raising=False)
    assert main(["down", "lj"]) == 0
    assert all(n["terminated_at"] is not None for n in store.nodes("lj"))
    assert closed


def test_logs_after_the_cluster_is_gone_show_the_tail_saved_at_terminate(tmp_path, monkeypatch, credentials):
    # Found on the Lambda lab: after DONE dtrun takes the cluster down, and `dtrun logs` then said
    # only "(logs unavailable: ClusterDoesNotExist)": the job log lives on the node.
    from providers.skypilot import SkyPilotProvider

    api = FakeSkyAPI()
    prov = SkyPilotProvider("lambda", api, home=tmp_path / "dtrun-home")
    cluster = "dtrun-gone-a1"
    api.clusters[cluster] = {"status": "UP", "cloud": "lambda", "jobs": {1: "SUCCEEDED"},
                             "log": "[dtrun-node] step 30/30\nDTRUN_EXIT_CODE=0\n", "launched_at": 0.0}
    h = Handle("lambda", cluster, cluster, data={"cluster": cluster, "job_id": 1, "cloud": "lambda"})
    prov.terminate(h)
    assert cluster not in api.clusters
    out = prov.logs(h)
    assert "step 30/30" in out and "DTRUN_EXIT_CODE=0" in out and "logs unavailable" not in out

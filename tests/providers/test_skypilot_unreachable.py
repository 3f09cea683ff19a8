"""A SkyPilot cluster that is UP to SkyPilot but whose node no longer answers SSH (the RunPod lab:
an interruptible pod taken back is EXITED, SkyPilot 0.14.1's refresh raises KeyError('EXITED')
and keeps the record UP): poll says RUNNING — the last state known — so the controller's
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

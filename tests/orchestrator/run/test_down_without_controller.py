"""`dtrun down` without a live controller ends what is left through the teardown's public API.

A job recorded finished while one of its nodes is still recorded alive (a controller that died
between the two) bills with nobody watching: `dtrun down JOB` terminates the node (confirmed) and
closes the providers through ``Teardown.terminate_all``, never a private method of the controller.
The fake cloud lives in a file shared by the test and the CLI code, as between two processes."""

from __future__ import annotations

from test_controller_fake import OFFERS, make_spec

from orchestrator.cli.jobs import cmd_down
from orchestrator.run.controller import Controller
from orchestrator.run.state import StateStore
from orchestrator.run.teardown import Teardown
from providers.fake import shared_cloud


def test_down_of_a_finished_job_terminates_its_leftover_node_and_closes_the_providers(
        tmp_path, dtrun_home, monkeypatch, capsys):
    monkeypatch.setenv("DTRUN_FAKE_CLOUD", str(tmp_path / "cloud.json"))
    cloud = shared_cloud(offers=OFFERS, provision_seconds=3600, autodown_seconds=None)
    store = StateStore()
    c = Controller(make_spec(tmp_path, name="leftover"), store, providers={"fake": cloud}, write_lease=False)
    assert c.tick() == "PROVISIONING"
    [node] = store.nodes("leftover", live_only=True)
    # the controller recorded the job finished, then died before its terminate was confirmed
    store.set_state("leftover", "FAILED", "recorded finished with a node still alive")
    store.release_controller("leftover", c.pid)

    used = []
    closed = []
    real = Teardown.terminate_all
    monkeypatch.setattr(Teardown, "terminate_all", lambda self, **kw: (used.append(kw), real(self, **kw))[1])
    real_close = Teardown.close_providers
    monkeypatch.setattr(Teardown, "close_providers", lambda self: (closed.append(1), real_close(self))[1])

    assert cmd_down("leftover", now=False, yes=True) == 0
    assert used and closed
    assert "every node terminated (confirmed)" in capsys.readouterr().out
    assert store.nodes("leftover", live_only=True) == []
    [row] = [r for r in shared_cloud().bill()["rows"] if r["name"] == node["name"]]
    assert not row["live"]
    assert store.get_job("leftover")["state"] == "FAILED"  # still what it was recorded as

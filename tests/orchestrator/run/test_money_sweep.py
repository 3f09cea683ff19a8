"""The orphan sweep and `dtrun gc`, against the fake cloud (in memory and file-backed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from orchestrator.run.clock import VirtualClock
from orchestrator.cli.app import app
from orchestrator.run.sweep import find_orphans, sweep_orphans
from orchestrator.run.state import StateStore
from providers import registry
from providers.base import LaunchRequest, Offer
from providers.fake import FakeProvider, shared_cloud

OFFER = Offer("fake", "fake-east", "H100", 8, False, 2.49, price_source="fake cloud")


def _launch(cloud: FakeProvider, job: str, attempt: int, owner: str | None):
    """An instance as a controller of the store with ``owner`` id launches it (None: an older dtrun's)."""
    req = LaunchRequest(job=job, attempt=attempt, offer=OFFER, nodes=1, command=["true"],
                        env={"DTRUN_RUN_URI": "file:///nowhere"}, owner=owner)
    return cloud.launch(req)


def _job(store: StateStore, name: str, state: str = "RUNNING", t: float = 0.0) -> None:
    store.create_job(name, "name: x\n", "file:///nowhere", providers=["fake"], t=t)
    if state != "PENDING":
        store.set_state(name, state, "test", t=t)


def _record(store: StateStore, job: str, n: int, handle, t: float) -> int:
    store.new_attempt(job, n, OFFER.to_dict(), "fake", t)
    return store.add_node(job, n, handle.to_dict(), t)


@pytest.fixture
def world(tmp_path):
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, provision_seconds=60)
    store = StateStore(tmp_path / "state.db")
    yield clock, cloud, store
    store.close()


def _home_owner() -> str:
    """The owner id of the store in ``$DTRUN_HOME`` (what `dtrun gc` opens)."""
    st = StateStore()
    try:
        return st.owner_id
    finally:
        st.close()


def _live(cloud):
    return sorted(i.name for i in cloud.running_instances())


def test_unknown_and_finished_jobs_are_orphans_live_nodes_are_not(world):
    clock, cloud, store = world
    _job(store, "alive")
    _job(store, "finished", "SUCCEEDED")
    h_alive = _launch(cloud, "alive", 1, store.owner_id)
    _record(store, "alive", 1, h_alive, clock.now())
    h_fin = _launch(cloud, "finished", 1, store.owner_id)
    nid = _record(store, "finished", 1, h_fin, clock.now())  # recorded, never confirmed terminated
    _launch(cloud, "stranger", 4, store.owner_id)  # a job this store never heard of
    clock.advance(600)

    swept = sweep_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock)
    assert sorted(i.name for i in swept) == ["dtrun-finished-a1", "dtrun-stranger-a4"]
    assert _live(cloud) == ["dtrun-alive-a1"]
    # the store learns the finished job's node is gone only now, confirmed
    node = [n for n in store.nodes("finished") if n["id"] == nid][0]
    assert node["terminated_at"] is not None
    assert any(e["type"] == "orphan" for e in store.events("finished"))
    # the bill stops at the sweep
    bill = cloud.bill()
    assert all(not r["live"] for r in bill["rows"] if r["name"] != "dtrun-alive-a1")


def test_created_but_never_recorded_is_swept_by_its_own_controller(world):
    clock, cloud, store = world
    _job(store, "crashy", "PROVISIONING")
    store.claim_controller("crashy", pid=os.getpid())
    _launch(cloud, "crashy", 1, store.owner_id)  # launch returned, the controller died before add_node
    swept = sweep_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock)
    assert [i.name for i in swept] == ["dtrun-crashy-a1"]
    assert _live(cloud) == []


def test_unrecorded_instance_of_another_live_controller_is_left_alone(world):
    clock, cloud, store = world
    _job(store, "busy", "PROVISIONING")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        store.claim_controller("busy", pid=other.pid)
        _launch(cloud, "busy", 1, store.owner_id)
        assert sweep_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock) == []
        store.new_attempt("busy", 1, OFFER.to_dict(), "fake", 0.0)  # LAUNCHING: may be recorded yet
        assert sweep_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock) == []
        assert _live(cloud) == ["dtrun-busy-a1"]
        # the same live controller, but that attempt ended (a launch that "failed" yet created the
        # instance): nobody will ever record it
        store.update_attempt("busy", 1, state="ENDED", outcome="launch_error")
        swept = sweep_orphans(store, ["fake"], dry_run=True, providers={"fake": cloud})
        assert [i.name for i in swept] == ["dtrun-busy-a1"]
        store.update_attempt("busy", 1, state="LAUNCHING")
    finally:
        other.kill()
        other.wait()
    # its controller is gone: now nobody can be about to record it
    assert [i.name for i in sweep_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock)] == ["dtrun-busy-a1"]


def test_node_from_an_earlier_run_of_a_restarted_job_is_an_orphan(world):
    clock, cloud, store = world
    _job(store, "again", "RUNNING")
    h = _launch(cloud, "again", 1, store.owner_id)
    _record(store, "again", 1, h, clock.now())
    store.set_state("again", "FAILED", "x")
    store.create_job("again", "name: again\n", "file:///nowhere", providers=["fake"])  # a new `dtrun up`
    assert [i.name for i in sweep_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock)] == ["dtrun-again-a1"]


def test_dry_run_lists_only(world):
    clock, cloud, store = world
    _launch(cloud, "ghost", 1, store.owner_id)
    assert [i.name for i in sweep_orphans(store, ["fake"], dry_run=True, providers={"fake": cloud})] == ["dtrun-ghost-a1"]
    assert _live(cloud) == ["dtrun-ghost-a1"]


def test_terminate_failing_transiently_is_retried_until_confirmed(world):
    clock, cloud, store = world
    cloud.configure(terminate_seconds=240)
    _launch(cloud, "ghost", 1, store.owner_id)
    cloud.inject("terminate", "Transient", count=3)
    t0 = clock.now()
    swept = sweep_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock)
    assert len(swept) == 1
    assert _live(cloud) == []
    assert clock.now() - t0 >= 240  # it waited for the cloud's confirmation, not just the request
    row = cloud.bill()["rows"][0]
    assert row["end"] is not None


def test_unconfirmed_terminate_is_reported_not_hidden(world):
    clock, cloud, store = world
    cloud.configure(terminate_seconds=10_000)
    _launch(cloud, "ghost", 1, store.owner_id)
    rep = find_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock)
    from orchestrator.run.sweep import terminate_orphans

    terminate_orphans(store, rep, providers={"fake": cloud}, clock=clock, timeout=120)
    assert rep.orphans[0].outcome == "not_confirmed"


def test_listing_errors_are_reported_and_other_providers_still_swept(world):
    clock, cloud, store = world
    _launch(cloud, "ghost", 1, store.owner_id)
    cloud.inject("list_owned", "AuthError", count=1)
    rep = find_orphans(store, ["fake", "nonesuch"], providers={"fake": cloud}, clock=clock)
    assert "fake" in rep.errors and "nonesuch" in rep.errors
    rep = find_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock)
    assert len(rep.orphans) == 1


# ---- the CLI (file-backed fake cloud shared with this process) ------------------------------------

@pytest.fixture
def shared(dtrun_home):
    cloud = shared_cloud(provision_seconds=0)
    registry.unregister("fake")
    yield cloud


def test_gc_without_tty_or_yes_lists_only_then_yes_terminates(shared):
    _launch(shared, "ghost", 2, _home_owner())
    r = CliRunner().invoke(app, ["gc"])
    assert r.exit_code == 0, r.output
    assert "dtrun-ghost-a2" in r.output and "listed only" in r.output
    assert _live(shared) == ["dtrun-ghost-a2"]
    r = CliRunner().invoke(app, ["gc", "--json"])
    d = json.loads(r.output)
    assert [o["name"] for o in d["orphans"]] == ["dtrun-ghost-a2"] and d["terminated"] == 0
    r = CliRunner().invoke(app, ["gc", "--yes", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["terminated"] == 1 and d["orphans"][0]["outcome"] == "terminated"
    assert _live(shared) == []
    r = CliRunner().invoke(app, ["gc"])
    assert "no orphan instances" in r.output


def test_gc_as_a_subprocess_never_waits_for_input(shared, dtrun_home):
    _launch(shared, "ghost", 1, _home_owner())
    env = {**os.environ, "DTRUN_HOME": str(dtrun_home)}
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "gc"], env=env, capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "dtrun-ghost-a1" in r.stdout
    assert _live(shared) == ["dtrun-ghost-a1"]


def test_a_live_node_whose_controller_died_on_this_host_is_an_orphan_for_gc(world):
    # found running the node for real (tests/e2e/test_modal_lab.py): after a SIGKILLed controller,
    # `dtrun gc` said "owned by live jobs" and the sandbox billed on with nobody to stop it
    from orchestrator.run.state import HOST

    clock, cloud, store = world
    _job(store, "dead")
    _record(store, "dead", 1, _launch(cloud, "dead", 1, store.owner_id), clock.now())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no longer alive: the SIGKILLed controller
    store.update_job("dead", controller_pid=gone.pid, controller_host=HOST)
    clock.advance(600)
    rep = find_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock)
    (o,) = rep.orphans
    assert o.instance.name == "dtrun-dead-a1" and "controller" in o.why and "gone" in o.why
    store.update_job("dead", controller_pid=os.getpid())  # the caller is the controller: it re-attaches
    assert find_orphans(store, ["fake"], providers={"fake": cloud}, clock=clock).orphans == []

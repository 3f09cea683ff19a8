"""Two dtrun homes on one cloud account (issue 33 item 2): the orphan sweep of one state store never
terminates the other's nodes; `dtrun gc` lists them as "not ours" and removes them only when named
or with ``--all``. The account is the fake cloud's shared file (``$DTRUN_FAKE_CLOUD``) that both
homes' controllers and the CLI use, as two people (or a laptop and a CI runner) would."""

from __future__ import annotations

import json
import time

import pytest
from test_controller_fake import OFFERS, make_spec
from typer.testing import CliRunner

from orchestrator.cli.app import app
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.state import StateStore
from providers import registry
from providers.base import LaunchRequest, Offer
from providers.fake import FakeProvider


@pytest.fixture
def account(tmp_path, monkeypatch):
    """One fake account (a shared cloud file) and two dtrun homes, A and B."""
    cloud_file = tmp_path / "account" / "fake-cloud.json"
    cloud_file.parent.mkdir()
    monkeypatch.setenv("DTRUN_FAKE_CLOUD", str(cloud_file))
    homes = {k: tmp_path / f"home-{k}" for k in "AB"}
    for h in homes.values():
        h.mkdir()
    clock = VirtualClock(start=time.time())  # the CLI's `gc` reads the same file on the real clock
    registry.unregister("fake")
    stores = {k: StateStore(h / "state.db") for k, h in homes.items()}
    yield cloud_file, homes, stores, clock
    for s in stores.values():
        s.close()
    registry.unregister("fake")


def _cloud(path, clock) -> FakeProvider:
    return FakeProvider(path, clock, offers=OFFERS, provision_seconds=3600, autodown_seconds=None)


def _live(cloud):
    return sorted((i.name, i.id) for i in cloud.instances() if i.gone_at is None)


def test_second_home_leaves_the_firsts_live_node_alone_and_gc_all_removes_it(account, monkeypatch):
    cloud_file, homes, stores, clock = account
    a, b = stores["A"], stores["B"]
    assert a.owner_id != b.owner_id and a.owner_id == StateStore(homes["A"] / "state.db").owner_id
    # home A starts a run: its node is provisioning (a live, billing instance)
    ca = Controller(make_spec(homes["A"]), a, clock=clock, providers={"fake": _cloud(cloud_file, clock)},
                    write_lease=False)
    assert ca.tick() == "PROVISIONING"
    cloud = _cloud(cloud_file, clock)
    (mine,) = _live(cloud)
    assert mine[0] == "dtrun-fakejob-a1"
    # home B starts a job of the same name on the same account: its controller start sweeps
    cb = Controller(make_spec(homes["B"]), b, clock=clock, providers={"fake": _cloud(cloud_file, clock)},
                    write_lease=False)
    assert cb.tick() == "PROVISIONING"
    live = _live(cloud)
    assert mine in live and len(live) == 2  # A's node left alone
    assert not [e for e in b.events("fakejob") if e["type"] == "orphan"]
    theirs = [x for x in live if x != mine][0]

    # `dtrun gc` in home B: A's node is listed as not ours, and left alone without --all
    monkeypatch.setenv("DTRUN_HOME", str(homes["B"]))
    # B's controller is this process, so B's own node is owned by a live job; A's is an orphan to B
    r = CliRunner().invoke(app, ["gc", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert [(o["name"], o["instance_id"], o["ours"]) for o in d["orphans"]] == [(mine[0], mine[1], False)]
    assert d["not_ours"] == 1 and d["orphans"][0]["owner"] == a.owner_id
    r = CliRunner().invoke(app, ["gc", "--yes"])
    assert r.exit_code == 0, r.output
    assert "not ours" in r.output and mine[1] in r.output and "--all" in r.output
    assert mine in _live(cloud)
    # --all after the confirmation (--yes: no terminal) removes it, and only it
    r = CliRunner().invoke(app, ["gc", "--all", "--yes"])
    assert r.exit_code == 0, r.output
    assert f"{mine[0]}: terminated" in r.output
    assert _live(cloud) == [theirs]


def test_gc_by_name_removes_only_the_named_not_ours_instance(account, monkeypatch):
    cloud_file, homes, stores, clock = account
    cloud = _cloud(cloud_file, clock)
    offer = Offer("fake", "fake-east", "H100", 1, True, 1.0)

    def launch(job, owner):
        return cloud.launch(LaunchRequest(job=job, attempt=1, offer=offer, nodes=1, command=["true"], owner=owner))

    h_other = launch("other", stores["A"].owner_id)
    launch("old", None)  # launched by dtrun before owners: carries none, recorded nowhere
    h_mine = launch("mine", stores["B"].owner_id)  # B's own, of a job B does not know: ours
    monkeypatch.setenv("DTRUN_HOME", str(homes["B"]))
    r = CliRunner().invoke(app, ["gc", "--json"])
    d = {o["name"]: o for o in json.loads(r.output)["orphans"]}
    assert (d["dtrun-other-a1"]["ours"], d["dtrun-old-a1"]["ours"], d["dtrun-mine-a1"]["ours"]) == (False, False, True)
    assert "no owner id" in d["dtrun-old-a1"]["why"]
    r = CliRunner().invoke(app, ["gc", "dtrun-old-a1", "--yes"])
    assert r.exit_code == 0, r.output
    assert sorted(i[1] for i in _live(cloud)) == sorted([h_other.instance_id, h_mine.instance_id])
    r = CliRunner().invoke(app, ["gc", "nonesuch", "--yes"])
    assert r.exit_code == 1 and "no orphan instance named 'nonesuch'" in r.output
    # the automatic sweep (and a plain `gc --yes`) takes only ours
    r = CliRunner().invoke(app, ["gc", "--yes"])
    assert r.exit_code == 0, r.output
    assert [i[1] for i in _live(cloud)] == [h_other.instance_id]

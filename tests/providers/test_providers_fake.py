"""The fake cloud's own behaviour: clock, bill, faults, preemptions, scripts, persistence."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from providers import errors as perr
from providers import registry
from providers.base import LaunchRequest, NodeState, Offer, Requirements
from providers.fake import FakeOfferTemplate, FakeProvider, shared_cloud


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


H100 = Requirements(gpu="H100", gpus_per_node=8, nodes=1, spot="prefer")


def _req(cloud: FakeProvider, job: str = "j", attempt: int = 1, spot: bool = False,
         region: str | None = None, nodes: int = 1, deadline: float | None = None) -> LaunchRequest:
    offers = [o for o in cloud.offers(Requirements("H100", 8, nodes, spot)) if region in (None, o.region)]
    return LaunchRequest(job=job, attempt=attempt, offer=offers[0], nodes=nodes,
                         command=["python", "infra/node_bootstrap.py"],
                         env={"DTRUN_RUN_URI": "file:///tmp/x", "RUNPOD_API_KEY": "sekrit"},
                         deadline=deadline)


def test_default_offers_cover_spot_and_on_demand_in_two_regions():
    cloud = FakeProvider(clock=Clock())
    offers = cloud.offers(H100)
    assert {o.region for o in offers} >= {"fake-east", "fake-west"}
    assert {o.spot for o in offers} == {True, False}
    assert all(o.gpus_per_node == 8 and o.provider == "fake" for o in offers)
    assert offers == sorted(offers, key=lambda o: o.price_per_hour)
    # filters: spot only / on-demand only / region / max price
    assert all(o.spot for o in cloud.offers(Requirements("H100", 8, spot=True)))
    assert not any(o.spot for o in cloud.offers(Requirements("H100", 8, spot=False)))
    assert {o.region for o in cloud.offers(Requirements("H100", 8, spot="prefer", regions=("fake-west",)))} == {"fake-west"}
    assert all(o.price_per_gpu_hour <= 1.3 for o in cloud.offers(Requirements("H100", 8, spot="prefer", max_price_per_gpu_hour=1.3)))
    assert cloud.offers(Requirements("H100", 16)) == []  # over max GPUs per node: refused


def test_configurable_offers():
    cloud = FakeProvider(clock=Clock(), offers=[FakeOfferTemplate("r1", "L4", True, 0.1)])
    assert [o.key() for o in cloud.offers(Requirements("L4", 2, spot="prefer"))] == ["fake/r1/L4x2/spot"]
    assert cloud.offers(H100) == []


def test_lifecycle_on_virtual_clock_and_exact_bill():
    clock = Clock()
    cloud = FakeProvider(clock=clock, provision_seconds=120)
    req = _req(cloud)
    cloud.script(req.instance_name, exit_after=3600, exit_code=0)
    h = cloud.launch(req)
    assert h.name == "dtrun-j-a1" and h.provider == "fake"
    assert cloud.poll(h) is NodeState.PENDING
    clock.advance(119)
    assert cloud.poll(h) is NodeState.PENDING
    clock.advance(1)
    assert cloud.poll(h) is NodeState.RUNNING
    clock.advance(10 * 3600)  # far past the scripted exit: the bill stops at exit (autodown 0)
    assert cloud.poll(h) is NodeState.SUCCEEDED
    bill = cloud.bill()
    (row,) = bill["rows"]
    assert row["seconds"] == pytest.approx(120 + 3600)
    assert row["cost_usd"] == pytest.approx((3720 / 3600) * req.offer.price_per_hour)
    assert bill["total_usd"] == pytest.approx(row["cost_usd"])
    assert cloud.running_instances() == []
    cloud.terminate(h)  # already gone: fine
    assert cloud.poll(h) is NodeState.SUCCEEDED


def test_exit_codes_map_like_local():
    clock = Clock()
    cloud = FakeProvider(clock=clock, provision_seconds=0)
    states = {}
    for i, code in enumerate((0, 75, 76, 1, 2)):
        h = cloud.launch(_req(cloud, attempt=i + 1))
        cloud.set_exit(h.instance_id, code=code)
        states[code] = cloud.poll(h)
    assert states == {0: NodeState.SUCCEEDED, 75: NodeState.PREEMPTED, 76: NodeState.PREEMPTED,
                      1: NodeState.FAILED, 2: NodeState.FAILED}


def test_instance_without_autodown_bills_until_terminated():
    clock = Clock()
    cloud = FakeProvider(clock=clock, provision_seconds=0, autodown_seconds=None)
    h = cloud.launch(_req(cloud))
    cloud.set_exit(h.name, at=clock() + 60, code=0)
    clock.advance(3600)
    assert cloud.poll(h) is NodeState.SUCCEEDED
    assert [i.id for i in cloud.running_instances()] == [h.instance_id]  # a leak until terminated
    assert cloud.bill()["rows"][0]["seconds"] == pytest.approx(3600)
    cloud.terminate(h)
    clock.advance(3600)
    assert cloud.running_instances() == []
    assert cloud.bill()["rows"][0]["seconds"] == pytest.approx(3600)


def test_terminate_needs_confirming():
    clock = Clock()
    cloud = FakeProvider(clock=clock, provision_seconds=0, terminate_seconds=30)
    h = cloud.launch(_req(cloud))
    clock.advance(100)
    with pytest.raises(perr.TerminateNotConfirmed):
        cloud.terminate(h)
    assert cloud.poll(h) is NodeState.TERMINATED
    assert len(cloud.list_owned()) == 1  # still billing until confirmed
    clock.advance(29)
    with pytest.raises(perr.TerminateNotConfirmed):
        cloud.terminate(h)
    clock.advance(1)
    cloud.terminate(h)
    assert cloud.list_owned() == []
    assert cloud.bill()["rows"][0]["seconds"] == pytest.approx(130)
    # scripted: one unconfirmed terminate even with no delay
    cloud.configure(terminate_seconds=0)
    h2 = cloud.launch(_req(cloud, attempt=2))
    cloud.inject("terminate", "TerminateNotConfirmed", count=1)
    with pytest.raises(perr.TerminateNotConfirmed):
        cloud.terminate(h2)
    cloud.terminate(h2)
    cloud.terminate(h2)
    assert cloud.list_owned() == []


def test_scripted_and_seeded_preemptions():
    clock = Clock()
    cloud = FakeProvider(clock=clock, provision_seconds=60)
    req = _req(cloud, spot=True)
    cloud.script(req.instance_name, preempt_after=600)
    h = cloud.launch(req)
    clock.advance(659)
    assert cloud.poll(h) is NodeState.RUNNING
    clock.advance(1)
    assert cloud.poll(h) is NodeState.PREEMPTED
    assert cloud.bill()["rows"][0]["seconds"] == pytest.approx(660)  # billing stops at preemption
    assert cloud.list_owned() == []

    def preempt_times(seed: int) -> list[float]:
        c = Clock()
        fc = FakeProvider(clock=c, provision_seconds=0, preemptions_per_hour=2.0, seed=seed)
        hs = [fc.launch(_req(fc, attempt=i, spot=True)) for i in range(1, 41)]
        c.advance(100 * 3600)
        assert all(fc.poll(x) is NodeState.PREEMPTED for x in hs)
        return [r["seconds"] for r in fc.bill()["rows"]]

    a, b = preempt_times(7), preempt_times(7)
    assert a == b  # seeded: reproducible
    assert preempt_times(8) != a
    mean_h = sum(a) / len(a) / 3600
    assert 0.25 < mean_h < 1.0  # rate 2/h → mean 0.5 h
    # on-demand instances are never preempted by the rate
    c = Clock()
    fc = FakeProvider(clock=c, provision_seconds=0, preemptions_per_hour=50.0)
    h = fc.launch(_req(fc, spot=False))
    c.advance(10 * 3600)
    assert fc.poll(h) is NodeState.RUNNING


def test_capacity_and_api_faults():
    clock = Clock()
    cloud = FakeProvider(clock=clock, provision_seconds=0)
    cloud.inject("launch", "NoCapacity", count=None, match="fake-east")
    east = _req(cloud, region="fake-east")
    west = _req(cloud, region="fake-west")
    for _ in range(3):
        with pytest.raises(perr.NoCapacity):
            cloud.launch(east)
    h = cloud.launch(west)
    cloud.clear_faults()
    cloud.launch(east)
    cloud.inject("poll", "Transient", count=2)
    with pytest.raises(perr.Transient):
        cloud.poll(h)
    with pytest.raises(perr.Transient):
        cloud.poll(h)
    assert cloud.poll(h) is NodeState.RUNNING
    for kind, exc in (("QuotaExceeded", perr.QuotaExceeded), ("AuthError", perr.AuthError),
                      ("NotSupported", perr.NotSupported)):
        cloud.inject("launch", kind)
        with pytest.raises(exc) as ei:
            cloud.launch(west)
        assert ei.value.provider == "fake"
    # a launch that "times out" but created the instance anyway: only a prefix sweep finds it
    cloud.inject("launch", "Transient", create=True)
    with pytest.raises(perr.Transient):
        cloud.launch(_req(cloud, job="leaky"))
    assert [o.name for o in cloud.list_owned("dtrun-leaky-")] == ["dtrun-leaky-a1"]
    # unknown offer → no capacity
    bad = LaunchRequest("j", 9, Offer("fake", "nowhere", "H100", 8, False, 1.0), 1, ["true"])
    with pytest.raises(perr.NoCapacity):
        cloud.launch(bad)


def test_seeded_transient_rate():
    clock = Clock()
    cloud = FakeProvider(clock=clock, provision_seconds=0, transient_rate=0.5, seed=3)
    ok = err = 0
    for i in range(60):
        try:
            cloud.launch(_req(cloud, attempt=i))
            ok += 1
        except perr.Transient:
            err += 1
    assert 15 < err < 45 and ok + err == 60


def test_hard_deadline_removes_the_node():
    clock = Clock()
    cloud = FakeProvider(clock=clock, provision_seconds=10)
    h = cloud.launch(_req(cloud, deadline=clock() + 3600))
    clock.advance(5 * 3600)
    assert cloud.poll(h) is NodeState.TERMINATED
    assert cloud.bill()["rows"][0]["seconds"] == pytest.approx(3600)


def test_workload_callback_writes_progress_and_exits(tmp_path):
    clock = Clock()
    seen = []

    def workload(inst, now):
        seen.append(inst.env["DTRUN_RUN_URI"])
        assert "RUNPOD_API_KEY" not in inst.env  # secrets never stored
        (tmp_path / "progress.json").write_text(json.dumps({"step": int(now - inst.ready_at)}))
        if now - inst.ready_at >= 500:
            return (0, inst.ready_at + 500)
        return None

    cloud = FakeProvider(clock=clock, provision_seconds=100, workload=workload)
    h = cloud.launch(_req(cloud))
    clock.advance(200)
    assert cloud.poll(h) is NodeState.RUNNING
    assert json.loads((tmp_path / "progress.json").read_text())["step"] == 100
    clock.advance(1000)
    assert cloud.poll(h) is NodeState.SUCCEEDED
    assert cloud.bill()["rows"][0]["seconds"] == pytest.approx(600)
    assert seen and seen[0] == "file:///tmp/x"
    assert "dtrun-j-a1" in cloud.logs(h) or "created" in cloud.logs(h)


def test_persistence_shared_between_instances_and_processes(tmp_path, monkeypatch):
    path = tmp_path / "cloud.json"
    clock = Clock()
    a = FakeProvider(path, clock=clock, provision_seconds=30)
    b = FakeProvider(path, clock=clock)
    assert b.config()["provision_seconds"] == 30  # config lives in the file
    h = a.launch(_req(a))
    assert [o.instance_id for o in b.list_owned()] == [h.instance_id]
    clock.advance(31)
    assert b.poll(h) is NodeState.RUNNING
    b.terminate(h)
    assert a.list_owned() == []
    assert a.bill()["total_usd"] == pytest.approx(b.bill()["total_usd"])
    assert a.bill()["total_usd"] > 0
    assert "sekrit" not in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o600"

    # the registry's "fake" is the shared file under $DTRUN_FAKE_CLOUD; a second process sees it
    monkeypatch.setenv("DTRUN_FAKE_CLOUD", str(path))
    c = registry.get("fake")
    h2 = c.launch(_req(c, attempt=2))
    code = textwrap.dedent("""
        import json, sys
        from providers import registry
        from providers.base import Handle
        p = registry.get("fake")
        owned = [o.name for o in p.list_owned()]
        p.terminate(Handle.from_dict(json.loads(sys.argv[1])))
        print(json.dumps(owned))
    """)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(h2.to_dict())], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["dtrun-j-a2"]
    assert c.list_owned() == []


def test_shared_cloud_default_path(dtrun_home, monkeypatch):
    monkeypatch.delenv("DTRUN_FAKE_CLOUD", raising=False)
    p = shared_cloud()
    assert p.path == dtrun_home / "fake-cloud.json" and p.path.exists()


def test_concurrent_processes_do_not_lose_updates(tmp_path):
    path = tmp_path / "cloud.json"
    FakeProvider(path, provision_seconds=0)
    code = textwrap.dedent(f"""
        import sys
        from providers.fake import FakeProvider
        from providers.base import LaunchRequest, Requirements
        p = FakeProvider({str(path)!r})
        o = p.offers(Requirements("cpu", 1))[0]
        for i in range(15):
            p.launch(LaunchRequest(sys.argv[1], i, o, 1, ["true"]))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, f"w{k}"]) for k in range(3)]
    assert all(p.wait(timeout=60) == 0 for p in procs)
    assert len(FakeProvider(path).instances()) == 45

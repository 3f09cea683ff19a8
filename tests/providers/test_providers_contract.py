"""One contract suite, run against every provider: fake, local (real processes), RunPod/Lambda/Vast
through the SkyPilot adapter behind a recorded fake SkyAPI, and Modal through the real ``modal``
client against a local fake of Modal's gRPC control plane (tests/fakes/fake_modal_server.py)."""

from __future__ import annotations

import re

import pytest

from providers import errors as perr
from providers.base import NodeState, Offer, Requirements


def test_launch_running_terminate_list_owned_empty(penv):
    p = penv.provider
    h = p.launch(penv.request())
    assert h.name == "dtrun-ctest-a1" and h.provider == penv.name
    penv.to_running(h)
    assert p.poll(h) is NodeState.RUNNING
    assert [o.name for o in p.list_owned("dtrun-ctest-")] == ["dtrun-ctest-a1"]
    assert p.list_owned("dtrun-other-") == []
    p.terminate(h)
    assert p.list_owned("dtrun-ctest-") == []
    assert p.poll(h) is NodeState.TERMINATED
    p.terminate(h)  # twice: fine
    p.terminate(h)
    assert p.poll(h) is NodeState.TERMINATED


def test_the_owner_id_is_kept_with_the_instance_and_listed(penv):
    # issue 33 item 2: the orphan sweep of one state store tells its nodes from another's by it
    p = penv.provider
    h = p.launch(penv.request(owner="0123abcd4567"))
    h2 = p.launch(penv.request(attempt=2))  # launched without one (dtrun before owners)
    penv.to_running(h)
    penv.to_running(h2)
    owners = {o.name: o.owner for o in p.list_owned("dtrun-ctest-")}
    assert owners == {"dtrun-ctest-a1": "0123abcd4567", "dtrun-ctest-a2": None}
    p.terminate(h)
    p.terminate(h2)


def test_preemption_is_reported_as_preempted(penv):
    p = penv.provider
    h = p.launch(penv.request())
    penv.to_running(h)
    assert p.poll(h) is NodeState.RUNNING
    penv.preempt(h)
    assert p.poll(h) is NodeState.PREEMPTED
    assert p.list_owned("dtrun-ctest-") == []
    p.terminate(h)  # terminating what is already gone is fine


@pytest.mark.parametrize("code,state", [(0, NodeState.SUCCEEDED), (75, NodeState.PREEMPTED),
                                        (76, NodeState.PREEMPTED), (3, NodeState.FAILED)])
def test_exit_codes(penv, code, state):
    p = penv.provider
    h = p.launch(penv.request())
    penv.to_running(h)
    penv.exits(h, code)
    assert p.poll(h) is state
    p.terminate(h)
    assert p.poll(h) is state  # terminating a finished node keeps its outcome
    assert p.list_owned("dtrun-ctest-") == []


def test_capability_refusal_before_launch(penv):
    p = penv.provider
    caps = p.capabilities()
    o = penv.offer
    two_nodes = Requirements(o.gpu, o.gpus_per_node, nodes=2, spot=o.spot)
    spot = Requirements(o.gpu, o.gpus_per_node, nodes=1, spot=True)
    too_big = Requirements(o.gpu, caps.max_gpus_per_node + 1)
    for req, supported, what in ((two_nodes, caps.multi_node.supported, "multi-node"),
                                 (spot, caps.spot.supported, "spot"), (too_big, False, "GPUs per node")):
        reason = p.refuse(req)
        if supported:
            assert reason is None
            continue
        assert reason and what in reason, reason
        assert p.offers(req) == []
        bad_offer = Offer(o.provider, o.region, o.gpu, req.gpus_per_node, req.spot is True, o.price_per_gpu_hour)
        calls_before = len(getattr(penv.fake, "calls", []))
        with pytest.raises(perr.NotSupported, match=what):
            p.launch(penv.request(offer=bad_offer, nodes=req.nodes))
        assert len(getattr(penv.fake, "calls", [])) == calls_before  # nothing reached the cloud
    assert p.list_owned("dtrun-ctest-") == []


def test_declared_capabilities_have_reasons(penv):
    caps = penv.provider.capabilities()
    for c in (caps.spot, caps.multi_node, caps.stop):
        assert c.supported or c.reason


def test_known_capability_table(credentials, tmp_path):
    from providers.modal import ModalProvider
    from providers.skypilot import SkyPilotProvider

    from provider_fakes import FakeModalAPI, FakeSkyAPI

    rp = SkyPilotProvider("runpod", FakeSkyAPI(), home=tmp_path)
    lam = SkyPilotProvider("lambda", FakeSkyAPI(), home=tmp_path)
    vast = SkyPilotProvider("vast", FakeSkyAPI(), home=tmp_path)
    md = ModalProvider(FakeModalAPI(), home=tmp_path)
    assert "multi-node" in rp.refuse(Requirements("H100", 8, nodes=2))
    assert "spot" in lam.refuse(Requirements("H100", 8, spot=True))
    assert lam.refuse(Requirements("H100", 8, nodes=4)) is None
    assert rp.refuse(Requirements("H100", 8, spot=True)) is None
    assert vast.refuse(Requirements("H100", 8, spot=True)) is None
    assert "multi-node" in vast.refuse(Requirements("H100", 8, nodes=2))
    assert "multi-node" in md.refuse(Requirements("H100", 8, nodes=2))


# ---- errors: each provider's native failure → the dtrun hierarchy ------------------------------

def _sky_errors():
    import sky.exceptions as se

    return [
        ("launch", se.ResourcesUnavailableError("Failed to acquire resources in all zones"), perr.NoCapacity),
        ("launch", se.ResourcesUnavailableError("Quota exceeded for GPUs in region"), perr.QuotaExceeded),
        ("launch", se.InvalidCloudCredentials("RunPod API key is invalid"), perr.AuthError),
        ("launch", se.CloudUserIdentityError("cannot get user identity"), perr.AuthError),
        ("launch", se.ApiServerConnectionError("http://127.0.0.1:46580"), perr.Transient),
        ("launch", se.NotSupportedError("not supported"), perr.NotSupported),
        ("status", se.ApiServerConnectionError("http://127.0.0.1:46580"), perr.Transient),
        ("down", se.ApiServerConnectionError("http://127.0.0.1:46580"), perr.Transient),
        ("down", RuntimeError("Failed to tear down cluster"), perr.TerminateNotConfirmed),
    ]


def _modal_errors():
    """Modal: the fake control plane answers the RPC with a gRPC status; the real SDK turns it into
    its own exception (after its own retries for UNAVAILABLE/INTERNAL); the adapter maps that."""
    from grpclib import Status

    many = 8  # more than the SDK's own retries (3): the fault outlasts them
    return [
        ("create", ("SandboxCreate", Status.UNAUTHENTICATED, "Token missing", 1), perr.AuthError),
        ("create", ("SandboxCreate", Status.PERMISSION_DENIED, "not allowed", 1), perr.AuthError),
        ("create", ("SandboxCreate", Status.RESOURCE_EXHAUSTED, "workspace spending limit reached", 1),
         perr.QuotaExceeded),
        ("create", ("SandboxCreate", Status.RESOURCE_EXHAUSTED, "too many sandbox creations", 1), perr.Transient),
        ("create", ("SandboxCreate", Status.UNAVAILABLE, "connection dropped", many), perr.Transient),
        ("create", ("SandboxCreate", Status.INVALID_ARGUMENT, "bad gpu", 1), perr.NotSupported),
        ("create", ("AppGetOrCreate", Status.UNAVAILABLE, "connection dropped", many), perr.Transient),
        ("poll", ("SandboxWait", Status.INTERNAL, "boom", many), perr.Transient),
        ("terminate", ("SandboxTerminate", Status.UNAVAILABLE, "unavailable", many), perr.Transient),
    ]


@pytest.mark.parametrize("name", ["fake", "runpod", "lambda", "vast", "modal"])
def test_errors_map_to_the_hierarchy(name, tmp_path, credentials, monkeypatch):
    from provider_fakes import make_env

    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun-home"))
    env = make_env(name, tmp_path)
    p = env.provider
    if name == "fake":
        cases = [(op, kind, getattr(perr, kind)) for op in ("launch",)
                 for kind in ("NoCapacity", "QuotaExceeded", "AuthError", "Transient", "NotSupported")]
        cases += [("poll", "Transient", perr.Transient), ("terminate", "TerminateNotConfirmed", perr.TerminateNotConfirmed)]
    elif name == "modal":
        cases = _modal_errors()
    else:
        cases = _sky_errors()
    for op, native, expected in cases:
        h = None
        if op != "launch" and op != "create":
            h = p.launch(env.request())
            env.to_running(h)
        if name == "fake":
            env.fake.inject(op, native)
        elif name == "modal":
            env.fake.fail_next(*native[:3], times=native[3])
        else:
            env.fake.fail(op, native)
        with pytest.raises(expected) as ei:
            if op in ("launch", "create"):
                p.launch(env.request())
            elif op in ("poll", "status"):
                p.poll(h)
            else:
                p.terminate(h)
        assert type(ei.value) is expected, (op, native, ei.value)
        assert ei.value.provider == name
        if name == "modal":
            env.fake.script.fail.clear()
        if h is not None:
            p.terminate(h)


def test_missing_credentials_are_a_clear_error_without_secrets(tmp_path, monkeypatch):
    from providers.modal import ModalProvider
    from providers.skypilot import SkyPilotProvider

    from provider_fakes import FakeModalAPI, FakeSkyAPI

    monkeypatch.setenv("HOME", str(tmp_path))
    for v in ("RUNPOD_API_KEY", "VAST_API_KEY", "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_CONFIG_PATH"):
        monkeypatch.delenv(v, raising=False)
    expect = {"runpod": "~/.runpod/config.toml", "lambda": "~/.lambda_cloud/lambda_keys",
              "vast": "~/.config/vastai/vast_api_key"}
    for cloud, what in expect.items():
        api = FakeSkyAPI()
        p = SkyPilotProvider(cloud, api, home=tmp_path)
        with pytest.raises(perr.AuthError, match=re.escape(what)):
            p.check_credentials()
        offer = Offer(cloud, "any", "H100", 8, False, 2.5)
        from providers.base import LaunchRequest

        with pytest.raises(perr.AuthError):
            p.launch(LaunchRequest("j", 1, offer, 1, ["true"]))
        assert api.calls == []  # nothing rented
    md = ModalProvider(FakeModalAPI(), home=tmp_path)
    with pytest.raises(perr.AuthError, match="MODAL_TOKEN_ID"):
        md.check_credentials()
    # the message never contains a secret, even a partial one
    monkeypatch.setenv("MODAL_TOKEN_ID", "id-only-xyz")
    with pytest.raises(perr.AuthError) as ei:
        md.check_credentials()
    assert "id-only-xyz" not in str(ei.value)
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "s3cr3t")
    md.check_credentials()
    (tmp_path / ".runpod").mkdir()
    (tmp_path / ".runpod" / "config.toml").write_text('[default]\napi_key = "k"\n')
    SkyPilotProvider("runpod", FakeSkyAPI(), home=tmp_path).check_credentials()


def test_offers_come_from_the_price_catalog(credentials, tmp_path):
    from providers import registry

    req = Requirements("H100", 8, 1, "prefer")
    for name in ("runpod", "lambda", "vast", "modal"):
        offers = registry.get(name).offers(req)
        assert offers and all(o.provider == name and o.gpu in ("H100", "H100-SXM", "H100-PCIe")
                              and o.gpus_per_node == 8 for o in offers)
        if name in ("lambda", "modal"):
            assert not any(o.spot for o in offers)
    assert registry.get("lambda").offers(Requirements("H100", 8, spot=True)) == []
    assert registry.get("runpod").offers(Requirements("H100", 8, nodes=2)) == []
    local = registry.get("local").offers(Requirements("cpu", 2))
    assert [(o.provider, o.gpu, o.gpus_per_node, o.price_per_gpu_hour) for o in local] == [("local", "cpu", 2, 0.0)]
    assert registry.get("local").offers(req) == []

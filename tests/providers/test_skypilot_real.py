"""RunPod, Lambda and Vast checked against SkyPilot 0.14.1's own code, offline (issue 10).

Real catalog rows (``data/skypilot_catalogs``), SkyPilot's real optimizer, credential checks,
exception classes and client encode/decode; see ``skypilot_offline.py`` for how. No API
server is started and nothing reaches the network.
"""

from __future__ import annotations


import pytest
import yaml

from providers import errors as perr
from providers.base import LaunchRequest, NodeState, Requirements

from skypilot_offline import (SdkStandIn, cloud_not_enabled, enable_clouds, multi_region_unavailable,
                              optimize, seed_catalogs)

CLOUDS = ("runpod", "lambda", "vast")


@pytest.fixture
def sky_offline(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    seed_catalogs(home, monkeypatch)
    enable_clouds(monkeypatch)
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun-home"))
    return home


def _request(offer, nodes=1):
    return LaunchRequest(job="j", attempt=1, offer=offer, nodes=nodes, command=["python", "infra/node_bootstrap.py"],
                         env={"DTRUN_RUN_URI": "s3://b/j"})


# ---- every offer dtrun would launch passes SkyPilot's optimizer ------------------------------

CASES = [(c, g, n, regions) for c in CLOUDS
         for (g, n) in [("H100", 8), ("H100", 1), ("H100", 2), ("H100-SXM", 8), ("H100-PCIe", 1),
                        ("A100-80GB", 1), ("A100-80GB", 8), ("A100", 1)]
         for regions in [(), ("US",), ("EU",), ("CA",)]]


@pytest.mark.parametrize("cloud,gpu,count,regions", CASES,
                         ids=[f"{c}-{g}x{n}-{'-'.join(r) or 'any'}" for c, g, n, r in CASES])
def test_every_offer_passes_the_real_optimizer(sky_offline, cloud, gpu, count, regions):
    from providers.skypilot import SkyPilotProvider, build_task_config, sky_accelerator

    p = SkyPilotProvider(cloud)
    req = Requirements(gpu, count, spot="prefer", regions=regions)
    if p.refuse(req):
        assert regions and "selects none of its regions" in p.refuse(req)
        return
    for offer in p.offers(req):
        assert offer.gpu != "H100" or cloud == "vast" and offer.instance_type is None
        cfg = build_task_config(cloud, _request(offer))
        best = optimize(cfg)
        assert str(best.cloud).lower() == cloud
        assert best.accelerators == {sky_accelerator(cloud, offer.gpu, offer.instance_type): count}
        if offer.instance_type:
            assert best.instance_type == offer.instance_type
        if offer.regions:
            assert best.region == offer.regions[0]  # ordered: the cheapest allowed region first
            assert all(p.cloud and r for r in offer.regions)
        # The price SkyPilot computes is dtrun's (a zero catalog spot price is "unknown" to
        # dtrun and priced at on-demand: SkyPilot would call it free).
        sky_price = best.get_cost(3600) / count
        if offer.spot and sky_price == 0:
            assert "unknown" in offer.price_source
        else:
            assert sky_price == pytest.approx(offer.price_per_gpu_hour, abs=0.01)


def test_variants_are_the_cards_rented_and_estimated(sky_offline):
    from orchestrator.contract.gpus import GPUS
    from providers.skypilot import SkyPilotProvider, task_resources

    rp = {o.gpu: o for o in SkyPilotProvider("runpod").offers(Requirements("H100", 8))}
    # RunPod's H100 is the PCIe card; its SXM is H100-SXM — both offered, each at its own peak.
    assert task_resources("runpod", rp["H100-PCIe"])["accelerators"] == "H100:8"
    assert task_resources("runpod", rp["H100-SXM"])["accelerators"] == "H100-SXM:8"
    assert GPUS["H100-PCIe"].peak_bf16_flops == 756e12 and GPUS["H100-SXM"].peak_bf16_flops == 989e12
    (only_sxm,) = SkyPilotProvider("runpod").offers(Requirements("H100-SXM", 8))
    assert only_sxm.instance_type == "8x_H100-SXM_SECURE"
    lam = {o.gpu: o for o in SkyPilotProvider("lambda").offers(Requirements("H100", 1))}
    assert lam["H100-PCIe"].instance_type == "gpu_1x_h100_pcie"
    assert lam["H100-SXM"].instance_type == "gpu_1x_h100_sxm5"
    # Vast's "A100" is 40 GB SXM4 or 80 GB PCIe: told apart by the row's memory.
    (v80,) = SkyPilotProvider("vast").offers(Requirements("A100-80GB", 1))
    (v40,) = SkyPilotProvider("vast").offers(Requirements("A100", 1))
    assert (v80.instance_type, v40.instance_type) == ("1x-A100_PCIE-32-65536", "1x-A100_SXM4-32-65536")


def test_regions_are_skypilot_names_and_a_bad_one_lists_the_valid_ones(sky_offline):
    from providers.skypilot import SkyPilotProvider

    # `US` on Vast: there is no 8×H100 in the US in these rows — no offer (the real optimizer
    # used to place it in Vietnam), never a made-up region.
    assert SkyPilotProvider("vast").offers(Requirements("H100", 8, regions=("US",))) == []
    (o,) = SkyPilotProvider("lambda").offers(Requirements("H100", 8, regions=("us-east",)))
    assert o.regions == ("us-east-1", "us-east-2", "us-east-3")
    why = SkyPilotProvider("lambda").refuse(Requirements("H100", 8, regions=("Mars",)))
    assert "us-east-1" in why and "europe-central-1" in why and "Mars" in why


def test_a_region_skypilot_rejects_is_not_supported_not_a_retry(sky_offline):
    from providers.skypilot import map_sky_error

    with pytest.raises(ValueError) as ei:
        optimize({"resources": {"infra": "lambda/US", "accelerators": "H100:8"}})
    err = map_sky_error(ei.value, "lambda")
    assert isinstance(err, perr.NotSupported) and "Invalid region 'US'" in str(err)


# ---- dtrun export: only names SkyPilot's optimizer accepts -----------------------------------

@pytest.mark.parametrize("regions", [None, ["US"], ["EU"], ["us-east-1", "CA"]])
def test_export_candidates_pass_the_real_optimizer(sky_offline, tmp_path, capsys, regions):
    from orchestrator.cli.app import main

    job = tmp_path / "job.yaml"
    spec = {"name": "exp", "resources": {"providers": ["runpod", "lambda", "vast"], "gpu": "H100",
                                         "gpus_per_node": 8, "spot": "prefer"},
            "trainer": {"model": "gpt2-124m", "steps": 100, "batch_size": 16},
            "checkpoint": {"uri": "s3://b/{name}"}, "budget": {"max_usd": 100}}
    if regions:
        spec["resources"]["regions"] = regions
    job.write_text(yaml.safe_dump(spec))
    assert main(["export", str(job), "--skypilot"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    cands = cfg["resources"]["any_of"]
    assert cands
    for cand in cands:
        res = {k: v for k, v in cfg["resources"].items() if k != "any_of"}
        res.update(cand)
        best = optimize({"resources": res})
        assert str(best.cloud).lower() == cand["infra"].split("/")[0]
        if "/" in cand["infra"]:
            assert best.region == cand["infra"].split("/", 1)[1]
    infras = {c["infra"] for c in cands}
    assert "lambda/US" not in infras and "vast/US" not in infras


# ---- credentials: dtrun's offline check agrees with SkyPilot's -------------------------------

def _sky_says(cloud: str) -> bool:
    """SkyPilot's own offline credential check for ``cloud`` (its network step left out)."""
    import sky

    if cloud == "runpod":
        return sky.clouds.RunPod._check_runpod_credentials()[0]  # pylint: disable=protected-access
    if cloud == "lambda":
        from sky.provision.lambda_cloud import lambda_utils

        try:
            lambda_utils.LambdaCloudClient()
        except (AssertionError, KeyError, IndexError):
            return False
        return True
    return sky.clouds.Vast._check_compute_credentials()[0]  # pylint: disable=protected-access


KEYS = {"none": {}, "env-only": {}, "file": {}, "wrong": {}}


def _write_keys(home, case):
    if case == "file":
        (home / ".runpod").mkdir(parents=True, exist_ok=True)
        (home / ".runpod" / "config.toml").write_text('[default]\napi_key = "rp-k"\n')
        (home / ".lambda_cloud").mkdir(parents=True, exist_ok=True)
        (home / ".lambda_cloud" / "lambda_keys").write_text("api_key = l-k\n")
        (home / ".config" / "vastai").mkdir(parents=True, exist_ok=True)
        (home / ".config" / "vastai" / "vast_api_key").write_text("v-k\n")
    if case == "wrong":  # the key in the wrong shape: SkyPilot cannot read it
        (home / ".runpod").mkdir(parents=True, exist_ok=True)
        (home / ".runpod" / "config.toml").write_text('api_key = "rp-k"\n')  # no [default]
        (home / ".lambda_cloud").mkdir(parents=True, exist_ok=True)
        (home / ".lambda_cloud" / "lambda_keys").write_text("l-k\n")  # no `api_key = `


@pytest.mark.parametrize("case", list(KEYS))
def test_credentials_agree_with_skypilots_own_check(tmp_path, monkeypatch, case):
    from providers.skypilot import SkyPilotProvider, credentials

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for v in ("RUNPOD_API_KEY", "VAST_API_KEY", "LAMBDA_API_KEY"):
        monkeypatch.delenv(v, raising=False)
    if case == "env-only":
        monkeypatch.setenv("RUNPOD_API_KEY", "rp-secret-env-123")
        monkeypatch.setenv("VAST_API_KEY", "vast-secret-env-456")
        monkeypatch.setenv("LAMBDA_API_KEY", "lambda-secret-env-789")
    _write_keys(home, case)
    for cloud in CLOUDS:
        ours = credentials.problem(cloud) is None
        assert ours == _sky_says(cloud), (cloud, case, credentials.problem(cloud))
        if not ours:
            with pytest.raises(perr.AuthError) as ei:
                SkyPilotProvider(cloud).check_credentials()
            msg = str(ei.value)
            assert credentials.FILES[cloud] in msg
            assert "secret" not in msg
            if case == "env-only":
                assert "does not read it" in msg
    assert (case in ("file",)) == all(credentials.problem(c) is None for c in CLOUDS)


def test_only_lambda_keys_rents_lambda_and_lists_the_others_with_the_fix(sky_offline, tmp_path, capsys,
                                                                         monkeypatch):
    from orchestrator.cli.app import main

    (sky_offline / ".lambda_cloud").mkdir()
    (sky_offline / ".lambda_cloud" / "lambda_keys").write_text("api_key = l-k\n")
    monkeypatch.setenv("RUNPOD_API_KEY", "rp-secret-env-123")
    # the nodes' object store: placeholder AWS keys (the dry run checks that credentials exist)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAPLACEHOLDER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "placeholder")
    for v in ("VAST_API_KEY", "MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "no-modal.toml"))
    rc = main(["up", "jobs/gpt2-124m.yaml", "--dry-run", "--json"])
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["chosen"]["provider"] == "lambda"
    # lambda's offers first (rentable), the others after them, priced, each with its fix
    usable = [o["usable"] for o in out["offers"]]
    assert usable == sorted(usable, reverse=True) and out["usable"] is True
    assert {o["provider"] for o in out["offers"] if o["usable"]} == {"lambda"}
    assert all(o["fix"] == out["unusable"][o["provider"]] for o in out["offers"] if not o["usable"])
    assert set(out["unusable"]) >= {"runpod", "vast"}
    assert "~/.runpod/config.toml" in out["unusable"]["runpod"] and "runpod config" in out["unusable"]["runpod"]
    assert "RUNPOD_API_KEY is set, but SkyPilot does not read it" in out["unusable"]["runpod"]
    assert "~/.config/vastai/vast_api_key" in out["unusable"]["vast"]
    assert "rp-secret-env-123" not in str(out)
    assert rc in (0, 3)


def test_only_an_env_runpod_key_is_exit_5_naming_the_file_before_any_spend(sky_offline, tmp_path, capsys,
                                                                          monkeypatch):
    from orchestrator.cli.app import main

    job = tmp_path / "rp.yaml"
    job.write_text(yaml.safe_dump({
        "name": "rp", "resources": {"providers": ["runpod"], "gpu": "H100", "gpus_per_node": 8},
        "trainer": {"model": "gpt2-124m", "steps": 100, "batch_size": 16},
        "checkpoint": {"uri": "s3://b/{name}"}, "budget": {"max_usd": 500}}))
    monkeypatch.setenv("RUNPOD_API_KEY", "rp-secret-env-123")
    launched = []
    monkeypatch.setattr("providers.skypilot.SkyPilotProvider.launch", lambda self, r: launched.append(r))
    assert main(["up", str(job), "--yes"]) == 5
    err = capsys.readouterr().err
    assert "~/.runpod/config.toml" in err and "runpod config" in err and "nothing rented" in err
    assert "Traceback" not in err and "rp-secret-env-123" not in err
    assert launched == []
    assert main(["up", str(job), "--dry-run"]) == 5


# ---- errors: SkyPilot's classes, as its code raises them ------------------------------------

def test_error_table_names_skypilots_real_classes():
    from sky import exceptions

    from providers.skypilot import ERROR_TABLE

    for name, _target in ERROR_TABLE:
        assert isinstance(getattr(exceptions, name, None), type), name


def test_multi_region_unavailable_keeps_every_reason(sky_offline):
    from providers.skypilot import map_sky_error

    err = map_sky_error(multi_region_unavailable(), "runpod")
    assert isinstance(err, perr.QuotaExceeded)  # every region: quota or funds
    text = str(err)
    assert "quota exceeded" in text and "Insufficient funds" in text
    assert "runpod/US" in text.replace("RunPod/US", "runpod/US") or "US" in text
    assert "\x1b[" not in text


def test_cloud_not_enabled_is_an_auth_error_naming_the_file(sky_offline, monkeypatch):
    from providers.skypilot import map_sky_error

    enable_clouds(monkeypatch, ("lambda",))  # RunPod's check failed: only Lambda is enabled
    e = cloud_not_enabled("runpod")
    assert "sky check" in str(e)
    err = map_sky_error(e, "runpod")
    assert isinstance(err, perr.AuthError)
    assert "~/.runpod/config.toml" in str(err) and "\x1b[" not in str(err)


def test_other_skypilot_errors_map_by_class(sky_offline):
    from sky import exceptions

    from providers.skypilot import HALF_DEAD, map_sky_error

    cases = [
        (exceptions.ProvisionUnsupportedError("RunPod cannot attach a volume of this type"), perr.NotSupported),
        (exceptions.ResourcesUnavailableError(
            "no", failover_history=[exceptions.ProvisionUnsupportedError("unsupported shape")]), perr.NotSupported),
        (exceptions.CloudError("catalog fetch failed", "runpod", "HTTPError"), perr.Transient),
        (exceptions.ApiServerConnectionError("http://127.0.0.1:46580"), perr.Transient),
        (exceptions.NoCloudAccessError("Cloud access is not set up. Run: sky check"), perr.AuthError),
        (exceptions.InvalidCloudCredentials("bad key"), perr.AuthError),
        (exceptions.NotSupportedError("multi-node"), perr.NotSupported),
        (RuntimeError("SkyPilot API server process exited unexpectedly.\nView logs at: ~/.sky/api_server/server.log"),
         perr.Transient),
        (exceptions.ResourcesUnavailableError("Failed to acquire resources in all zones in US for RunPod"),
         perr.NoCapacity),
    ]
    for exc, want in cases:
        got = map_sky_error(exc, "runpod")
        assert type(got) is want, (exc, got)
    half = map_sky_error(cases[7][0], "runpod")
    assert "sky api stop" in str(half) and HALF_DEAD.split(".")[0] in str(half)


def test_every_skypilot_status_is_mapped():
    from sky.skylet import job_lib
    from sky.utils import status_lib

    from providers.skypilot import CLUSTER_STATES, JOB_STATES

    assert {s.value for s in job_lib.JobStatus} <= set(JOB_STATES)
    assert {s.value for s in status_lib.ClusterStatus} <= set(CLUSTER_STATES)


# ---- the real seam over SkyPilot's own records -----------------------------------------------

def test_adapter_over_skypilots_records(sky_offline, monkeypatch, credentials):
    from providers.skypilot import SkyPilotProvider

    sdk = SdkStandIn(monkeypatch)
    p = SkyPilotProvider("runpod")
    (offer, *_) = p.offers(Requirements("H100-SXM", 8, regions=("US", "CA")))
    h = p.launch(_request(offer))
    launch = next(c for c in sdk.calls if c[0] == "launch")[1]
    task = launch["task"]
    assert [str(r.region) for r in task.resources] == ["US", "CA"]  # ordered candidates, one launch
    assert launch["down"] is True and launch["retry_until_up"] is False
    # What SkyPilot says it launched, priced by SkyPilot (`dtrun cost` shows it beside the quote).
    import sky

    assert h.data["launched_price_per_hour"] == pytest.approx(
        sky.Resources(infra="runpod/US", instance_type="8x_H100-SXM_SECURE").get_cost(3600))
    assert p.poll(h) is NodeState.RUNNING
    c = sdk.clusters[h.name]
    c["status"] = "AUTOSTOPPING"
    c["jobs"] = {1: "SUCCEEDED"}
    assert p.poll(h) is NodeState.SUCCEEDED
    c["status"], c["jobs"] = "UP", {1: "FAILED"}
    sdk.logs[h.name] = "step 10\nDTRUN_EXIT_CODE=75\n"
    assert p.poll(h) is NodeState.PREEMPTED
    (owned,) = p.list_owned("dtrun-j-")
    assert owned.name == h.name
    p.terminate(h)
    assert p.list_owned("dtrun-j-") == []
    assert p.poll(h) is NodeState.PREEMPTED  # how its job ended, before dtrun took it down
    # A launch whose every region failed: one attempt, the reasons kept, no retry per region.
    sdk.fail("launch", multi_region_unavailable())
    with pytest.raises(perr.QuotaExceeded) as ei:
        p.launch(_request(offer))
    assert "Insufficient funds" in str(ei.value)
    assert sum(1 for c in sdk.calls if c[0] == "launch") == 2


def test_pending_cluster_is_pending(sky_offline, monkeypatch, credentials):
    from providers.skypilot import SkyPilotProvider

    sdk = SdkStandIn(monkeypatch)
    p = SkyPilotProvider("lambda")
    (offer,) = p.offers(Requirements("H100", 8))
    h = p.launch(_request(offer))
    sdk.clusters[h.name]["status"] = "PENDING"
    assert p.poll(h) is NodeState.PENDING


# ---- attempts count launches, not regions ----------------------------------------------------

def test_no_capacity_in_every_region_is_one_attempt_then_the_next_provider(sky_offline, monkeypatch, credentials,
                                                                           tmp_path):
    from orchestrator.plan.spec import parse_spec
    from orchestrator.run.clock import VirtualClock
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import StateStore
    from providers.skypilot import SkyPilotProvider

    sdk = SdkStandIn(monkeypatch)
    sdk.fail("launch", multi_region_unavailable())
    spec = parse_spec({
        "name": "fo", "resources": {"providers": ["runpod", "lambda"], "gpu": "H100-SXM", "gpus_per_node": 8,
                                    "regions": ["US", "CA", "us-east"]},
        "trainer": {"model": "tiny", "steps": 10, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "preflight": False}, "budget": {"max_usd": 1000},
        "recovery": {"poll_seconds": 30}})
    provs = {c: SkyPilotProvider(c) for c in ("runpod", "lambda")}
    monkeypatch.setattr("orchestrator.run.launching.ON_THIS_MACHINE", ("local", "fake", "runpod", "lambda"))
    c = Controller(spec, StateStore(tmp_path / "s.db"), clock=VirtualClock(), providers=provs, write_lease=False)
    c.start()
    for _ in range(4):
        c.tick()
        if c.state == "PROVISIONING" and c.store.nodes("fo", live_only=True):
            break
    atts = c.store.attempts("fo")
    assert [a["provider"] for a in atts] == ["runpod", "lambda"]
    assert atts[0]["outcome"] == "no_capacity"
    launches = [x for x in sdk.calls if x[0] == "launch"]
    assert len(launches) == 2
    assert [str(r.region) for r in launches[0][1]["task"].resources] == ["US", "CA"]


def test_dtrun_down_during_a_skypilot_launch_takes_the_cluster_down(sky_offline, monkeypatch, credentials, tmp_path):
    """The controller's generic in-flight cancel, on SkyPilot: the cluster SkyPilot lists in INIT
    while it provisions is found by name (``list_owned``) and taken down (``sky.down``)."""
    import threading

    from orchestrator.plan.spec import parse_spec
    from orchestrator.run.clock import VirtualClock
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import StateStore
    from providers.skypilot import SkyPilotProvider

    sdk = SdkStandIn(monkeypatch)
    sdk.hold_launch = threading.Event()
    spec = parse_spec({
        "name": "dn", "resources": {"providers": ["lambda"], "gpu": "H100", "gpus_per_node": 8},
        "trainer": {"model": "tiny", "steps": 10, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "preflight": False}, "budget": {"max_usd": 1000},
        "recovery": {"poll_seconds": 30}})
    monkeypatch.setattr("orchestrator.run.launching.ON_THIS_MACHINE", ("local", "fake", "lambda"))
    store = StateStore(tmp_path / "s.db")
    c = Controller(spec, store, clock=VirtualClock(), providers={"lambda": SkyPilotProvider("lambda")},
                   write_lease=False, launch_wait_seconds=0.05)
    ticks = []

    def on_tick(ctl):
        ticks.append(ctl.state)
        if len(ticks) == 2:
            assert ctl.inflight is not None and "dtrun-dn-a1" in sdk.clusters  # still provisioning
            store.request_action("dn", "stop")

    try:
        assert c.run(on_tick=on_tick) == "CANCELLED"
    finally:
        sdk.hold_launch.set()
    assert ("down", "dtrun-dn-a1") in sdk.calls and sdk.clusters == {}
    (node,) = store.nodes("dn")
    assert node["terminated_at"] is not None

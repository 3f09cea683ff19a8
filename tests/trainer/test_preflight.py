"""Restore preflight: fails fast and clearly on a missing bucket (moto over HTTP); a real round
trip (torchrun, 2 ranks, FSDP2 shards → same layout and resharded) passes against a real bucket."""

from __future__ import annotations

import time

import pytest

from orchestrator.contract.errors import EXIT_NOT_FOUND, EXIT_PROVIDER
from orchestrator.contract.storeprobe import classify
from orchestrator.plan.spec import parse_spec
from orchestrator.run.preflight import PreflightError, maybe_preflight, preflight_enabled, run_preflight, storage_probe


def spec(uri: str, spot=False, preflight=None):
    ck = {"uri": uri}
    if preflight is not None:
        ck["preflight"] = preflight
    return parse_spec({"name": "pf-test", "resources": {"providers": ["fake"], "gpu": "H100", "spot": spot},
                       "trainer": {"model": "tiny", "steps": 10}, "checkpoint": ck})


def test_missing_bucket_fails_fast_and_names_it(s3_server):
    s = spec("s3://dtrun-no-such-bucket-7/runs/{name}", spot=True)
    t0 = time.time()
    with pytest.raises(PreflightError) as ei:
        run_preflight(s)
    e = ei.value
    assert e.problem == "bucket" and e.exit_code == EXIT_NOT_FOUND
    assert "dtrun-no-such-bucket-7" in str(e) and "does not exist" in str(e)
    assert "\n" not in str(e)
    assert time.time() - t0 < 30  # the probe stage: no torch process started


def test_unreachable_endpoint_is_named(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(PreflightError) as ei:
        storage_probe("s3://some-bucket/run")
    assert ei.value.problem in ("endpoint", "storage")
    assert "s3://some-bucket/run" in str(ei.value)


def test_classify_credentials_and_bucket():
    from botocore.exceptions import ClientError, NoCredentialsError

    denied = ClientError({"Error": {"Code": "InvalidAccessKeyId", "Message": "The AWS Access Key Id you provided "
                                    "does not exist in our records."}}, "PutObject")
    assert classify(denied, "s3://b/run")[0] == "credentials"
    assert classify(NoCredentialsError(), "s3://b/run")[0] == "credentials"
    assert classify(PermissionError("Access Denied"), "s3://b/run")[0] == "credentials"
    nb = ClientError({"Error": {"Code": "NoSuchBucket", "Message": "The specified bucket does not exist"}}, "PutObject")
    problem, msg = classify(nb, "s3://b/run")
    assert problem == "bucket" and "'b'" in msg
    e = PreflightError("credentials", classify(denied, "s3://b/run")[1])
    assert e.exit_code == EXIT_PROVIDER and "AWS_ACCESS_KEY_ID" in str(e)
    assert "testing" not in str(e)  # no secret values in the message


def test_preflight_default_on_for_spot(tmp_path):
    assert preflight_enabled(spec("s3://b/r", spot=True))
    assert not preflight_enabled(spec("s3://b/r", spot=False))
    assert preflight_enabled(spec("s3://b/r", spot=False, preflight=True))
    assert not preflight_enabled(spec("s3://b/r", spot=True, preflight=False))
    assert maybe_preflight(spec("s3://b/r", spot=False)) is None  # skipped: nothing touched


@pytest.mark.slow
def test_round_trip_against_a_real_bucket(s3_bucket):
    from orchestrator.contract import runuri

    uri = f"{s3_bucket}/runs/pf"
    res = run_preflight(spec(uri, spot=True), nproc=2, timeout_s=240)
    assert res.ok and res.world_size == 2 and "resharded" in res.message
    # the preflight cleans up after itself
    assert runuri.list_dir(runuri.join(uri, "preflight")) == []


@pytest.mark.parametrize("bad_call,problem", [(1, "restore"), (2, "resharding")])
def test_a_restore_that_changes_values_is_reported(tmp_path, monkeypatch, bad_call, problem):
    """A checkpoint that does not restore to the saved values (DCP's load patched to perturb one
    tensor: in the same-layout restore, or in the resharded one) is reported as such, naming the
    tensor; the preflight folder is cleaned up."""
    import torch
    import torch.distributed.checkpoint as dcp

    from orchestrator.contract import runuri
    from trainer import preflight

    real_load = dcp.load
    calls = []

    def corrupting_load(state_dict, **kw):
        real_load(state_dict, **kw)
        calls.append(1)
        if len(calls) != bad_call:
            return
        first = next(iter(state_dict.values()))
        (first.to_local() if hasattr(first, "to_local") else first).add_(torch.ones_like(
            first.to_local() if hasattr(first, "to_local") else first))

    monkeypatch.setattr(dcp, "load", corrupting_load)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    uri = "file://" + str(tmp_path / "run")
    verdict = preflight.run(uri)
    assert not verdict["ok"] and verdict["problem"] == problem
    assert "model." in verdict["message"]
    assert runuri.list_dir(runuri.join(uri, "preflight")) == []

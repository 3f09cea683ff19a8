"""Shared fixtures: a real S3 API (moto server over HTTP on 127.0.0.1) and an isolated DTRUN_HOME.

The fakes every suite shares (the offline SkyPilot and Modal stand-ins, the scripted Modal control
plane, the torch-free node trainer) live in one place, ``tests/fakes/``, importable by name
(``from provider_fakes import ...``) from any test.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

FAKES = Path(__file__).resolve().parent / "fakes"
if str(FAKES) not in sys.path:
    sys.path.insert(0, str(FAKES))


@pytest.fixture(scope="session")
def _moto_server():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_server(_moto_server, monkeypatch):
    """The moto endpoint; AWS_* env points every client (boto3, s3fs, subprocesses) at it."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", _moto_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield _moto_server


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket; yields ``s3://<bucket>``."""
    import boto3

    name = f"dtrun-test-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1").create_bucket(Bucket=name)
    yield f"s3://{name}"


@pytest.fixture
def dtrun_home(tmp_path, monkeypatch):
    home = tmp_path / "dtrun-home"
    home.mkdir()
    monkeypatch.setenv("DTRUN_HOME", str(home))
    yield home


def write_provider_credentials(home, clouds=("runpod", "lambda", "vast")) -> None:
    """The files SkyPilot reads each cloud's key from, with placeholder keys, under ``home``."""
    if "runpod" in clouds:
        (home / ".runpod").mkdir(parents=True, exist_ok=True)
        (home / ".runpod" / "config.toml").write_text('[default]\napi_key = "rp-placeholder"\n')
    if "lambda" in clouds:
        (home / ".lambda_cloud").mkdir(parents=True, exist_ok=True)
        (home / ".lambda_cloud" / "lambda_keys").write_text("api_key = lambda-placeholder\n")
    if "vast" in clouds:
        (home / ".config" / "vastai").mkdir(parents=True, exist_ok=True)
        (home / ".config" / "vastai" / "vast_api_key").write_text("vast-placeholder\n")


@pytest.fixture
def provider_credentials(tmp_path, monkeypatch):
    """A HOME where every provider is usable (placeholder keys in the files SkyPilot reads, Modal
    tokens in the environment), so offers are not refused for missing credentials; and a
    placeholder AWS profile in ``~/.aws/credentials``, so an ``s3://`` job's dry run finds the
    object store's keys as a user who can rent would (variables, as ``s3_server`` sets, win)."""
    home = tmp_path / "user-home"
    home.mkdir(exist_ok=True)
    write_provider_credentials(home)
    (home / ".aws").mkdir(exist_ok=True)
    (home / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = AKIAPLACEHOLDER\naws_secret_access_key = placeholder\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-placeholder")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-placeholder")
    for v in ("RUNPOD_API_KEY", "VAST_API_KEY", "LAMBDA_API_KEY"):
        monkeypatch.delenv(v, raising=False)
    yield home

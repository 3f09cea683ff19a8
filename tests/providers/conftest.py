"""Provider test fixtures (the fakes live in tests/fakes/provider_fakes.py)."""

from __future__ import annotations

import os
import signal

import pytest

from provider_fakes import PROVIDERS, make_env


@pytest.fixture
def credentials(monkeypatch, tmp_path):
    """Provider credentials in their standard places, under a throwaway HOME (dummy values)."""
    home = tmp_path / "home"
    (home / ".lambda_cloud").mkdir(parents=True)
    (home / ".lambda_cloud" / "lambda_keys").write_text("api_key = dummy\n")
    (home / ".runpod").mkdir(parents=True)  # the files SkyPilot reads (not the env variables)
    (home / ".runpod" / "config.toml").write_text('[default]\napi_key = "dummy-runpod"\n')
    (home / ".config" / "vastai").mkdir(parents=True)
    (home / ".config" / "vastai" / "vast_api_key").write_text("dummy-vast\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RUNPOD_API_KEY", "dummy-runpod")
    monkeypatch.setenv("VAST_API_KEY", "dummy-vast")
    monkeypatch.setenv("MODAL_TOKEN_ID", "dummy-id")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "dummy-secret")
    monkeypatch.delenv("MODAL_CONFIG_PATH", raising=False)
    return home


@pytest.fixture(params=PROVIDERS)
def penv(request, tmp_path, credentials, monkeypatch):
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun-home"))
    env = make_env(request.param, tmp_path)
    yield env
    # never leave anything running
    if env.name == "local":
        for o in env.provider.list_owned():
            from providers.base import Handle

            rec = env.provider._record(Handle("local", o.name, o.instance_id))
            try:
                os.killpg(int(rec["pgid"]), signal.SIGKILL)
            except ProcessLookupError:
                pass

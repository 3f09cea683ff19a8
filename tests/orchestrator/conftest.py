"""Fixtures shared by the orchestrator tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A HOME with no provider credentials at all (a fresh machine): no key files, no Modal
    token, no provider variables, no SkyPilot catalog cache."""
    home = tmp_path / "bare-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(home / ".modal.toml"))
    for v in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "MODAL_PROFILE", "RUNPOD_API_KEY", "VAST_API_KEY",
              "LAMBDA_API_KEY"):
        monkeypatch.delenv(v, raising=False)
    return home

"""Start-up figures come from the price snapshot (sources and dates there, not constants in code);
the estimate, `dtrun simulate` and the traps use them; node images reach the launch request, the
SkyPilot task (validated by SkyPilot itself) and the Modal image."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.plan import estimate
from orchestrator.plan.spec import DEFAULT_NODE_IMAGE, parse_spec
from providers import catalog
from providers.base import Offer

ROOT = Path(__file__).resolve().parents[3]
RUNPOD = Offer("runpod", "any", "H100", 8, True, 2.0)


def spec(**res):
    return parse_spec({
        "name": "startup-job",
        "resources": {"providers": ["runpod"], "gpu": "H100", "gpus_per_node": 8, "spot": True, **res},
        "trainer": {"model": "gpt2-124m", "tokens": 1_000_000_000, "batch_size": 512, "seq_len": 1024,
                    "compile": True},
        "checkpoint": {"uri": "s3://b/{name}", "every_steps": 400},
    })


@pytest.fixture
def snapshot(monkeypatch):
    """A copy of the real snapshot the test may edit (catalog reads it through ``_snapshot``)."""
    data = copy.deepcopy(catalog._snapshot())
    monkeypatch.setattr(catalog, "_snapshot", lambda: data)
    return data


def test_every_provider_has_cited_dated_figures():
    for p in ("runpod", "vast", "lambda", "modal", "local", "fake"):
        f = catalog.startup_figures(p).to_dict()
        for k in ("provisioning", "setup_image", "setup_install", "first_step", "compile"):
            assert f[k]["minutes"] >= 0 and f[k]["source"] and re.match(r"\d{4}-\d{2}", f[k]["date"]), (p, k)
    # the code carries no start-up constants any more
    assert not hasattr(estimate, "STARTUP_MINUTES") and not hasattr(estimate, "COMPILE_MINUTES")


def test_changing_a_snapshot_figure_moves_the_estimate_and_the_simulation(snapshot):
    from orchestrator.run.simulate import prepare

    s = spec()
    before, _ = estimate.estimate_offer(s, RUNPOD)
    sim_before = prepare(s, plan=estimate.make_plan(s, offers=[RUNPOD])).model
    snapshot["startup"]["providers"]["runpod"]["provisioning"]["minutes"] += 30.0
    after, _ = estimate.estimate_offer(s, RUNPOD)
    sim_after = prepare(s, plan=estimate.make_plan(s, offers=[RUNPOD])).model
    assert after.breakdown["startup_hours"] == pytest.approx(before.breakdown["startup_hours"] + 0.5)
    assert after.expected_usd > before.expected_usd
    assert sim_after.provision_s == pytest.approx(sim_before.provision_s + 1800.0)
    snapshot["startup"]["compile"]["minutes"] = 7.0
    su = estimate.startup(s, RUNPOD)
    assert su["compile_minutes"] == 7.0 and "compile" in su["sources"]


def test_prebuilt_image_vs_reinstall_on_every_start():
    fast = estimate.startup(spec(), RUNPOD)
    slow = estimate.startup(spec(image="none"), RUNPOD)
    f = catalog.startup_figures("runpod")
    assert fast["prebuilt_image"] and not slow["prebuilt_image"]
    assert fast["setup_minutes"] == f.setup_image.minutes and slow["setup_minutes"] == f.setup_install.minutes
    assert slow["total_minutes"] - fast["total_minutes"] == pytest.approx(f.setup_install.minutes - f.setup_image.minutes)
    a, _ = estimate.estimate_offer(spec(), RUNPOD)
    b, _ = estimate.estimate_offer(spec(image="none"), RUNPOD)
    assert b.expected_usd > a.expected_usd
    # Lambda: no container, its VM's PyTorch counts as prebuilt
    lam = estimate.startup(spec(), Offer("lambda", "any", "H100", 8, False, 3.0))
    assert lam["prebuilt_image"] and lam["image"] is None


def test_startup_trap_fires_when_startup_is_over_10_percent_of_an_attempt():
    from orchestrator.plan.traps import find_traps

    short = find_traps(spec(), RUNPOD)  # ~4 min of compute per attempt at 0.2/h: start-up dominates
    assert any(t.code == "startup-dominates" and "of an attempt's expected length" in t.message for t in short)
    assert any("resources.image" in t.message for t in find_traps(spec(image="none"), RUNPOD)
               if t.code == "startup-dominates")
    long = parse_spec({**spec().model_dump(mode="json", exclude_none=True),
                       "trainer": {**spec().trainer.model_dump(mode="json", exclude_none=True),
                                   "tokens": 100_000_000_000}})
    od = Offer("runpod", "any", "H100", 8, False, 2.0)
    assert not any(t.code == "startup-dominates" for t in find_traps(long, od))


def test_default_image_matches_the_torch_pin():
    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"torch==([^"]+)"', text).group(1)
    assert DEFAULT_NODE_IMAGE.startswith(f"pytorch/pytorch:{pin}-cuda")


def _controller_request(tmp_path, provider, **res):
    from orchestrator.run.controller import Controller
    from orchestrator.run.state import StateStore

    s = parse_spec({**spec(**res).model_dump(mode="json", exclude_none=True),
                    "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 400}})
    c = Controller(s, StateStore(tmp_path / "s.db"))
    offer = Offer(provider, "any", "H100", 8, provider in ("runpod", "vast"), 2.0)
    return c.launcher.request(1, offer, str(tmp_path / "log"), 0.0, None)


@pytest.mark.parametrize("provider,image", [("runpod", DEFAULT_NODE_IMAGE), ("vast", DEFAULT_NODE_IMAGE),
                                            ("lambda", None)])
def test_node_image_reaches_the_skypilot_task(tmp_path, provider, image):
    from providers.skypilot import build_task_config
    from providers.skypilot.api import task_from_config

    req = _controller_request(tmp_path, provider)
    assert req.image == image
    cfg = build_task_config(provider, req)
    assert cfg["setup"] == "python infra/node_setup.py"
    (res,) = list(task_from_config(cfg).resources)  # SkyPilot's own validation
    if image:
        assert cfg["resources"]["image_id"] == f"docker:{image}"
        assert res.extract_docker_image() == image
    else:
        assert "image_id" not in cfg["resources"]


def test_own_image_and_none(tmp_path):
    from providers.skypilot import build_task_config

    assert _controller_request(tmp_path, "runpod", image="ghcr.io/me/train:1").image == "ghcr.io/me/train:1"
    req = _controller_request(tmp_path, "runpod", image="none")
    assert req.image is None and "image_id" not in build_task_config("runpod", req)["resources"]


def test_node_image_is_the_modal_base_image(tmp_path, monkeypatch):
    """The controller's request image becomes the Modal sandbox's base image (the real adapter's
    SandboxSpec, and the real SDK's lazy image built from that registry reference; no network)."""
    import modal

    from providers.modal import ModalProvider
    from providers.modal.api import ModalAPI, build_image

    mine = "nvcr.io/nvidia/pytorch:25.01-py3"
    req = _controller_request(tmp_path, "modal", image=mine)
    assert req.image == mine
    spec = ModalProvider(ModalAPI(), home=tmp_path).sandbox_spec(req)
    assert spec.base_image == mine
    seen = []
    real = modal.Image.from_registry
    monkeypatch.setattr(modal.Image, "from_registry",
                        staticmethod(lambda tag, *a, **kw: seen.append(tag) or real(tag, *a, **kw)))
    assert isinstance(build_image(None, spec.base_image), modal.Image) and seen == [mine]
    # default: Modal's own cached layered build (debian-slim + torch for its driver), no second torch
    for image in ("default", "none"):
        req = _controller_request(tmp_path, "modal", image=image)
        assert ModalProvider(ModalAPI(), home=tmp_path).sandbox_spec(req).base_image is None


def test_node_setup_installs_only_what_is_missing(tmp_path):
    """infra/node_setup.py, decision only (DTRUN_SETUP_DRY_RUN): the venv's torch matches the pin
    and is kept; a bare interpreter (a fresh venv without torch) gets the pinned torch."""
    import json
    import os

    env = dict(os.environ, DTRUN_SETUP_DRY_RUN="1")
    out = subprocess.run([sys.executable, str(ROOT / "infra" / "node_setup.py")], capture_output=True,
                         text=True, env=env, timeout=300)
    have = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0 and have["torch"].split("+")[0] == have["torch_pin"]
    assert not any(x.startswith("torch") for x in have["installed"])
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    env["DTRUN_SETUP_PYTHON"] = str(bare / "bin" / "python")
    out = subprocess.run([sys.executable, str(ROOT / "infra" / "node_setup.py")], capture_output=True,
                         text=True, env=env, timeout=300)
    need = json.loads(out.stdout.strip().splitlines()[-1])
    assert need["torch"] is None and f"torch=={need['torch_pin']}" in need["installed"]
    assert any(x.startswith("pydantic") for x in need["installed"])


def test_pip_cache_dir_reaches_the_node_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRUN_PIP_CACHE_DIR", "/workspace/pip-cache")
    assert _controller_request(tmp_path, "runpod").env["DTRUN_PIP_CACHE_DIR"] == "/workspace/pip-cache"
    monkeypatch.delenv("DTRUN_PIP_CACHE_DIR")
    assert "DTRUN_PIP_CACHE_DIR" not in _controller_request(tmp_path, "runpod").env

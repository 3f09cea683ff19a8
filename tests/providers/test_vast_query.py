"""dtrun's fix of SkyPilot 0.14.1's Vast offer search (providers/skypilot/vastquery.py), through
SkyPilot's own query builder (``sky.provision.vast.utils.launch``), the vastai 1.9.1 SDK's own
search and parser, and SkyPilot's own plugin loader; only the HTTP call that would reach Vast is
replaced (it records the query dict the SDK would POST to ``/api/v0/bundles/``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from providers.skypilot import vastquery

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def bundles_sent(monkeypatch):
    """What the SDK's search sends as its filters, each call; the search finds no offer."""
    import vastai.api.offers as offers
    import vastai.utils as vutils

    monkeypatch.setattr(vutils, "preprocess_search_query", vutils.preprocess_search_query)  # restored after
    monkeypatch.setenv("VAST_API_KEY", "k-test")
    sent: list[dict] = []

    def search(client, query=None, **kw):
        sent.append(dict(query or {}))
        return []

    monkeypatch.setattr(offers, "search_offers", search)
    return sent


def _skypilot_launch(gpu="H100_SXM", region="Texas, US, NA"):
    """SkyPilot's own Vast launch up to its offer search (which finds nothing here)."""
    from sky.provision.vast import utils as vutils

    with pytest.raises(RuntimeError, match="could not find an offer") as ei:
        vutils.launch(name="c-head", instance_type=f"1x-{gpu}-32-65536", region=region, disk_size=256,
                      image_name="img", ports=None, preemptible=True, secure_only=False)
    return str(ei.value).split('"', 1)[1].rsplit('"', 1)[0]  # the query string it says it sent


def test_the_sdks_pre_parser_drops_every_filter_skypilot_writes(bundles_sent):
    """The bug, pinned to vastai 1.9.1 (if a release fixes it, this says so): SkyPilot's search
    reaches Vast with none of its filters, so it rents the top offer of the whole market."""
    query = _skypilot_launch()
    assert 'gpu_name="H100 SXM"' in query and query.startswith("chunked=true georegion=true")
    [sent] = bundles_sent
    assert "gpu_name" not in sent and "num_gpus" not in sent and "geolocation" not in sent, sent


def test_with_dtruns_pre_parser_the_search_carries_skypilots_filters(bundles_sent):
    vastquery.install()
    _skypilot_launch()
    _skypilot_launch(gpu="RTX_4090", region="Ohio, US")
    h100, rtx = bundles_sent
    assert h100["gpu_name"] == {"eq": "H100 SXM"} and h100["num_gpus"] == {"eq": "1"}, h100
    assert h100["geolocation"] == {"in": ["CA", "US"]}  # georegion: NA → the SDK's own country list
    assert h100["disk_space"] == {"gte": "256"} and h100["cpu_ram"] == {"gte": 64000.0}, h100
    assert h100["verified"] == {"eq": True} and h100["rentable"] == {"eq": True}  # the SDK's defaults kept
    assert rtx["gpu_name"] == {"eq": "RTX 4090"} and rtx["geolocation"] == {"eq": "US"}, rtx


@pytest.mark.parametrize("query, expected", [
    ("gpu_name=RTX_4090 num_gpus=1", (False, False, "gpu_name=RTX_4090 num_gpus=1")),  # no directive: as is
    ('chunked=true gpu_name="A100 SXM4" num_gpus>=2', (False, True, 'gpu_name="A100 SXM4" num_gpus>=2')),
    ('georegion=true geolocation="EU" reliability>0.99', (True, False, "geolocation in [{EU}] reliability>0.99")),
    ("chunked=true geolocation notin [CN,RU]", (False, True, "geolocation notin [CN,RU]")),
    (None, (False, False, None)),
])
def test_pre_parser_cases(query, expected):
    from vastai.utils import _regions

    georegion, chunked, out = expected
    if out is not None:
        out = out.replace("{EU}", _regions["EU"])
    assert vastquery.preprocess_search_query(query) == (georegion, chunked, out)


def test_what_is_not_a_clause_is_left_to_the_sdk():
    from vastai.utils import preprocess_search_query as sdk

    for q in ('chunked=true gpu_name="unterminated', "chunked=true ?? num_gpus=1"):
        assert vastquery.clauses(q) is None
        assert vastquery.preprocess_search_query(q) == sdk(q)


def test_plugins_file_keeps_the_users_plugins_and_names_dtruns_once(tmp_path):
    user = tmp_path / "plugins.yaml"
    user.write_text(yaml.safe_dump({"controller_wheel_path": "/w", "plugins": [{"class": "acme.Auth",
                                                                               "parameters": {"x": 1}}]}))
    dest = tmp_path / "dtrun" / "skypilot" / "plugins.yaml"
    assert vastquery.plugins_config(dest, str(user)) == dest
    assert vastquery.plugins_config(dest, str(user)) == dest  # again: still once
    cfg = yaml.safe_load(dest.read_text())
    assert cfg == {"controller_wheel_path": "/w", "plugins": [{"class": "acme.Auth", "parameters": {"x": 1}},
                                                              {"class": vastquery.PLUGIN_CLASS}]}
    assert vastquery.plugins_config(dest, str(dest)) == dest  # the file it wrote as the source: no loop
    assert yaml.safe_load(dest.read_text())["plugins"][-1] == {"class": vastquery.PLUGIN_CLASS}


@pytest.mark.parametrize("text", ["plugins: [unclosed", "plugins: 3", "- a list"])
def test_a_users_plugins_file_dtrun_cannot_read_is_left_alone(tmp_path, text):
    user = tmp_path / "plugins.yaml"
    user.write_text(text)
    dest = tmp_path / "out.yaml"
    assert vastquery.plugins_config(dest, str(user)) is None
    assert not dest.exists()


def test_no_users_plugins_file(tmp_path, monkeypatch):
    monkeypatch.delenv(vastquery.PLUGINS_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    dest = vastquery.plugins_config(tmp_path / "out.yaml")
    assert yaml.safe_load(dest.read_text()) == {"plugins": [{"class": vastquery.PLUGIN_CLASS}]}


def _load_plugins_in(context: str, config: Path) -> str:
    code = ("from sky.server import plugins\n"
            f"plugins.load_plugins(plugins.ExtensionContext(context=plugins.PluginContext.{context}))\n"
            "import vastai.utils as u\n"
            "from providers.skypilot import vastquery\n"
            "print(u.preprocess_search_query is vastquery.preprocess_search_query)\n")
    env = {**os.environ, vastquery.PLUGINS_ENV: str(config), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_skypilots_plugin_loader_installs_it_in_request_executors_only(tmp_path):
    config = vastquery.plugins_config(tmp_path / "plugins.yaml", str(tmp_path / "none.yaml"))
    assert _load_plugins_in("EXECUTOR", config) == "True"
    assert _load_plugins_in("MAIN", config) == "False"

"""The dashboard's pages and JSON over a real fake-cloud job: what they show is the state's."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from orchestrator.dashboard.app import make_app
from orchestrator.dashboard.source import EmbeddedSource

TOKEN = "t0ken-for-tests"


@pytest.fixture
def client(finished):
    return TestClient(make_app(EmbeddedSource(finished.db), TOKEN))


@pytest.mark.parametrize("path", ["/", "/runs/fakejob", "/api/runs", "/api/runs/fakejob",
                                  "/static/dash.js", "/static/uPlot.iife.min.js"])
def test_every_endpoint_needs_the_token(client, path):
    assert client.get(path).status_code == 401
    assert client.get(path + "?token=wrong").status_code == 401
    assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get(path + f"?token={TOKEN}").status_code == 200
    assert client.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_stop_needs_the_token(client):
    assert client.post("/api/runs/fakejob/stop").status_code == 401


def test_runs_json_is_the_state(client, finished):
    runs = client.get(f"/api/runs?token={TOKEN}").json()["runs"]
    assert [r["name"] for r in runs] == ["fakejob"]
    r, job, store = runs[0], finished.store.get_job("fakejob"), finished.store
    assert r["state"] == "SUCCEEDED" and r["step"] == job["step"] == 1000 and r["steps"] == 1000
    assert r["spent_usd"] == pytest.approx(store.spend_total("fakejob"), abs=1e-4) and r["spent_usd"] > 0
    assert r["budget_usd"] == 100.0 and r["budget_frac"] == pytest.approx(r["spent_usd"] / 100.0, abs=1e-5)
    assert r["attempts"] == 2 and r["provider"] == "fake" and r["spot"] is True
    assert r["last_event"].startswith(store.events("fakejob")[-1]["type"])


def test_run_json_has_the_curves_timeline_and_nodes(client, finished):
    d = client.get(f"/api/runs/fakejob?token={TOKEN}").json()
    assert [a["outcome"] for a in d["timeline"]] == ["preempted", "succeeded"]
    a1, a2 = finished.store.attempts("fakejob")
    assert d["timeline"][0]["steps_lost"] == a1["end_step"] - a2["start_step"] >= 0
    assert d["train"] and d["train"][-1]["step"] == 1000 and d["train"][-1]["loss"] is not None
    assert len(d["nodes"]) == 2 and all(n["terminated_at"] for n in d["nodes"])
    assert d["spend_curve"]["usd"][-1] == pytest.approx(d["spent_usd"], rel=1e-3)
    assert d["quote_usd_per_hour"] is not None and d["booked_usd_per_hour"] is not None
    assert d["stoppable"] is False
    assert "spec_yaml" not in d and "handle" not in str(d["nodes"])


def test_pages_render_the_numbers_from_the_json(client):
    d = client.get(f"/api/runs/fakejob?token={TOKEN}").json()
    html = client.get(f"/?token={TOKEN}").text
    assert f'<span data-k="spent_usd">${d["spent_usd"]:.2f}</span>' in html
    assert '<span data-k="step">1000</span> / <span data-k="steps">1000</span>' in html
    page = client.get(f"/runs/fakejob?token={TOKEN}").text
    assert 'class="preempted" data-attempt="1"' in page and "uPlot.iife.min.js" in page
    assert f'<span data-k="attempts">2</span>' in page
    assert 'id=stop>' not in page  # finished: no Stop button


def test_unknown_run_is_404_and_names_it(client):
    r = client.get(f"/api/runs/nosuch?token={TOKEN}")
    assert r.status_code == 404 and "nosuch" in r.json()["detail"]
    assert client.get(f"/static/..%2Fapp.py?token={TOKEN}").status_code == 404


def test_stop_asks_the_running_controller(world):
    c = world.controller()
    c.start()
    world.tick_until(c, lambda: (world.store.get_job("fakejob")["step"] or 0) > 100)
    client = TestClient(make_app(EmbeddedSource(world.db), TOKEN))
    assert 'id=stop>' in client.get(f"/runs/fakejob?token={TOKEN}").text
    r = client.post(f"/api/runs/fakejob/stop?token={TOKEN}")
    assert r.status_code == 200 and "checkpoint and stop" in r.json()["message"]
    world.tick_until(c, lambda: world.store.get_job("fakejob")["state"] == "CANCELLED")
    assert [i for i in world.cloud.instances() if i.gone_at is None] == []


def test_500_runs_render_on_the_server(tmp_path):
    from orchestrator.run.state import StateStore

    store = StateStore(tmp_path / "state.db")
    for i in range(500):
        store.create_job(f"job-{i:03d}", "name: x\n", f"file://{tmp_path}/r{i}")
        store.update_job(f"job-{i:03d}", step=i, steps=1000, budget_usd=10.0)
    client = TestClient(make_app(EmbeddedSource(tmp_path / "state.db"), TOKEN))
    html = client.get(f"/?token={TOKEN}").text
    assert html.count("<tr data-run=") == 500 and '<span data-k="step">499</span>' in html

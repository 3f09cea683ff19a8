"""The dashboard mounted in ``dtrun server`` (``/dashboard``), on SQLite and real PostgreSQL, over jobs
submitted through the API and run by a real controller replica on the fake cloud: tokens (401
without, with a bad one, and in the URL; the sign-in cookie), team isolation (another team's run is
the same 404 as no run, Stop included), the numbers equal the API's, the team page's sums, Stop does
what ``POST /v1/jobs/{name}/down`` does; and the embedded team page and URL-quoted run names."""

from __future__ import annotations

from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from orchestrator.dashboard import pages
from orchestrator.server.dashboard_source import COOKIE

PATHS = ["/dashboard/", "/dashboard/runs/a-one", "/dashboard/team", "/dashboard/api/runs",
         "/dashboard/api/runs/a-one", "/dashboard/api/team", "/dashboard/static/dash.js"]


@pytest.fixture
def running(server_world):
    w = server_world
    w.tick(lambda: all(w.step(n) >= 100 for n in ("a-one", "a-two", "b-one")))
    return w


def test_every_dashboard_path_needs_a_valid_token_and_never_one_in_the_url(server_world):
    w, c = server_world, server_world.client
    for path in PATHS:
        assert c.get(path).status_code == 401, path
        assert c.get(path, headers={"Authorization": "Bearer dtr_wrong"}).status_code == 401, path
        r = c.get(f"{path}?token={w.tokens['ann']}")  # a URL token would land in the access log
        assert r.status_code == 401 and "sign in at /dashboard/login" in r.json()["error"], path
        assert c.get(path, headers=w.h("ann")).status_code == 200, path
    assert c.post("/dashboard/api/runs/a-one/stop").status_code == 401
    assert "Traceback" not in c.get("/dashboard/").text


def test_sign_in_sets_an_httponly_strict_cookie_and_a_bad_token_is_refused(server_world):
    w = server_world
    c = TestClient(w.app, raise_server_exceptions=False)
    assert 'type=password name=token' in c.get("/dashboard/login").text
    r = c.post("/dashboard/login", data={"token": "dtr_not-a-token"}, follow_redirects=False)
    assert r.status_code == 401 and "not valid" in r.text and COOKIE not in r.headers.get("set-cookie", "")
    r = c.post("/dashboard/login", data={"token": w.tokens["amy"]}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/"
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
    page = c.get("/dashboard/")  # the cookie now
    assert page.status_code == 200 and "a-one" in page.text and "b-one" not in page.text
    assert w.tokens["amy"] not in page.text  # links carry no token
    r = c.post("/dashboard/api/runs/a-two/stop", headers={"Origin": "https://evil.example"})
    assert r.status_code == 403 and "another site" in r.json()["error"]  # the cookie alone is not enough
    assert c.get("/v1/jobs/a-two", headers=w.h("amy")).json()["requested_action"] is None
    r = c.post("/dashboard/api/runs/a-two/stop", headers={"Origin": "http://testserver"})
    assert r.status_code == 200 and c.get("/v1/jobs/a-two", headers=w.h("amy")).json()["requested_action"] == "stop"
    r = c.post("/dashboard/logout", follow_redirects=False)
    assert r.status_code == 303
    c.cookies.clear()
    assert c.get("/dashboard/").status_code == 401


def test_a_member_sees_only_their_team_and_another_teams_run_is_the_404_of_no_run(running):
    w, c = running, running.client
    assert [r["name"] for r in c.get("/dashboard/api/runs", headers=w.h("bob")).json()["runs"]] == ["b-one"]
    assert {r["name"] for r in c.get("/dashboard/api/runs", headers=w.h("amy")).json()["runs"]} == {"a-one", "a-two"}
    for path in ("/dashboard/api/runs/{}", "/dashboard/runs/{}"):
        theirs, none = c.get(path.format("a-one"), headers=w.h("bob")), c.get(path.format("zz-none"), headers=w.h("bob"))
        assert theirs.status_code == none.status_code == 404
        assert theirs.json()["error"].replace("a-one", "X") == none.json()["error"].replace("zz-none", "X")
    r = c.post("/dashboard/api/runs/a-one/stop", headers=w.h("bob"))
    assert r.status_code == 404
    assert c.get("/v1/jobs/a-one", headers=w.h("ann")).json()["requested_action"] is None
    team = c.get("/dashboard/api/team", headers=w.h("bob")).json()
    assert team["team"] == "beta" and [r["name"] for r in team["runs"]] == ["b-one"]
    assert "a-one" not in c.get("/dashboard/team", headers=w.h("bob")).text


def test_the_numbers_shown_are_the_apis_and_the_controllers(running):
    w, c = running, running.client
    w.cloud.preempt("dtrun-a-one-a1")  # a spot reclaim: a second attempt on the timeline
    w.tick(lambda: (w.store.get_attempt("a-one", 2) or {}).get("state") == "RUNNING" and w.step("a-one") >= 200)
    api = {j["name"]: j for j in c.get("/v1/jobs", headers=w.h("ann")).json()["jobs"]}
    rows = {r["name"]: r for r in c.get("/dashboard/api/runs", headers=w.h("ann")).json()["runs"]}
    html = c.get("/dashboard/", headers=w.h("ann")).text
    for name in ("a-one", "a-two"):
        r, j, ctl = rows[name], api[name], w.store.get_job(name)
        assert r["spent_usd"] == pytest.approx(j["spend_usd"], abs=1e-4) and r["spent_usd"] > 0
        assert r["server_state"] == j["state"] == "running" and r["state"] == ctl["state"]
        assert r["step"] == ctl["step"] > 0 and r["steps"] == 2000 and r["budget_usd"] == 100.0
        assert r["tokens_per_s"] == ctl["tokens_per_s"] and r["provider"] == "fake" and r["spot"] is True
        assert f'<span data-k="spent_usd">{pages.fmt("spent_usd", r["spent_usd"])}</span>' in html
    assert rows["a-one"]["member"] == "ann" and rows["a-two"]["member"] == "amy"
    assert rows["a-one"]["attempts"] == 2 and rows["a-two"]["attempts"] == 1
    d = c.get("/dashboard/api/runs/a-one", headers=w.h("ann")).json()
    assert [a["outcome"] for a in d["timeline"]][:1] == ["preempted"] and len(d["nodes"]) == 2
    assert d["estimate_usd"] == pytest.approx(api["a-one"]["estimate_usd"]) and d["stoppable"] is True
    kinds = {e["type"] for e in d["events"]}
    assert "state" in kinds and "preempted" in kinds  # the server's events and the controller's
    assert d["spent_usd"] == pytest.approx(api["a-one"]["spend_usd"], abs=1e-4)


def test_team_page_sums_the_month_per_run_and_per_member(running):
    w, c = running, running.client
    api = c.get("/v1/cost/team", headers=w.h("amy")).json()
    t = c.get("/dashboard/api/team", headers=w.h("amy")).json()
    assert t["team"] == "alpha" and t["monthly_usd"] == api["monthly_usd"] == 500.0
    assert t["spent_usd"] == pytest.approx(api["spent_usd"]) and t["spent_usd"] > 0
    assert t["committed_usd"] == pytest.approx(api["committed_usd"]) and t["left_usd"] == pytest.approx(api["left_usd"])
    jobs = {j["name"]: j["spend_usd"] for j in c.get("/v1/jobs", headers=w.h("amy")).json()["jobs"]}
    assert {r["name"]: r["spent_usd"] for r in t["runs"]} == pytest.approx(jobs)
    members = {m["member"]: m for m in t["members"]}
    assert members["ann"]["spent_usd"] == pytest.approx(jobs["a-one"]) and members["ann"]["runs"] == 1
    assert members["amy"]["spent_usd"] == pytest.approx(jobs["a-two"])
    assert sum(m["spent_usd"] for m in t["members"]) == pytest.approx(t["spent_usd"], abs=1e-6)
    assert t["budget_frac"] == pytest.approx(t["spent_usd"] / 500.0)
    html = c.get("/dashboard/team", headers=w.h("amy")).text
    assert f'<span data-k="spent_usd">{pages.fmt("spent_usd", t["spent_usd"])}</span>' in html
    assert '<tr data-member="ann">' in html and 'href="/dashboard/runs/a-two"' in html
    assert 'id=team-link href="/dashboard/team"' in c.get("/dashboard/", headers=w.h("amy")).text


def test_stop_from_the_dashboard_is_the_apis_down(running):
    w, c = running, running.client
    r = c.post("/dashboard/api/runs/a-two/stop", headers=w.h("amy"))
    assert r.status_code == 200 and "checkpoint and stop" in r.json()["message"]
    assert c.get("/v1/jobs/a-two", headers=w.h("amy")).json()["requested_action"] == "stop"
    kinds = [e["kind"] for e in c.get("/v1/jobs/a-two/logs", headers=w.h("amy")).json()["events"]]
    assert kinds[-1] == "request"
    w.tick(lambda: c.get("/v1/jobs/a-two", headers=w.h("amy")).json()["state"] == "stopped")
    assert not [i for i in w.cloud.instances() if i.name.startswith("dtrun-a-two") and i.gone_at is None]
    d = c.get("/dashboard/api/runs/a-two", headers=w.h("amy")).json()
    assert d["stoppable"] is False and d["server_state"] == "stopped"
    assert "id=stop>" not in c.get("/dashboard/runs/a-two", headers=w.h("amy")).text
    assert "already stopped" in c.post("/dashboard/api/runs/a-two/stop", headers=w.h("amy")).json()["message"]


def test_a_queued_job_shows_the_servers_state(server_world):
    w, c = server_world, server_world.client  # no replica tick yet: nothing in the store
    d = c.get("/dashboard/api/runs/a-one", headers=w.h("ann")).json()
    assert d["state"] == "QUEUED" and d["server_state"] == "queued" and d["timeline"] == [] and d["step"] == 0


# ---- embedded (dtrun dashboard) ---------------------------------------------------------------

def test_embedded_team_page_is_this_stores_month_all_the_local_users(finished):
    import getpass

    from orchestrator.dashboard.app import make_app
    from orchestrator.dashboard.source import EmbeddedSource

    c = TestClient(make_app(EmbeddedSource(finished.db, now=finished.clock.now), "tok"))  # the job's (virtual) month
    t = c.get("/api/team?token=tok").json()
    spent = finished.store.spend_total("fakejob")
    assert t["monthly_usd"] is None and t["spent_usd"] == pytest.approx(spent) and spent > 0
    assert t["members"] == [{"member": getpass.getuser(), "runs": 1, "spent_usd": pytest.approx(spent)}]
    assert t["runs"][0]["name"] == "fakejob" and t["committed_usd"] == 0.0  # finished: nothing committed
    assert "team · this machine" in c.get("/team?token=tok").text


def test_run_names_are_url_quoted_in_links(world):
    from orchestrator.dashboard.app import make_app
    from orchestrator.dashboard.source import EmbeddedSource

    odd = "a b#c?d&e%f"  # an old store's name; job files allow only [a-z0-9-], and "/" cannot route
    world.store.create_job(odd, "name: x\n", f"file://{world.tmp}/odd")
    c = TestClient(make_app(EmbeddedSource(world.db), "tok"))
    html = c.get("/?token=tok").text
    href = f"/runs/{quote(odd, safe='')}?token=tok"
    assert f'href="{href.replace("&", "&amp;")}"' in html
    r = c.get(href)
    assert r.status_code == 200 and "a b#c?d&amp;e%f" in r.text
    assert c.get(f"/api/runs/{quote(odd, safe='')}?token=tok").json()["name"] == odd

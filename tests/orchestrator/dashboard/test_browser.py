"""The dashboard in a real browser (Debian's chromium, driven by selenium + chromium-driver) over a
job on the fake cloud: the pages load, the numbers shown equal the JSON's and the state's, a
preemption appears on the timeline within one poll, Stop stops the run, no token → 401; and the
comparison fails when a shown number is wrong (runs page and team page). Inside ``dtrun server``
(real PostgreSQL, a real controller replica): sign in with a token, the runs and the team page
show the API's numbers and follow them live, and a member cannot open another team's run. Screenshots go to the test's tmp dir (and, with
``DTRUN_DASHBOARD_SHOTS=DIR``, to DIR). Run by ``make e2e``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from orchestrator.dashboard import pages
from orchestrator.dashboard.app import make_app
from orchestrator.dashboard.source import EmbeddedSource

def _sibling_conftest():
    """This folder's conftest by path: ``from conftest import`` takes whichever conftest module
    another folder's tests imported first (tests/providers/conftest.py in some selections)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("dashboard_conftest", Path(__file__).with_name("conftest.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


write_metrics = _sibling_conftest().write_metrics

pytestmark = pytest.mark.e2e
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    pytest.skip("needs Debian's chromium and chromium-driver (make e2e installs them)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

TOKEN = "browser-test-token"
ONE_POLL = pages.POLL_MS / 1000 + 1.5  # a poll, plus the fetch and a redraw


class Served:
    """uvicorn on 127.0.0.1:<free port> in a thread; stopped (and joined) by ``close``."""

    def __init__(self, source=None, app=None) -> None:
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app or make_app(source, TOKEN), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/"

    def json(self, path: str, bearer: str | None = None) -> dict:
        if bearer:  # dtrun server: the token in the header, never in the URL
            req = urllib.request.Request(f"{self.url}{path}", headers={"Authorization": f"Bearer {bearer}"})
        else:
            req = urllib.request.Request(f"{self.url}{path}?token={TOKEN}")
        with urllib.request.urlopen(req) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def browser(tmp_path):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100",
              f"--user-data-dir={tmp_path / 'chrome'}"):
        opts.add_argument(a)
    d = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=DRIVER))
    try:
        yield d
    finally:
        d.quit()


@pytest.fixture
def shots(tmp_path):
    out = tmp_path / "screenshots"
    out.mkdir()
    yield out
    extra = os.environ.get("DTRUN_DASHBOARD_SHOTS")
    if extra:
        os.makedirs(extra, exist_ok=True)
        for p in out.iterdir():
            shutil.copy(p, extra)


def shown_equals_json(browser, row: dict, root_css: str) -> int:
    """Every ``data-k`` number under ``root_css`` equals ``pages.fmt`` of the JSON's value; returns
    how many were compared."""
    root = browser.find_element(By.CSS_SELECTOR, root_css)
    n = 0
    for el in root.find_elements(By.CSS_SELECTOR, "[data-k]"):
        k = el.get_attribute("data-k")
        if k in row:
            assert el.text == pages.fmt(k, row[k]), f"{root_css} [{k}] shows {el.text!r}, the JSON says {row[k]!r}"
            n += 1
    return n


def test_pages_preemption_and_stop_in_a_browser(world, browser, shots):
    c = world.controller()
    c.start()
    world.tick_until(c, lambda: (world.store.get_job("fakejob")["step"] or 0) >= 300)
    write_metrics(world.store.get_job("fakejob")["run_uri"], 300)
    srv = Served(EmbeddedSource(world.db))
    try:
        with pytest.raises(urllib.error.HTTPError) as e:  # no token → 401, for the browser's URL too
            urllib.request.urlopen(srv.url + "api/runs")
        assert e.value.code == 401
        browser.get(srv.url)
        assert "401" not in browser.title and "a valid token is needed" in browser.page_source
        browser.get(f"{srv.url}?token={TOKEN}")
        row = srv.json("api/runs")["runs"][0]
        assert row["state"] == "RUNNING" and row["spent_usd"] == pytest.approx(world.store.spend_total("fakejob"), abs=1e-3)
        assert shown_equals_json(browser, row, 'tr[data-run="fakejob"]') >= 8
        browser.save_screenshot(str(shots / "runs.png"))

        browser.find_element(By.LINK_TEXT, "fakejob").click()
        WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#loss .uplot"))
        d = srv.json("api/runs/fakejob")
        assert shown_equals_json(browser, d, "#facts") >= 12 and shown_equals_json(browser, d, "#money") == 2
        assert browser.find_elements(By.CSS_SELECTOR, "#spend .uplot") and browser.find_elements(By.CSS_SELECTOR, "#tps .uplot")
        assert not browser.find_elements(By.CSS_SELECTOR, "#timeline tr.preempted")

        world.cloud.preempt("dtrun-fakejob-a1")  # a spot reclaim on the fake cloud
        world.tick_until(c, lambda: (world.store.get_attempt("fakejob", 1) or {}).get("outcome") == "preempted")
        t0 = time.monotonic()
        WebDriverWait(browser, ONE_POLL, poll_frequency=0.1).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, '#timeline tr.preempted[data-attempt="1"]'))
        seen_after = time.monotonic() - t0
        assert seen_after <= ONE_POLL
        world.tick_until(c, lambda: (world.store.get_attempt("fakejob", 2) or {}).get("state") == "RUNNING"
                         and (world.store.get_job("fakejob")["step"] or 0) >= 400)
        WebDriverWait(browser, ONE_POLL).until(lambda d: d.find_elements(By.CSS_SELECTOR, '#timeline tr[data-attempt="2"]'))
        time.sleep(ONE_POLL)  # the facts caught up with the state the JSON gives now
        assert shown_equals_json(browser, srv.json("api/runs/fakejob"), "#facts") >= 12
        browser.save_screenshot(str(shots / "run.png"))

        browser.find_element(By.ID, "stop").click()
        alert = WebDriverWait(browser, 5).until(lambda d: d.switch_to.alert)
        assert "Stop fakejob?" in alert.text
        alert.accept()
        WebDriverWait(browser, 5).until(lambda d: "checkpoint and stop" in d.find_element(By.ID, "stopmsg").text)
        assert world.store.get_job("fakejob")["requested_action"] == "stop"
        world.tick_until(c, lambda: world.store.get_job("fakejob")["state"] == "CANCELLED")
        WebDriverWait(browser, ONE_POLL).until(
            lambda d: d.find_element(By.CSS_SELECTOR, '#facts [data-k="state"]').text == "CANCELLED")
        assert [i for i in world.cloud.instances() if i.gone_at is None] == []
        WebDriverWait(browser, ONE_POLL).until(lambda d: not d.find_elements(By.ID, "stop"))
        browser.save_screenshot(str(shots / "run-stopped.png"))
        print(f"preemption on the timeline {seen_after:.2f} s after the state had it (one poll: {ONE_POLL} s)")
    finally:
        srv.close()


class Misreporting:
    """A source whose spend is off by a cent: what a wrong number on the page looks like."""

    def __init__(self, real: EmbeddedSource) -> None:
        self.real = real

    def runs(self):
        return [dict(r, spent_usd=r["spent_usd"] + 0.01) for r in self.real.runs()]

    def run(self, name):
        return self.real.run(name)

    def stop(self, name):
        return self.real.stop(name)

    def team(self):
        t = self.real.team()
        return dict(t, members=[dict(m, spent_usd=m["spent_usd"] + 0.01) for m in t["members"]])


def test_the_comparison_catches_a_wrong_number(finished, browser, shots):
    """The check the test above relies on fails when the page shows a number the state does not have."""
    real = EmbeddedSource(finished.db)
    srv = Served(Misreporting(real))
    try:
        browser.get(f"{srv.url}?token={TOKEN}")
        truth = real.runs()[0]
        with pytest.raises(AssertionError, match=r"\[spent_usd\] shows"):
            shown_equals_json(browser, truth, 'tr[data-run="fakejob"]')
        browser.save_screenshot(str(shots / "runs-misreported.png"))
    finally:
        srv.close()


def test_the_team_page_comparison_catches_a_wrong_number(finished, browser, shots):
    """The team page's check fails when a member's spend on the page is not the source's."""
    real = EmbeddedSource(finished.db, now=finished.clock.now)
    srv = Served(Misreporting(real))
    try:
        browser.get(f"{srv.url}team?token={TOKEN}")
        truth = real.team()
        assert shown_equals_json(browser, truth, "#summary") >= 3  # the summary is right ...
        member = truth["members"][0]
        with pytest.raises(AssertionError, match=r"\[spent_usd\] shows"):  # ... the member's spend is not
            shown_equals_json(browser, member, f'#members tr[data-member="{member["member"]}"]')
    finally:
        srv.close()


def sign_in(browser, url: str, token: str) -> None:
    browser.get(f"{url}dashboard/login")
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.ID, "signin").click()
    WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#runs tbody tr"))


def test_server_dashboard_sign_in_team_page_and_isolation_in_a_browser(pg_server_world, browser, shots):
    w = pg_server_world
    w.tick(lambda: all(w.step(n) >= 100 for n in ("a-one", "a-two", "b-one")))
    write_metrics(w.store.get_job("a-one")["run_uri"], 100)
    srv = Served(app=w.app)
    amy = w.tokens["amy"]
    try:
        browser.get(f"{srv.url}dashboard/")  # no cookie yet
        assert "sign in at /dashboard/login" in browser.page_source
        sign_in(browser, srv.url, amy)
        assert amy not in browser.current_url and amy not in browser.page_source
        shown = {tr.get_attribute("data-run") for tr in browser.find_elements(By.CSS_SELECTOR, "#runs tbody tr")}
        assert shown == {"a-one", "a-two"}
        rows = {r["name"]: r for r in srv.json("dashboard/api/runs", bearer=amy)["runs"]}
        api = {j["name"]: j for j in srv.json("v1/jobs", bearer=amy)["jobs"]}
        assert rows["a-one"]["spent_usd"] == pytest.approx(api["a-one"]["spend_usd"], abs=1e-4)
        assert shown_equals_json(browser, rows["a-one"], 'tr[data-run="a-one"]') >= 8

        browser.find_element(By.ID, "team-link").click()
        WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#summary"))
        t = srv.json("dashboard/api/team", bearer=amy)
        assert t["spent_usd"] == pytest.approx(srv.json("v1/cost/team", bearer=amy)["spent_usd"])
        assert shown_equals_json(browser, t, "#summary") >= 5
        for m in t["members"]:
            assert shown_equals_json(browser, m, f'#members tr[data-member="{m["member"]}"]') == 2
        for r in t["runs"]:
            assert shown_equals_json(browser, r, f'#teamruns tr[data-run="{r["name"]}"]') >= 3
        w.tick(lambda: w.step("a-one") >= 300)  # the month moves on: the page follows within one poll
        new = srv.json("dashboard/api/team", bearer=amy)
        assert new["spent_usd"] > t["spent_usd"]
        want = pages.fmt("spent_usd", new["spent_usd"])
        WebDriverWait(browser, ONE_POLL + 1).until(
            lambda d: d.find_element(By.CSS_SELECTOR, '#summary [data-k="spent_usd"]').text == want)
        browser.save_screenshot(str(shots / "team.png"))

        browser.get(f"{srv.url}dashboard/runs/b-one")  # beta's run: the 404 of no run at all
        assert "no run named 'b-one'" in browser.page_source and "b-one" not in browser.title
        with pytest.raises(urllib.error.HTTPError) as e:
            srv.json("dashboard/api/runs/b-one", bearer=amy)
        assert e.value.code == 404
        browser.get(f"{srv.url}dashboard/runs/a-one")
        WebDriverWait(browser, 10).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#loss .uplot"))
        assert shown_equals_json(browser, srv.json("dashboard/api/runs/a-one", bearer=amy), "#facts") >= 12
        browser.save_screenshot(str(shots / "server-run.png"))
    finally:
        srv.close()

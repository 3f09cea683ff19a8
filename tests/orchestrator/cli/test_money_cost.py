"""`dtrun cost`: spend per job and per attempt from the state store, beside the estimate."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from orchestrator.cli.app import app, main
from orchestrator.run.state import StateStore
from providers.base import Offer

SPOT = Offer("fake", "fake-east", "H100", 8, True, 1.29)
OD = Offer("fake", "fake-west", "H100", 8, False, 2.89)


def _fill(store: StateStore) -> None:
    t0 = 1_700_000_000.0
    store.create_job("gpt", "name: gpt\n", "file:///r", providers=["fake"], budget_usd=100.0, steps=1000,
                     estimate={"hours": 3.0, "expected_usd": 40.0, "cost_usd": 48.0}, t=t0)
    for n, offer, secs, outcome, steps in ((1, SPOT, 3600.0, "preempted", (0, 400)),
                                           (2, OD, 1800.0, "succeeded", (400, 1000))):
        store.new_attempt("gpt", n, offer.to_dict(), "fake", t0, start_step=steps[0])
        store.update_attempt("gpt", n, state="ENDED", outcome=outcome, end_step=steps[1])
        store.open_spend("gpt", n, offer.price_per_hour, t0)
        store.book_spend("gpt", n, t0 + secs, close=True)
    store.set_state("gpt", "SUCCEEDED", "training finished", t=t0 + 5400)
    store.create_job("other", "name: other\n", "file:///o", providers=["fake"], t=t0)
    store.new_attempt("other", 1, SPOT.to_dict(), "fake", t0)
    store.open_spend("other", 1, SPOT.price_per_hour, t0)
    store.book_spend("other", 1, t0 + 360)  # still billing


def test_cost_json_per_attempt_and_estimate(dtrun_home):
    store = StateStore()
    _fill(store)
    r = CliRunner().invoke(app, ["cost", "gpt", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["name"] == "gpt" and d["state"] == "SUCCEEDED"
    a1, a2 = d["attempts"]
    assert a1["usd"] == round(1.29 * 8, 6) and a1["outcome"] == "preempted" and a1["offer"].endswith("/spot")
    assert a2["usd"] == round(2.89 * 8 * 0.5, 6) and (a2["start_step"], a2["end_step"]) == (400, 1000)
    assert d["cost_usd"] == round(1.29 * 8 + 2.89 * 4, 6)
    assert d["estimate_usd"] == 48.0 and d["expected_usd"] == 40.0 and d["budget_usd"] == 100.0
    assert d["actual_vs_expected"] == round(d["cost_usd"] / 40.0, 4)
    assert not d["billing_now"]


def test_cost_all_jobs_and_text(dtrun_home):
    store = StateStore()
    _fill(store)
    d = json.loads(CliRunner().invoke(app, ["cost", "--json"]).output)
    assert [j["name"] for j in d["jobs"]] == ["gpt", "other"]
    assert d["jobs"][1]["billing_now"] is True
    assert d["total_usd"] == round(d["jobs"][0]["cost_usd"] + d["jobs"][1]["cost_usd"], 6)
    r = CliRunner().invoke(app, ["cost"])
    assert r.exit_code == 0
    assert "gpt: SUCCEEDED" in r.output and "attempt   1" in r.output and "still billing" in r.output


def test_cost_unknown_job_is_one_line_exit_6(dtrun_home, capsys):
    StateStore()
    assert main(["cost", "nope"]) == 6
    err = capsys.readouterr().err
    assert "no job named 'nope'" in err and "Traceback" not in err


def test_cost_shows_the_quoted_price_beside_the_booked_one(dtrun_home):
    store = StateStore()
    _fill(store)
    d = json.loads(CliRunner().invoke(app, ["cost", "gpt", "--json"]).output)
    a1 = d["attempts"][0]
    assert a1["quoted"]["price_per_gpu_hour"] == SPOT.price_per_gpu_hour
    assert a1["quoted"]["price_per_hour"] == a1["price_per_hour"] == SPOT.price_per_hour
    assert a1["quoted"]["source"] == SPOT.price_source
    out = CliRunner().invoke(app, ["cost", "gpt"]).output
    assert f"quoted ${SPOT.price_per_gpu_hour:.2f}/GPU-h" in out and f"booked at ${SPOT.price_per_hour:.4f}/h" in out
    # What the provider says it launched (SkyPilot's launched resources, in the node's handle).
    from providers.base import Handle

    h = Handle("fake", "dtrun-gpt-a2", "i-2", data={"launched_price_per_hour": 23.5})
    store.add_node("gpt", 2, h.to_dict(), t=1_700_000_000.0)
    d = json.loads(CliRunner().invoke(app, ["cost", "gpt", "--json"]).output)
    assert d["attempts"][1]["launched_price_per_hour"] == 23.5 and d["attempts"][0]["launched_price_per_hour"] is None
    assert "the provider launched it at $23.5000/h" in CliRunner().invoke(app, ["cost", "gpt"]).output


def test_cost_json_names_each_attempts_teardown_window(dtrun_home):
    """dtrun books a node until the provider confirms it gone: ``teardown_s`` is the attempt's first
    terminate request → its last node confirmed gone (None while a node has not been torn down)."""
    from providers.base import Handle

    store = StateStore()
    _fill(store)
    t = 1_700_000_000.0
    ids = [store.add_node("gpt", 2, Handle("fake", f"dtrun-gpt-a2-{i}", f"i-{i}").to_dict(), t=t) for i in (1, 2)]
    d = json.loads(CliRunner().invoke(app, ["cost", "gpt", "--json"]).output)
    assert d["attempts"][1]["teardown_s"] is None
    store.update_node(ids[0], terminate_requested=t + 100.0, terminated_at=t + 103.5)
    store.update_node(ids[1], terminate_requested=t + 100.5, terminated_at=t + 107.25)
    d = json.loads(CliRunner().invoke(app, ["cost", "gpt", "--json"]).output)
    assert d["attempts"][1]["teardown_s"] == 7.25

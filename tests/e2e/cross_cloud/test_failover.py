"""Cross-cloud failover: the RunPod and Vast labs up at once, one SkyPilot API server that sees
both (``two_clouds``), a spot job with ``providers: [runpod, vast]`` on the one GPU both labs
sell (A100 80 GB: RunPod's ``1x_A100-80GB_SECURE``, Vast's ``1x-A100_PCIE``), through the real
dtrun CLI and SkyPilot 0.14.1.

Vast is the cheaper spot offer (dtrun's bid: the offers' ``min_bid``, 0.4 × $0.87; RunPod's:
0.6 × $1.39). The market is left with the A100 PCIE offers only (``a100_market``), then those go
too: Vast wholly out of capacity (the Vast suite shows the search renting the GPU asked for).

Vast out of capacity (every offer off the market) → attempt 1 on Vast ends ``no_capacity``
(nothing rented, nothing billed: ``dtrun status --json``'s ``attempt_list`` says so, ``dtrun
cost`` books nothing), attempt 2 runs on RunPod and SUCCEEDS; its booking vs the pod's bill.
Not here yet: a job outbid on Vast mid-run resuming on RunPod (the checkpoint's S3 would have to
be reached from both labs' bridges).

Afterwards nothing is left in either lab (each lab fixture also checks namespaces, veths, bridges,
processes, mounts at the end of the session)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.clouds.runpodlab import lab as rlab
from tests.e2e.clouds.vastlab import api as vapi
from tests.e2e.clouds.vastlab import lab as vlab
from tests.e2e.cross_cloud import conftest as cc
from tests.e2e.lambda_cloud.conftest import dtrun, dtrun_up_to_success
from tests.e2e.runpod_cloud.conftest import job_yaml as rp_job_yaml
from tests.e2e.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

VAST_GPU = "A100 PCIE"  # Vast's gpu_name of 1x-A100_PCIE-32-65536 (80 GB)


def job_yaml(tmp_path, name: str, uri: str, steps: int, every: int = 10):
    """The RunPod suite's job file (A100 80 GB spot, one CPU rank) offered to both clouds."""
    p = rp_job_yaml(tmp_path, name, uri, steps=steps, every=every)
    p.write_text(p.read_text().replace("providers: [runpod]", "providers: [runpod, vast]"))
    return p


def _vast_gpus() -> list[str]:
    return sorted({o["gpu_name"] for o in vapi.market(vlab.home() / ".sky" / "catalogs" / "v8" / "vast" / "vms.csv")})


@pytest.fixture
def a100_market(two_clouds, tmp_path):
    """Vast's market with the A100 PCIE offers only, dtrun's live Vast prices fetched from it into
    the combined HOME (SkyPilot's ``fetch_vast`` + dtrun's bid search: the bid dtrun passes);
    afterwards the market and the combined HOME's catalogs as the labs started them."""
    others = [g for g in _vast_gpus() if g != VAST_GPU]
    for g in others:
        vlab.call("capacity", {"gpu": g, "on": False})
    try:
        # Vast only: RunPod's lab prices are its catalog's (a RunPod refresh would replace them)
        r = cc.run_py("from providers.skypilot import prices; import json; "
                      "print(json.dumps([x.message for x in prices.refresh(['vast'])]))",
                      {**two_clouds, "DTRUN_HOME": str(tmp_path / "dtrun-home")})
        assert "vast: " in r and "refresh failed" not in r, r
        yield others
    finally:
        for g in _vast_gpus():
            vlab.call("capacity", {"gpu": g, "on": True})
        cc.write_home()


def _quotes(env) -> dict[str, float]:
    """dtrun's cheapest spot quote per cloud for one A100 80 GB ($/h), as ``dtrun prices`` shows it."""
    rows = json.loads(dtrun(["prices", "A100-80GB", "--spot", "--json"], env).stdout)["prices"]
    out: dict[str, float] = {}
    for r in rows:
        if r["gpus_per_node"] == 1 and r["spot"] and r["price_known"] and r["provider"] in ("runpod", "vast"):
            out[r["provider"]] = min(r["price_per_gpu_hour"], out.get(r["provider"], r["price_per_gpu_hour"]))
    return out


def _vast_rows(name: str) -> list[dict]:
    return [b for b in vlab.call("bill")["instances"] if (b["label"] or "").startswith(f"dtrun-{name}-")]


def _runpod_rows(name: str) -> list[dict]:
    return sorted([b for b in rlab.call("bill")["pods"] if b["name"].startswith(f"dtrun-{name}-")],
                  key=lambda b: b["start"])


def _money(attempt: dict, billed: float, price: float, requested_at: float) -> float:
    """The lab tests' money rule: never under the bill (-5 %), at most 5 % over it plus what dtrun
    books before the cloud's request (SkyPilot's optimizer, its wheel build) and one poll; returns
    those pre-request seconds."""
    booked_start = attempt["booked_until"] - attempt["seconds"]
    pre = max(0.0, requested_at - booked_start)
    assert attempt["usd"] >= 0.95 * billed, (attempt, billed)
    assert attempt["usd"] <= 1.05 * billed + (pre + 5) * price / 3600, (attempt, billed, pre)
    return pre


def _nothing_left(name: str) -> None:
    wait_until(lambda: not [p for p in rlab.call("status")["pods"] if p["name"].startswith(f"dtrun-{name}-")]
               and not [i for i in vlab.call("status")["instances"] if (i["label"] or "").startswith(f"dtrun-{name}-")],
               120, "a lab still lists a machine of the job")
    assert not any(b["billing"] for b in _vast_rows(name)), _vast_rows(name)


def test_cheaper_cloud_out_of_capacity_runs_on_the_other(two_clouds, rp_s3, a100_market, tmp_path):
    env = {**two_clouds, **rp_s3["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name, steps = "xc-cap", 30
    (tmp_path / "dtrun-home").mkdir(exist_ok=True)
    q = _quotes(env)
    assert set(q) == {"runpod", "vast"} and q["vast"] < q["runpod"], q  # Vast first in dtrun's ranking
    vlab.call("capacity", {"gpu": VAST_GPU, "on": False})  # Vast: nothing on the market at all
    job = job_yaml(tmp_path, name, f"s3://{rp_s3['bucket']}/{{name}}", steps=steps)
    st, took = dtrun_up_to_success(job, env)
    # every attempt, billed or not (`dtrun cost` lists the booked ones only)
    tried = [(a["provider"], a["outcome"]) for a in st["attempt_list"]]
    assert tried == [("vast", "no_capacity"), ("runpod", "succeeded")], st["attempt_list"]
    cost = json.loads(dtrun(["cost", name, "--json"], env).stdout)
    booked = {a["attempt"]: a for a in cost["attempts"]}
    assert booked.get(1, {"usd": 0})["usd"] == 0, booked  # nothing rented on Vast, nothing booked
    attempts = [booked.get(1, {"attempt": 1, "provider": "vast", "outcome": "no_capacity", "usd": 0.0}), booked[2]]
    assert json.loads(rp_s3["get"](f"{name}/DONE"))["step"] == steps
    assert _vast_rows(name) == [], _vast_rows(name)  # and nothing billed on Vast
    [pod] = _runpod_rows(name)
    assert pod["how"] == "terminated" and pod["price_per_hour"] == pytest.approx(q["runpod"], abs=1e-3), pod
    pre = _money(attempts[1], pod["usd"], pod["price_per_hour"], pod["start"])
    _nothing_left(name)
    print(f"\nVast out of capacity → RunPod: dtrun up → SUCCEEDED in {took:.0f} s; quotes {q}; attempts "
          f"{[(a['provider'], a['outcome'], round(a['usd'], 5)) for a in attempts]}; RunPod bill ${pod['usd']:.5f} "
          f"({pod['seconds']:.0f} s at ${pod['price_per_hour']}/h) vs dtrun ${attempts[1]['usd']:.5f} "
          f"(booked {pre:.0f} s before the pod request); Vast bill: none; reason of attempt 1: "
          f"{(st['attempt_list'][0]['reason'] or '')[:300]!r}")

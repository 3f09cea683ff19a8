"""A dtrun spot job on the Vast lab, through the real dtrun CLI and SkyPilot 0.14.1's API server
(started with ``VAST_URL``): dtrun's live prices from the lab (SkyPilot's ``fetch_vast`` + dtrun's
bid search), its quoted bid passed as ``vast.create_instance_kwargs.price``, an interruptible
instance at that bid, the rented instance read back (:mod:`providers.skypilot.vastcheck`), the
job SUCCEEDED and the bill against ``dtrun cost``.

The market is left whole, with an RTX 4090 as its top offer: SkyPilot 0.14.1's own search carries
no GPU filter (the vastai SDK's pre-parser drops its quoted values), so it would rent that; the API
server dtrun starts loads dtrun's plugin (providers/skypilot/vastquery.py), the search carries
SkyPilot's filters, and the H100 SXM the job asked for is rented. Had the RTX 4090 been rented,
dtrun's read-back would destroy it and refuse the offer (tests/providers/test_vast_rented.py):
the job would not succeed."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e import phases as phaselib
from tests.e2e.clouds.vastlab import api as vapi
from tests.e2e.clouds.vastlab import lab as lablib
from tests.e2e.lambda_cloud.conftest import dtrun, dtrun_up_running, dtrun_up_to_success
from tests.e2e.vast_cloud.conftest import job_yaml, live_vast_prices

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

GPU = "H100 SXM"


@pytest.fixture
def whole_market(vs_lab):
    """The lab's market as it started, whose top offer (after the SDK's chunking) is not the job's
    GPU; afterwards the offers an outbid left to the higher bidder given back (the outbid test takes
    one of the two H100 SXM machines of a row) and the lab HOME's SkyPilot catalog (``dtrun prices
    --refresh`` rewrites it) as the lab started them."""
    assert vapi.TOP_GPU != GPU and not lablib.call("status")["no_capacity"]
    try:
        yield
    finally:
        print(f"vast market: offers taken by higher bidders {lablib.call('status')['taken_offers']}, given back")
        lablib.call("release", {})
        lablib.write_home()


def test_dtrun_spot_on_vast_at_its_bid_on_the_gpu_it_quoted(vs_lab, vs_s3, whole_market, tmp_path):
    env = {**vs_lab, **vs_s3["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name, steps = "vs-ok", 30
    prices = live_vast_prices(env)  # dtrun's bid from the lab
    job = job_yaml(tmp_path, name, f"s3://{vs_s3['bucket']}/{{name}}", steps=steps, every=10)
    st, took = dtrun_up_to_success(job, env)
    assert json.loads(vs_s3["get"](f"{name}/DONE"))["step"] == steps
    rows = [b for b in lablib.call("bill")["instances"] if (b["label"] or "").startswith(f"dtrun-{name}-")]
    assert len(rows) == 1, rows
    [b] = rows
    cost = json.loads(dtrun(["cost", name, "--json"], env).stdout)
    quoted = [(a["attempt"], a["outcome"], a["usd"]) for a in cost["attempts"]]
    # an interruptible bid at the price dtrun quoted, on the GPU it quoted, destroyed at the end
    assert b["interruptible"] and b["gpu_name"] == GPU and b["num_gpus"] == 1, b
    assert b["how"] == "destroyed" and not b["billing"], b
    bid = b["price_per_hour"]
    assert bid == pytest.approx(0.4 * 1.87, abs=1e-3), b  # the H100 SXM offers' min_bid: dtrun's bid rule
    print(f"dtrun up → SUCCEEDED in {took:.0f} s; Vast lab bill ${b['usd']:.5f} (compute ${b['compute_usd']:.5f} at "
          f"${bid}/h for {b['running_seconds']:.0f} s, storage ${b['storage_usd']:.6f} for {b['disk_gb']:.0f} GB "
          f"over {b['exists_seconds']:.0f} s); dtrun cost ${cost['cost_usd']:.5f}; attempts {quoted}; "
          f"prices refreshed: {str(prices)[:300]}")
    # the Lambda lab's money rule (tests/e2e/lambda_cloud/conftest.py check_money): never under the
    # bill (-5 %), at most 5 % over it plus what dtrun books before the instance request (SkyPilot's
    # optimizer, its wheel build) and one poll; the bill here includes Vast's storage, which dtrun
    # does not price (256 GB, SkyPilot's default disk: $0.05/h at $0.15/GB-month)
    [a] = [a for a in cost["attempts"] if a["provider"] == "vast"]
    booked_start = a["booked_until"] - a["seconds"]
    pre_usd = max(0.0, b["created"] - booked_start) * bid / 3600
    assert a["usd"] >= 0.95 * b["usd"], (a, b)
    assert a["usd"] <= 1.05 * b["usd"] + pre_usd + 5 / 3600 * bid, (a, b, pre_usd)
    print(f"dtrun booked {max(0.0, b['created'] - booked_start):.0f} s before the instance request; storage is "
          f"{b['storage_usd'] / b['usd']:.1%} of the bill")


def test_dtrun_spot_on_vast_outbid_resumes_bit_identical(vs_lab, vs_s3, whole_market, tmp_path):
    """Outbid mid-run: the instance stopped without notice (``exited``, storage still billing);
    SkyPilot's refresh says STOPPED, dtrun calls it a preemption, destroys the stopped instance
    (not left billing storage), rents the next H100 SXM at its bid and resumes from the newest
    COMMITTED step, ending bit-identical to an uninterrupted local run."""
    from tests.e2e.waiting import wait_until

    env = {**vs_lab, **vs_s3["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name, steps = "vs-pre", 80
    live_vast_prices(env)  # dtrun's bid from the lab
    job = job_yaml(tmp_path, name, f"s3://{vs_s3['bucket']}/{{name}}", steps=steps, every=10)

    def progress() -> dict:
        try:
            return json.loads(vs_s3["get"](f"{name}/progress.json"))
        except Exception:  # noqa: BLE001 - not there yet
            return {}

    def mine() -> list[dict]:
        return [i for i in lablib.call("status")["instances"] if (i["label"] or "").startswith(f"dtrun-{name}-")]

    with dtrun_up_running(job, env) as proc:
        wait_until(lambda: int(progress().get("step") or 0) >= 20 or proc.poll() is not None, 1200,
                   "no step 20 on the Vast lab instance")
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        [i] = mine()
        assert i["is_bid"] and i["gpu_name"] == GPU, i
        t_out, t_wall = time.monotonic(), time.time()
        watch = phaselib.ProgressWatch(vs_s3["get"], name).__enter__()
        assert lablib.call("outbid", {"name": i["label"]})["outbid"] == [i["label"]]
        # dtrun destroys the stopped instance (it would bill storage for as long as it exists)
        wait_until(lambda: not [j for j in mine() if j["id"] == i["id"]], 300,
                   "the outbid instance of attempt 1 is still listed")
        destroyed = time.monotonic() - t_out
        wait_until(lambda: progress().get("attempt", 1) >= 2 and progress().get("step"), 1200,
                   "no step from a second attempt")
        resumed = time.monotonic() - t_out
        wait_until(lambda: 2 in watch.stepped or proc.poll() is not None, 600, "no second step of attempt 2")
        watch.__exit__()
        out, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, out[-4000:]
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "SUCCEEDED" and st["attempts_total"] == 2, st
    cost = json.loads(dtrun(["cost", name, "--json"], env).stdout)
    outcomes = [a["outcome"] for a in sorted(cost["attempts"], key=lambda a: a["attempt"])]
    assert outcomes == ["preempted", "succeeded"], cost["attempts"]
    rows = sorted([b for b in lablib.call("bill")["instances"] if (b["label"] or "").startswith(f"dtrun-{name}-")],
                  key=lambda b: b["created"])
    assert [r["how"] for r in rows] == ["outbid", "destroyed"] and not any(r["billing"] for r in rows), rows
    assert all(r["interruptible"] and r["gpu_name"] == GPU for r in rows), rows
    assert rows[0]["offer"] != rows[1]["offer"], rows  # the outbid machine went to the higher bidder
    ph = phaselib.phases(env["DTRUN_HOME"], name, t_wall, watch, env["HOME"], instance_start=rows[1]["created"])
    phaselib.report("vast", ph)
    assert set(phaselib.REQUIRED) <= set(ph["marks"]), ph  # every phase was seen on the lab
    assert list(ph["marks"].values()) == sorted(ph["marks"].values()), ph  # in the order the design says
    done = json.loads(vs_s3["get"](f"{name}/DONE"))
    assert done["step"] == steps

    local = job_yaml(tmp_path, "vs-pre-local", f"file://{tmp_path}/local-run", steps=steps, every=10, local=True)
    # one CPU thread, as on the instance (its job runs with OMP_NUM_THREADS=1; see the RunPod lab's test)
    dtrun(["up", str(local), "--yes"], {**env, "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}, timeout=900)
    ref = json.loads((tmp_path / "local-run" / "DONE").read_text())
    assert done["param_digest"] == ref["param_digest"], (done, ref)
    stopped_storage = rows[0]["exists_seconds"] - rows[0]["running_seconds"]
    print(f"outbid → the stopped instance destroyed by dtrun {destroyed:.0f} s later (storage billed {stopped_storage:.0f} s "
          f"while stopped); → a step of attempt 2 {resumed:.0f} s; bills {[round(r['usd'], 5) for r in rows]}, "
          f"dtrun cost ${cost['cost_usd']:.5f}")

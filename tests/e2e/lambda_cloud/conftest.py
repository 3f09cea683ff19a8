"""The Lambda lab for the e2e suite: started once per session, stopped at the end (also after a
failure), and the suite fails if anything of it is left (namespace, veth, bridge, process, mount).

Where the lab cannot run (not root, no namespaces, no sshd), every test here FAILS with one line
saying why: never a silent skip."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.clouds.lambdalab import lab as lablib
from tests.e2e.waiting import wait_until

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def lab():
    why = lablib.preflight()
    if why:
        pytest.fail(f"Lambda lab cannot run here: {why}", pytrace=False)
    lablib.stop(log=lambda m: None)  # whatever an earlier crashed run left
    env = lablib.start(log=print)
    try:
        yield {**os.environ, **env, "PYTHONPATH": f"{env['PYTHONPATH']}:{REPO}"}
    finally:
        left = lablib.stop(log=print)
        assert not any(left.values()), f"the lab left: {left}"


def sh(cmd: list[str], env: dict, timeout: float = 900, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}")
    return p


@pytest.fixture(scope="session")
def s3_lab(lab):
    """moto S3 bound to the bridge's host IP (the nodes reach it there; nothing else does)."""
    import uuid

    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address=lab["DTRUN_LAB_HOST_IP"], port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    bucket = f"lab-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)

    def exists(key: str) -> bool:
        return s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount", 0) > 0

    def get(key: str) -> bytes:
        return s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    def keys(prefix: str) -> list[str]:
        return [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
                for o in p.get("Contents", [])]

    try:
        yield {"env": env, "bucket": bucket, "url": url, "exists": exists, "get": get, "keys": keys}
    finally:
        server.stop()


def dtrun(args: list[str], env: dict, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    return sh([sys.executable, "-m", "orchestrator.cli.app", *args], env, timeout=timeout, check=check, cwd=REPO)


JOB = """\
name: {name}
resources:
  providers: [{provider}]
  gpu: H100-SXM
  gpus_per_node: 2
  nodes: {nodes}
trainer:
  model: tiny
  device: cpu  # the lab's nodes have no GPU: CPU ranks on the H100-labelled node, said explicitly
  parallel: {{dp_shard: {dp}, tp: 1}}
  steps: {steps}
  batch_size: 8
  seq_len: 64
  data: synthetic
  precision: fp32
  lr: 0.003
  warmup_steps: 5
  log_every: 5
  heartbeat_seconds: 1
checkpoint:
  uri: {uri}
  every_steps: {every}
  keep: 2
budget:
  max_usd: 30.0
  max_hours: 1
teardown:
  idle_minutes: 10
recovery:
  poll_seconds: 5
  heartbeat_timeout_seconds: 600
  backoff_seconds: 1
"""


def job_yaml(tmp_path, name: str, bucket: str, steps: int = 30, every: int = 10, nodes: int = 1,
             provider: str = "lambda", uri: str | None = None) -> Path:
    p = tmp_path / f"{name}.yaml"
    p.write_text(JOB.format(name=name, provider=provider, nodes=nodes, dp=2 * nodes, steps=steps, every=every,
                            uri=uri or f"s3://{bucket}/{{name}}"))
    return p


DETECT_TICKS = 3
"""A preemption is seen within this many poll intervals (check_money): the loop starts a tick every
interval (orchestrator/run/loop.py), but the end can fall in a tick after its status query returned,
and each tick's SkyPilot status refresh and queue take seconds on a loaded host: measured 4.3–6.3 s on
idle labs, 9.5 s and 10.9 s in .ci/run (2 cores, the e2e suites serial) at a 5 s poll."""


def check_money(cost: dict, bill_rows: list[dict], poll_seconds: float = 5.0, provider: str = "lambda") -> None:
    """`dtrun cost` against the lab's bill, attempt by attempt (an attempt of N nodes is N bill
    rows): never less than the cloud billed (-5 %), and no more than 5 % over it plus what dtrun books
    on purpose beyond the cloud's bill: the seconds until dtrun saw the attempt end (it books until
    the poll that sees it; bounded here by ``DETECT_TICKS`` poll intervals, asserted on its own),
    each instance's seconds between dtrun's launch call and its request (SkyPilot's optimizer, its
    wheel build), which dtrun cannot see; for a node lost before the rest of its cluster, the seconds
    until the attempt ended (an attempt is booked as N nodes until it ends); and the attempt's
    teardown (``teardown_s``: dtrun's first terminate request → the provider confirming the last node
    gone; a preempted node stopped billing before it, and SkyPilot's ``down`` takes seconds on a
    loaded host)."""
    import re

    by_attempt: dict[int, list[dict]] = {}
    for b in bill_rows:
        by_attempt.setdefault(int(re.search(r"-a(\d+)-", b["name"]).group(1)), []).append(b)
    attempts = {a["attempt"]: a for a in cost["attempts"] if a["provider"] == provider}
    assert set(by_attempt) <= set(attempts), (attempts, bill_rows)
    # an attempt that never reached the cloud (e.g. SkyPilot's API server did not start) has no
    # bill row: dtrun books it anyway (conservative); it is reported, not compared
    detect_s = DETECT_TICKS * poll_seconds
    for n in sorted(by_attempt):
        a, rows = attempts[n], by_attempt[n]
        booked_start = a["booked_until"] - a["seconds"]
        billed = sum(r["usd"] for r in rows)
        price = sum(r["price_per_hour"] for r in rows)
        pre_usd = sum(max(0.0, r["start"] - booked_start) * r["price_per_hour"] for r in rows) / 3600
        last = max(r["end"] for r in rows)
        early_usd = sum((last - r["end"]) * r["price_per_hour"] for r in rows) / 3600
        teardown = a.get("teardown_s") or 0.0
        # dtrun's first terminate request came this long after the cloud stopped billing (a
        # preemption it had to notice; <= 0 when dtrun ended the attempt itself)
        seen_after = a["booked_until"] - teardown - last
        assert seen_after <= detect_s, \
            f"attempt {n}: dtrun saw its end {seen_after:.1f} s after the bill ended (bound {detect_s:.0f} s)"
        assert a["usd"] >= 0.95 * billed, (a, rows)
        teardown_usd = teardown * price / 3600
        assert a["usd"] <= 1.05 * billed + pre_usd + early_usd + teardown_usd + detect_s / 3600 * price, \
            (a, rows, pre_usd)
        pre = max(0.0, min(r["start"] for r in rows) - booked_start)
        print(f"attempt {a['attempt']}: dtrun ${a['usd']:.4f} ({a['seconds']:.0f} s), lab ${billed:.4f} "
              f"({len(rows)} instance(s), {max(r['seconds'] for r in rows):.0f} s), booked before the "
              f"instance request {pre:.0f} s, seen {max(0.0, seen_after):.1f} s after the bill ended, "
              f"teardown {teardown:.1f} s")


def progress(s3_lab, name: str) -> dict:
    """The job's ``progress.json`` in the run URI ({} before the trainer wrote one)."""
    try:
        return json.loads(s3_lab["get"](f"{name}/progress.json"))
    except Exception:  # noqa: BLE001 - not there yet
        return {}


def step(s3_lab, name: str) -> int:
    return int(progress(s3_lab, name).get("step") or 0)


def wait_for_next_attempt(s3_lab, name: str, timeout: float) -> None:
    """Until a step of attempt 2 or later is in the run URI."""
    wait_until(lambda: progress(s3_lab, name).get("attempt", 1) >= 2 and progress(s3_lab, name).get("step"),
               timeout, "no step from a second attempt")


@contextlib.contextmanager
def dtrun_up_running(job: Path, env: dict):
    """``dtrun up JOB --yes`` in the background, in its own session: if the test leaves early, the
    controller is SIGKILLed with everything it started."""
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.app", "up", str(job), "--yes"], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def dtrun_up_to_success(job: Path, env: dict, timeout: float = 1500) -> tuple[dict, float]:
    """``dtrun up JOB --yes`` to its end: it exited 0 and ``dtrun status --json`` says SUCCEEDED.
    Returns that status and the seconds ``dtrun up`` took."""
    t0 = time.monotonic()
    with dtrun_up_running(job, env) as proc:
        out, _ = proc.communicate(timeout=timeout)
    took = time.monotonic() - t0
    assert proc.returncode == 0, out[-5000:]
    st = json.loads(dtrun(["status", job.stem, "--json"], env).stdout)
    assert st["state"] == "SUCCEEDED", st
    return st, took

"""The Vast e2e suite's job file (the lab fixtures vs_lab, vs_s3 live in tests/e2e/conftest.py, so
one session starts the lab at most once and a test may use two labs)."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


JOB = """\
name: {name}
resources:
  providers: [vast]
  gpu: H100-SXM
  gpus_per_node: 1
  nodes: 1
  spot: true
trainer:
  model: tiny
  device: cpu  # the lab's instances have no GPU: a CPU rank on the H100-labelled instance, said explicitly
  parallel: {{dp_shard: 1, tp: 1}}
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
  heartbeat_timeout_seconds: 60
  backoff_seconds: 1
"""


def job_yaml(tmp_path, name: str, uri: str, steps: int, every: int, local: bool = False) -> Path:
    p = tmp_path / f"{name}.yaml"
    text = JOB.format(name=name, steps=steps, every=every, uri=uri)
    if local:
        text = (text.replace("providers: [vast]", "providers: [local]").replace("gpu: H100-SXM", "gpu: cpu")
                .replace("  spot: true\n", ""))
    p.write_text(text)
    return p


def live_vast_prices(env: dict, gpu: str = "H100") -> dict:
    """``dtrun prices GPU --refresh --spot --json`` against the lab (SkyPilot's ``fetch_vast`` + dtrun's
    bid search: the bid dtrun passes); once more if it brought no live Vast spot price for ``gpu``
    (a fetch that timed out on a loaded host leaves the bundled snapshot, which has no Vast spot
    prices). Fails naming what each refresh said."""
    from tests.e2e.lambda_cloud.conftest import dtrun

    said = []
    for _ in range(2):
        out = json.loads(dtrun(["prices", gpu, "--refresh", "--spot", "--json"], env, timeout=600).stdout)
        said.append([r for r in out["refresh"] if r["cloud"] == "vast"])
        if any(r["provider"] == "vast" and r["spot"] and r["price_known"] for r in out["prices"]):
            return out
    raise AssertionError(f"no live Vast spot price for {gpu} after two refreshes: {said}")

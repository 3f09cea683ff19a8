"""The Vast lab for the e2e suite: started once per session, stopped at the end (also after a
failure), and the suite fails if anything of it is left (namespace, veth, bridge, process, mount).

Where the lab cannot run (not root, no namespaces, no sshd), every test here FAILS with one line
saying why: never a silent skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.clouds.vastlab import lab as lablib
from tests.e2e.s3lab import moto_bucket

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def vs_lab():
    why = lablib.preflight()
    if why:
        pytest.fail(f"Vast lab cannot run here: {why}", pytrace=False)
    lablib.stop(log=lambda m: None)  # whatever an earlier crashed run left
    env = lablib.start(log=print)
    try:
        yield {**os.environ, **env, "PYTHONPATH": str(REPO)}
    finally:
        left = lablib.stop(log=print)
        assert not any(left.values()), f"the Vast lab left: {left}"


@pytest.fixture(scope="session")
def vs_s3(vs_lab):
    """moto S3 bound to the Vast bridge's host IP (the instances reach it there; nothing else does)."""
    from tests.e2e.clouds.vastlab import machine

    with moto_bucket(machine.NET.host_ip, "vslab") as s3:
        yield s3


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

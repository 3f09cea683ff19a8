"""Units of the first-GPU-run review (issue 25) that CPU can show: no silent CPU fallback, the
collective timeouts, Python 3.10's futures TimeoutError."""

from __future__ import annotations

import concurrent.futures
import os
import time
from concurrent.futures import Future
from pathlib import Path
from datetime import timedelta
from types import SimpleNamespace

import pytest

from trainer.errors import ConfigError


class _Py310TimeoutError(Exception):
    """concurrent.futures.TimeoutError as Python 3.10 defines it: not the builtin TimeoutError."""


class _Stuck(Future):
    def result(self, timeout=None):
        raise concurrent.futures.TimeoutError()

    def done(self):
        return False


def test_abandon_fires_with_python_310_futures_timeout(tmp_path, monkeypatch):
    """On 3.10 ``fut.result(timeout)`` raises concurrent.futures.TimeoutError, which ``except
    TimeoutError`` does not catch: the in-flight upload was then logged as failed instead of
    abandoned, and the exit fast path never ran."""
    from trainer.checkpoint import CheckpointManager

    monkeypatch.setattr(concurrent.futures, "TimeoutError", _Py310TimeoutError)
    ck = CheckpointManager(f"file://{tmp_path}", keep=2, async_mode="async", rank=0, world_size=1, dp_rank=0,
                           describe={})
    try:
        ck._pending = (3, _Stuck(), {}, time.perf_counter())
        assert ck.wait(timeout=0.01) is False  # still running: stays pending
        ck.settle(timeout=0.01)
        assert ck.abandoned == 3
    finally:
        ck._pending = None
        ck.close()


def test_default_timeout_of_the_mixed_backend_is_30_minutes():
    """Why the trainer passes its own: torch gives "cpu:gloo,cuda:nccl" gloo's 30 minutes."""
    from torch.distributed.distributed_c10d import Backend, _get_default_timeout

    assert _get_default_timeout(Backend("cpu:gloo,cuda:nccl")) == timedelta(minutes=30)


def _spec(gpu: str, timeout: float = 600.0, device: str = "auto"):
    return SimpleNamespace(resources=SimpleNamespace(gpu=gpu),
                           trainer=SimpleNamespace(collective_timeout_seconds=timeout, device=device))


def test_gpu_spec_without_cuda_is_refused(monkeypatch):
    import torch

    from trainer.distenv import select_device

    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build (CI's torch is the CPU one)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not usable.*nvidia-smi"):
        select_device(_spec("H100"), 0)
    assert select_device(_spec("cpu"), 0).type == "cpu"


def test_trainer_device_cpu_is_the_explicit_way_to_train_on_cpu_on_a_gpu_node(monkeypatch):
    """The refusal is for a silent fallback; ``trainer.device: cpu`` says it out loud (smoke runs of
    the launch path, the emulated clouds' GPU-less nodes) and is the only way past it."""
    import torch

    from orchestrator.plan.spec import JobSpec
    from trainer.distenv import select_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device(_spec("H100", device="cpu"), 0).type == "cpu"
    spec = JobSpec.model_validate({"name": "smoke", "resources": {"providers": ["lambda"], "gpu": "A10"},
                                   "trainer": {"device": "cpu", "steps": 4}})
    assert spec.trainer.device == "cpu"
    with pytest.raises(ConfigError):
        select_device(spec.model_copy(update={"trainer": spec.trainer.model_copy(update={"device": "auto"})}), 0)


def test_fewer_gpus_than_local_ranks_is_refused(monkeypatch):
    import torch

    from trainer.distenv import select_device

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match="8 ranks on this node but only 4 GPU"):
        select_device(_spec("H100"), 0)


def test_cpu_build_is_refused():
    from trainer.distenv import cuda_problem

    fake = SimpleNamespace(__version__="2.13.0+cpu", version=SimpleNamespace(cuda=None),
                           cuda=SimpleNamespace(is_available=lambda: False, device_count=lambda: 0))
    assert "CPU-only build" in cuda_problem("H100", 8, fake)


def test_trainer_exits_2_when_a_gpu_job_finds_no_cuda(tmp_path, monkeypatch, capsys):
    """The whole trainer (one process, no torchrun): a GPU job on a node without usable CUDA is
    refused with one line and exit 2, not trained on CPU."""
    import torch
    import yaml

    from trainer.train import main

    spec = {"name": "gpu-nocuda", "resources": {"providers": ["lambda"], "gpu": "H100", "gpus_per_node": 1},
            "trainer": {"model": "tiny", "steps": 2, "batch_size": 2, "seq_len": 16},
            "checkpoint": {"uri": f"file://{tmp_path}/run"}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--job", str(job)]) == 2
    err = capsys.readouterr().err
    assert "resources.gpu is H100 but CUDA is not usable" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "progress.json").exists()  # nothing trained


def test_peer_lost_classification():
    import torch.distributed as dist

    from trainer.distenv import peer_lost

    assert peer_lost(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                  "waiting 6000ms for recv operation to complete"))
    assert peer_lost(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"))
    assert peer_lost(dist.DistBackendError("NCCL error"))
    assert not peer_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not peer_lost(ValueError("x"))


def test_failed_saves_in_a_row_stop_the_run(tmp_path, monkeypatch):
    """Two failures go on (training continues, the next interval tries again); a commit resets the
    count; MAX_FAILED_SAVES in a row stop the attempt (exit 1) instead of hours without a
    checkpoint."""
    import torch

    from trainer import checkpoint
    from trainer.checkpoint import MAX_FAILED_SAVES, CheckpointManager
    from trainer.errors import SavesFailing

    real = checkpoint.dcp.save
    broken = {"on": True}

    def save(sd, **kw):
        if broken["on"]:
            raise OSError("503 SlowDown")
        return real(sd, **kw)

    monkeypatch.setattr(checkpoint.dcp, "save", save)
    ck = CheckpointManager(f"file://{tmp_path}/run", keep=2, async_mode="sync", rank=0, world_size=1, dp_rank=0,
                           describe={})
    sd = {"x": torch.ones(4)}
    try:
        assert MAX_FAILED_SAVES == 3
        ck.save(1, sd, {})
        ck.save(2, sd, {})
        broken["on"] = False
        ck.save(3, sd, {})
        assert ck.last_committed == 3 and ck.failed_saves == 0
        broken["on"] = True
        ck.save(4, sd, {})
        ck.save(5, sd, {})
        with pytest.raises(SavesFailing, match="3 checkpoint saves in a row failed"):
            ck.save(6, sd, {})
        ck.save(7, sd, {}, emergency=True)  # the emergency save at a notice counts for nothing here
    finally:
        ck.close()


def test_trainer_prints_saves_failing_on_every_rank(tmp_path, monkeypatch, capsys):
    from trainer import train
    from trainer.errors import SavesFailing

    class Boom:
        def __init__(self, args):
            pass

        def run(self):
            raise SavesFailing("3 checkpoint saves in a row failed")

    monkeypatch.setattr(train, "Run", Boom)
    monkeypatch.setenv("RANK", "3")
    assert train.main(["--job", "x.yaml"]) == 1
    assert "3 checkpoint saves in a row failed" in capsys.readouterr().err


def test_expandable_segments_unless_the_environment_says(monkeypatch):
    import torch

    from trainer import distenv

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "")  # recorded: undone after the test
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    assert distenv.select_device(_spec("H100"), 0).type == "cuda"
    assert calls == ["expandable_segments:True"]
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    assert distenv.use_expandable_segments() is False and len(calls) == 1


def test_fp8_leaves_router_and_head_in_high_precision():
    """The MoE router (routing from fp8-quantised logits) and the head stay high precision; only
    shapes _scaled_mm takes are converted. On a meta MoE model: no torchao needed."""
    from orchestrator.plan.presets import PRESETS
    from trainer.model import build_model
    from trainer.parallel import fp8_keep

    model = build_model(PRESETS["moe-small"], device="meta")
    kept = {fqn for fqn, m in model.named_modules() if fp8_keep(m, fqn)}
    routers = [fqn for fqn, _ in model.named_modules() if fqn.endswith(".router")]
    assert routers and not set(routers) & kept
    assert "head" not in kept and any(f.endswith("attn.wq") or ".attn." in f for f in kept)


def test_fp8_with_tp_is_refused(tmp_path, capsys, monkeypatch):
    import yaml

    from trainer.train import main

    spec = {"name": "fp8-tp", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 2},
            "trainer": {"model": "tiny", "steps": 2, "batch_size": 2, "seq_len": 16, "fp8": True,
                        "parallel": {"dp_shard": 1, "tp": 2}},
            "checkpoint": {"uri": f"file://{tmp_path}/run"}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--job", str(job)]) == 2
    assert "trainer.fp8 with parallel.tp 2 is not supported" in capsys.readouterr().err


def test_param_digest_on_cpu_or_when_asked():
    from trainer.train import want_digest

    assert want_digest("cpu", {}) and not want_digest("cuda", {})
    assert want_digest("cuda", {"DTRUN_PARAM_DIGEST": "1"}) and not want_digest("cpu", {"DTRUN_PARAM_DIGEST": "0"})


def test_moe_under_autocast_takes_the_grouped_gemm(monkeypatch):
    """Under autocast the MoE input arrives fp32 (the residual stream); the grouped GEMM takes
    only the compute dtype on CUDA (bf16), so without a cast every MoE layer fell back to a
    per-expert loop with a host sync per weight. CUDA's rule is emulated for _gmm_ok on CPU."""
    import torch

    from orchestrator.plan.presets import PRESETS
    from trainer import model as tm

    m = tm.build_model(PRESETS["tiny-moe"], seed=0)
    moe = m.moe_layers()[0]
    seen, syncs = [], []
    real_fwd, real_tolist = tm.Experts.forward, torch.Tensor.tolist
    monkeypatch.setattr(tm.Experts, "forward", lambda self, x, *a, **k: (seen.append(x.dtype), real_fwd(self, x, *a, **k))[1])
    monkeypatch.setattr("trainer.moe._gmm_ok", lambda x, w: x.dtype == torch.bfloat16)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: (syncs.append(1), real_tolist(self))[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = moe(torch.randn(2, 16, 64))
    y.float().sum().backward()
    assert seen == [torch.bfloat16] and syncs == []


@pytest.mark.slow
def test_ep_dispatch_stays_out_of_the_compiled_graph(tmp_path):
    """With expert parallelism under compile, the async count exchange and the host split sizes
    broke each MoE block's graph and recompiled it on every new token count (19 graphs, 18 breaks
    in 4 steps before); now the dispatch runs eager between the compiled parts: the graphs of the
    first step are all there is."""
    import re
    from pathlib import Path

    from conftest import torchrun_script

    out = torchrun_script(tmp_path, Path(__file__).with_name("ep_compile_check.py"), 2).stdout
    for first, graphs, breaks in re.findall(r"FIRST=(\d+) GRAPHS=(\d+) BREAKS=(\d+)", out):
        assert int(graphs) == int(first) and int(breaks) <= 2, out
    assert out.count("GRAPHS=") == 2, out


_HANG_SCRIPT = r'''
import os, signal, sys, threading, time
from trainer import checkpoint
from trainer.train import main

def hang(self, timeout=None):  # a collective whose peer vanished mid emergency save
    time.sleep(3600)

checkpoint.CheckpointManager.settle = hang

def notice():
    while not os.path.exists(sys.argv[2]):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=notice, daemon=True).start()
sys.exit(main(["--job", sys.argv[1]]))
'''


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
@pytest.mark.slow
def test_emergency_path_hard_exits_75_at_the_notice(tmp_path):
    """Whatever the emergency save's collectives do, a SIGTERMed trainer exits 75 by the notice
    plus HARD_EXIT_MARGIN_S (here: settle() hangs, as a broadcast to a vanished peer would)."""
    import subprocess
    import sys

    import yaml

    from orchestrator.contract import runuri

    run = tmp_path / "run"
    spec = {"name": "hard-exit", "resources": {"providers": ["local"], "gpu": "cpu"},
            "trainer": {"model": "tiny", "steps": 10000, "batch_size": 2, "seq_len": 16, "precision": "fp32",
                        "heartbeat_seconds": 0.2, "log_every": 1},
            "checkpoint": {"uri": f"file://{run}", "every_steps": 1000}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    script = tmp_path / "hang.py"
    script.write_text(_HANG_SCRIPT)
    flag = tmp_path / "go"
    env = {**os.environ, "DTRUN_PREEMPTION_NOTICE_S": "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.Popen([sys.executable, str(script), str(job), str(flag)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        end = time.time() + 120
        while time.time() < end:
            try:
                if (runuri.read_json(f"file://{run}/progress.json") or {}).get("step", 0) >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        flag.write_text("")
        t0 = time.time()
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 75, out[-3000:]
    assert "did not finish within the notice (2 s + 5 s)" in out, out[-2000:]
    assert time.time() - t0 < 30, out[-2000:]

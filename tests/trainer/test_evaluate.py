"""Validation (trainer/evaluate.py) through the real trainer under torchrun/gloo (world 2)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.contract import runuri
from tests.trainer.conftest import DENSE, torchrun_script

pytestmark = pytest.mark.slow


def test_out_of_vocab_validation_token_on_one_rank_is_a_config_error_before_step_1(trainer, tmp_path):
    # Only data-parallel rank 1's validation windows (2 and 3: tokens 64…128) hold an id ≥ vocab_size.
    # Before: rank 1 raised at the first evaluation (step 2) while rank 0 waited in the all-reduce,
    # so the job exited 2 with a gloo "Connection closed by peer" traceback and no error line.
    val = (np.arange(4096) % 200).astype(np.uint16)
    val[100] = 300
    (tmp_path / "v").mkdir()
    np.save(tmp_path / "v" / "held_out_val.npy", val)
    uri = f"file://{tmp_path}/run"
    job = trainer.job("badval", nproc=2, run_uri=uri, model=DENSE, steps=4, every=4,
                      val_data=str(tmp_path / "v"), eval_every=2, eval_tokens=256)
    rc, out = trainer.run(job, 2, timeout=200)
    assert rc == 2, out[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("dtrun trainer: error:")]
    assert len(lines) == 1 and "trainer.val_data" in lines[0] and "vocab_size 256" in lines[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert runuri.checkpoint_steps(uri) == []  # refused before training, nothing to resume


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
def test_heartbeat_keeps_beating_through_an_evaluation_longer_than_the_stall_window(trainer, tmp_path):
    # recovery.heartbeat_timeout_seconds 2 → the training phase's stall window is 1 s; an evaluation
    # of 2^17 tokens (1024 forward passes per rank) takes longer. Before: evaluation ran in the
    # "training" phase, so the heartbeat went stale mid-evaluation and the controller would declare
    # the node lost (and a resume before the evaluation's checkpoint would evaluate again).
    import yaml

    from tests.trainer.test_trainer_heartbeat import Sampler
    from trainer.metrics import PHASES

    uri = f"file://{tmp_path}/run"
    job = trainer.job("longeval", nproc=2, run_uri=uri, model=DENSE, steps=2, every=2,
                      val_data="synthetic", eval_every=1, eval_tokens=1 << 17)
    spec = yaml.safe_load(job.read_text())
    spec["recovery"] = {"heartbeat_timeout_seconds": 2}
    job.write_text(yaml.safe_dump(spec))
    sampler = Sampler(uri)
    rc, out = trainer.run(job, 2)
    seen = sampler.stop()
    assert rc == 0, out[-3000:]
    assert all(p["phase"] in PHASES for p in seen)
    evaluating = [p for p in seen if p["phase"] == "evaluating"]
    times = sorted({p["time"] for p in evaluating})
    # beats kept coming during the evaluation, past the 1 s stall window (heartbeat_seconds 0.2)
    assert len(times) >= 4 and times[-1] - times[0] > 1.0, (times, [(p["phase"], p["time"]) for p in seen])
    final = runuri.read_json(runuri.join(uri, runuri.PROGRESS))
    assert final["status"] == "done" and final["val_loss"] is not None


_TP_EVAL_SCRIPT = '''
import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.tensor import DTensor
from orchestrator.plan.presets import ModelSpec
from trainer.data import SyntheticSource
from trainer.evaluate import Evaluator
from trainer.model import build_model
from trainer.parallel import ParallelDims, build_meshes, parallelize
import contextlib
dist.init_process_group("gloo")
V = 256
spec = ModelSpec.model_validate({"vocab_size": V, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                 "max_seq_len": 64, "tie_embeddings": False, "mlp": "swiglu", "norm": "rmsnorm"})
dims = ParallelDims(1, 2, 1, 2)
meshes = build_meshes(dims, "cpu")
model = build_model(spec, device="meta")
parallelize(model, dims, meshes, device=torch.device("cpu"))
model.to_empty(device="cpu")
model.init_weights(0)
src = SyntheticSource(V, 32, 7)
ev = Evaluator(src, seq_len=32, eval_tokens=256, micro_batch=2, dp=1, dp_rank=0)
# reference: the full logits, gathered
x = torch.from_numpy(__import__("numpy").stack([src.sample(i) for i in range(ev.windows)]))
with torch.no_grad():
    ref = float(F.cross_entropy(model(x[:, :-1]).full_tensor().reshape(-1, V), x[:, 1:].reshape(-1)))
gathered = []
real = DTensor.full_tensor
def spy(self, *a, **k):
    out = real(self, *a, **k)
    gathered.append(tuple(out.shape))
    return out
DTensor.full_tensor = spy
val = ev.evaluate(model, torch.device("cpu"), contextlib.nullcontext)
DTensor.full_tensor = real
if dist.get_rank() == 0:
    print("VAL", val, "REF", ref, flush=True)
    print("FULL_VOCAB_GATHERS", sum(1 for s in gathered if s and s[-1] == V), flush=True)
dist.destroy_process_group()
'''


def test_validation_under_tp_keeps_logits_vocab_sharded(tmp_path):
    """TP 2 with an untied head: the validation loss equals the full-logits cross-entropy, computed
    with loss parallel — no rank gathers mb × T × vocab logits (before: ``full_tensor()`` of the
    logits on every rank, tp× the logits memory of a training step: ~10 GB per H100 for a
    128k vocabulary at T 8192, enough to run out of memory at the first evaluation)."""
    import re

    out = torchrun_script(tmp_path, _TP_EVAL_SCRIPT, 2, timeout=180)
    m = re.search(r"VAL (\S+) REF (\S+)", out.stdout)
    assert m and abs(float(m.group(1)) - float(m.group(2))) < 1e-5, out.stdout
    assert "FULL_VOCAB_GATHERS 0" in out.stdout, out.stdout


def test_out_of_vocab_training_token_seen_by_one_rank_only_is_reported(trainer, tmp_path):
    # Raw shards (no data-prepare manifest to check up front): only data-parallel rank 1's first
    # micro-batch (samples 2, 3: tokens 64…128) holds an id ≥ vocab_size. Before: rank 1 raised the
    # ConfigError, only rank 0 prints them, so the job exited 2 with a gloo traceback and no error line.
    from trainer.shards import encode

    train = (np.arange(8192) % 200).astype(np.int64)
    train[100] = 300
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train_000000.bin").write_bytes(encode(train, 65536))
    uri = f"file://{tmp_path}/run"
    job = trainer.job("badtrain", nproc=2, run_uri=uri, model=DENSE, steps=4, every=4, data=str(tmp_path / "d"))
    rc, out = trainer.run(job, 2, timeout=200)
    assert rc == 2, out[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("dtrun trainer: error")]
    assert lines and all("trainer.data" in x and "vocab_size 256" in x for x in lines), out[-3000:]


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
def test_resume_at_the_last_step_still_reports_the_final_validation_loss(trainer, tmp_path):
    # The final checkpoint committed but DONE not written (the node died in between): the resumed
    # attempt runs no step. Before: DONE was written with val_loss null (the loop's evaluation at
    # the last step never ran in this attempt).
    uri = f"file://{tmp_path}/run"
    job = trainer.job("lasteval", nproc=2, run_uri=uri, model=DENSE, steps=2, every=2,
                      val_data="synthetic", eval_every=2, eval_tokens=256)
    rc, out = trainer.run(job, 2)
    assert rc == 0, out[-3000:]
    first = runuri.read_json(runuri.join(uri, runuri.DONE))
    assert first["val_loss"] is not None
    (tmp_path / "run" / "DONE").unlink()
    rc, out = trainer.run(job, 2)
    assert rc == 0 and "resumed from checkpoint step 2" in out, out[-3000:]
    done = runuri.read_json(runuri.join(uri, runuri.DONE))
    assert done["step"] == 2 and done["val_loss"] == pytest.approx(first["val_loss"], abs=1e-6)

"""The planner's parameter, gradient and optimizer-state bytes per rank equal what the real
trainer's sharded tensors hold on each rank (torchrun + gloo on CPU, fp32: 4 + 4 + 8 B/param).

The trainer reports, in DONE, ``state_bytes_per_rank`` from ``trainer.parallel.sharded_state_bytes``
(DTensor ``to_local()`` bytes after the last optimizer step: unpadded shards, AdamW's 0-dim
``step`` counters included). The planner's :func:`state_bytes_per_rank` with ``padded=False`` and
``count_step_scalars=True`` must match it exactly, for every rank; with ``padded=True`` (what the
plan's headline uses: FSDP2 pads dim 0 to equal chunks) it equals rank 0's shard, which is
always a full chunk.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, Trainer, worlds_per_size

from orchestrator.contract import runuri
from orchestrator.plan.planner import state_bytes_per_rank
from orchestrator.plan.presets import ModelSpec
from orchestrator.plan.spec import Parallel

# Uneven on purpose: 250 vocab rows and 90 learned positions do not split evenly over 4 ranks
# (FSDP2 chunks 63/63/63/61 and 23/23/23/21), biases and LayerNorm biases included.
UNEVEN = {"vocab_size": 250, "d_model": 48, "n_layers": 2, "n_heads": 4, "max_seq_len": 90,
          "pos": "learned", "bias": True, "d_ff": 100}
# Every TP path: untied head/embedding, QK-norm, SwiGLU, RMSNorm, grouped-query attention.
DENSE = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "max_seq_len": 128, "qk_norm": True, "tie_embeddings": False, "mlp": "swiglu", "norm": "rmsnorm"}
MOE = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128,
       "moe": {"n_experts": 4, "top_k": 2, "capacity_factor": 4.0, "balance": "bias"}}
MOE6 = {**MOE, "moe": {**MOE["moe"], "n_experts": 6}}
MOE2 = {**MOE, "moe": {**MOE["moe"], "n_experts": 2}}

CASES = [
    # id, nproc, model, parallel, optimizer[, extra trainer fields]
    ("fsdp-world2", 2, UNEVEN, {"dp_shard": 2}, "adamw"),
    # Gradient accumulation: 8 micro-batches per step; the gradients held *between* micro-batches
    # (grads_peak) must be the sharded size the planner counts, not full-size accumulators.
    ("fsdp-world2-accum8", 2, UNEVEN, {"dp_shard": 2}, "adamw", {"batch_size": 16, "micro_batch_size": 1}),
    ("fsdp2xtp2-accum2", 4, DENSE, {"dp_shard": 2, "tp": 2}, "adamw", {"batch_size": 8, "micro_batch_size": 2}),
    ("fsdp-world4-uneven", 4, UNEVEN, {"dp_shard": 4}, "adamw"),
    ("tp2", 2, DENSE, {"dp_shard": 1, "tp": 2}, "adamw"),
    ("fsdp2xtp2-muon", 4, DENSE, {"dp_shard": 2, "tp": 2}, "muon"),
    ("ep2", 2, MOE, {"dp_shard": 2, "ep": 2}, "adamw"),
    # ep 2 at world 4: the experts are their own FSDP unit over dp_rep 2 — 6 experts, 3 per ep
    # rank, chunked 2/1 over dp_rep (uneven); grads and Adam state sharded the same way.
    ("ep2-world4-uneven", 4, MOE6, {"dp_shard": 4, "ep": 2}, "adamw"),
    # 2 experts, ep 2, dp_rep 2: dp_rep·ep > E, so the expert unit shards dim 1 (torchtitan's rule).
    ("ep2-world4-dim1", 4, MOE2, {"dp_shard": 4, "ep": 2}, "adamw"),
    ("ddp-world2", 2, UNEVEN, {"dp_shard": 2, "replicate": True}, "adamw"),  # what auto picks for small jobs
]


def _job(tmp: Path, case: tuple) -> dict:
    name, nproc, model, parallel, opt = case[:5]
    extra = case[5] if len(case) > 5 else {}
    uri = "file://" + str(tmp / name / "run")
    job = Trainer(tmp).job(name, nproc=nproc, run_uri=uri, model=model, parallel=parallel, steps=2, every=2,
                           optimizer=opt, **extra)
    return {"name": name, "job": str(job), "run_uri": uri}


@pytest.fixture(scope="module")
def worlds(request, tmp_path_factory):
    """``worlds(nproc)``: one torchrun world per size running the real trainer once per selected
    case of that size, in turn (each case its own process group, run URI and output:
    tests/trainer/trainer_world.py): a torch start-up per rank per size, not per case."""
    tmp = tmp_path_factory.mktemp("planner_exact")
    return worlds_per_size(request, tmp, REPO / "tests/trainer/trainer_world.py", [(c[1], _job(tmp, c)) for c in CASES])


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_planner_bytes_equal_trainer_shards(worlds, case):
    name, nproc, model, parallel, opt = case[:5]
    world = worlds(nproc)
    rc, out = world.case(name)
    uri = world.cases[name]["run_uri"]
    assert rc == 0, out[-3000:]
    done = runuri.read_json(runuri.join(uri, runuri.DONE))
    measured = done["state_bytes_per_rank"]
    assert len(measured) == nproc

    ms = ModelSpec.model_validate(model)
    par = Parallel(**{"dp_shard": nproc, **parallel})
    tp, ep = par.tp, par.ep
    for rank, got in enumerate(measured):
        want = state_bytes_per_rank(ms, par, dp_rank=rank // tp, tp_rank=rank % tp, ep_rank=rank % ep,
                                    optimizer=opt, count_step_scalars=True)
        assert {k: got[k] for k in ("params", "grads", "optimizer")} == want, (rank, got, want)
        # What the rank held at any point between micro-batches (accumulation included).
        assert got["grads_peak"] == want["grads"], (rank, got, want)
    padded = state_bytes_per_rank(ms, par, optimizer=opt, padded=True, count_step_scalars=True)
    assert padded["params"] == measured[0]["params"]
    assert padded["params"] >= max(m["params"] for m in measured)
    if name in ("fsdp-world4-uneven", "ep2-world4-uneven"):
        assert len({m["params"] for m in measured}) > 1  # the uneven split really is uneven

"""Expert parallel under FSDP2 (real torchrun + gloo, world 4: ep 2 so dp_rep = 2, and ep 4 so dp_rep = 1).

* The experts are their own FSDP unit on the expert mesh's ``dp_rep`` dimension: their gradients
  come back from backward as DTensors sharded over ``dp_rep`` (a quarter of each expert weight per
  rank, not the half that two ep ranks hold) and equal, as full tensors, the gradient of the mean
  loss over the global batch computed by one process (sharded on dim 0 with 4 experts; on dim 1
  with 2 experts, where dp_rep × ep exceeds the number of experts; at dp_rep 1 a size-1 unit).
* Under ``param_dtype`` bf16 the weights ``Experts`` receives are already bf16 (FSDP's all-gather),
  so ``Experts._local`` casts nothing.
* The count exchange is issued with ``async_op=True`` right after the counts exist: before the
  token sort, and waited for only after it.
"""

from __future__ import annotations

import re

import pytest
from conftest import torchrun_script

pytestmark = pytest.mark.slow

_SCRIPT = r'''
import sys
import torch, torch.distributed as dist
from orchestrator.plan.presets import ModelSpec
from trainer import model as tm
from trainer.model import build_model, loss_fn
from trainer.parallel import ParallelDims, build_meshes, held_grad_bytes, parallelize

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def check(n_experts, ep):
    spec = ModelSpec.model_validate({"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
        "mlp": "swiglu", "bias": True, "moe": {"n_experts": n_experts, "top_k": 2, "d_expert": 48, "balance": "bias"}})
    g = torch.Generator().manual_seed(1)
    X = torch.randint(0, 64, (2 * world, 16), generator=g)
    x = X[2 * rank:2 * rank + 2]

    # One process, the whole global batch: the reference gradient of the mean loss.
    ref = build_model(spec, seed=0)
    loss_fn(ref(X), X)[0].backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    dims = ParallelDims(world, 1, ep, world)
    meshes = build_meshes(dims, "cpu")

    def build(param_dtype):
        m = build_model(spec, device="meta")
        parallelize(m, dims, meshes, device=torch.device("cpu"), param_dtype=param_dtype)
        m.to_empty(device="cpu")
        m.init_weights(0)
        return m

    # fp32: gradients sharded over dp_rep and equal to the reference.
    model = build(None)
    loss_fn(model(x), x)[0].backward()
    worst = 0.0
    for n, p in model.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, (got - want[n]).abs().max().item())
        if ".experts." in n:
            assert type(p.grad).__name__ == "DTensor", n
            # Sharded over all 4 ranks: ep × dp_rep (old: ep only, each dp_rep replica a full copy).
            assert p.grad.to_local().numel() * world == p.numel(), (n, p.grad.to_local().shape, p.grad.placements)
    print(f"CFG{n_experts},{ep} RANK{rank} MAXDIFF={worst:.3e} HELD={held_grad_bytes(model)} PLACEMENT={model.layers['0'].ffn.experts.w1.placements[0]!r}", flush=True)

    # bf16 compute: what Experts._local receives, and the order of the count exchange.
    events = []
    real_local = tm.Experts._local
    def local(t, dtype):
        if t is not None:
            events.append(("weight", str((t.to_local() if hasattr(t, "to_local") else t).dtype)))
        return real_local(t, dtype)
    tm.Experts._local = staticmethod(local)
    real_a2a, real_argsort = dist.all_to_all_single, torch.argsort
    class Work:
        def __init__(self, w):
            self.w = w
        def wait(self, *a, **k):
            events.append(("wait",))
            return self.w.wait(*a, **k)
    def a2a(*a, async_op=False, **k):
        events.append(("a2a", bool(async_op)))
        w = real_a2a(*a, async_op=async_op, **k)
        return Work(w) if async_op else w
    def argsort(*a, **k):
        events.append(("argsort",))
        return real_argsort(*a, **k)
    dist.all_to_all_single, torch.argsort = a2a, argsort
    model = build(torch.bfloat16)
    model(x)
    dist.all_to_all_single, torch.argsort = real_a2a, real_argsort
    tm.Experts._local = staticmethod(real_local)
    dtypes = sorted({e[1] for e in events if e[0] == "weight"})
    seq = [e[0] if e[0] != "a2a" else f"a2a-async={e[1]}" for e in events if e[0] != "weight"]
    print(f"CFG{n_experts},{ep} RANK{rank} DTYPES={','.join(dtypes)} SEQ={'|'.join(seq)};", flush=True)


# Every configuration in one world (one torchrun start instead of one per configuration).
for cfg in sys.argv[1:]:
    check(*map(int, cfg.split(",")))
dist.destroy_process_group()
'''


CONFIGS = [
    (4, 2, "_StridedShard(dim=0"),  # dp_rep 2, whole experts per rank
    (2, 2, "Shard(dim=1)"),         # dp_rep × ep > n_experts: sharded on dim 1
    (4, 4, "_StridedShard(dim=0"),  # dp_rep 1: a size-1 FSDP unit (compute dtype, ÷ dp, no collective)
]


@pytest.fixture(scope="module")
def world4_output(tmp_path_factory) -> str:
    """One world-4 torchrun for every configuration (each test reads its own lines)."""
    tmp = tmp_path_factory.mktemp("moe_ep")
    return torchrun_script(tmp, _SCRIPT, 4, *(f"{n},{ep}" for n, ep, _ in CONFIGS)).stdout


@pytest.mark.parametrize("n_experts,ep,placement", CONFIGS)
def test_ep_experts_under_fsdp_on_dp_rep(world4_output, n_experts, ep, placement):
    tag = f"CFG{n_experts},{ep} "
    out = "".join(line[len(tag):] + "\n" for line in world4_output.splitlines() if line.startswith(tag))
    grads = re.findall(r"RANK(\d) MAXDIFF=(\S+) HELD=(\d+) PLACEMENT=(\w+\(dim=\d[^)]*\))", out)
    assert len(grads) == 4, out
    for _, diff, _, pl in grads:
        assert float(diff) < 1e-5, out  # the FSDP-averaged gradient of the mean loss
        assert pl.startswith(placement), out
    runs = re.findall(r"RANK(\d) DTYPES=([\w.,]*) SEQ=([\w|=-]*);", out)
    assert len(runs) == 4, out
    for _, dtypes, seq in runs:
        assert dtypes == "torch.bfloat16", out  # no fp32 weight reaches the experts: no cast
        # Per MoE layer: counts exchange launched async, then the token sort, then the wait.
        steps = seq.split("|")
        assert steps.count("a2a-async=True") == 2 and "a2a-async=False" not in steps, seq
        for i, s in enumerate(steps):
            if s == "a2a-async=True":
                assert steps[i + 1] == "argsort" and "wait" in steps[i + 2:], seq
                assert steps.index("wait", i) > steps.index("argsort", i), seq


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
def test_ep_checkpoint_reshards_world4_ep2_to_world1_to_world2_ep2(trainer, tmp_path):
    """DCP resharding of FSDP-sharded expert weights and their Adam state: a checkpoint written at
    ep 2 / dp_rep 2 (world 4) resumes at world 1 (plain tensors), whose checkpoint resumes at
    ep 2 / dp_rep 1 (world 2); the run equals one uninterrupted process."""
    from conftest import MOE, losses

    from orchestrator.contract import runuri

    cfg = dict(warmup_steps=0, min_lr_ratio=1.0, every=2, model=MOE)  # constant LR: split runs = one run
    ref = f"file://{tmp_path}/ref"
    rc, log = trainer.run(trainer.job("ref", nproc=1, run_uri=ref, steps=6, **cfg), 1)
    assert rc == 0, log[-3000:]
    uri = f"file://{tmp_path}/reshard"
    for nproc, par, steps in [(4, {"dp_shard": 4, "ep": 2}, 2), (1, None, 4), (2, {"dp_shard": 2, "ep": 2}, 6)]:
        rc, log = trainer.run(trainer.job(f"w{nproc}", nproc=nproc, run_uri=uri, steps=steps, parallel=par, **cfg),
                              nproc)
        assert rc == 0, log[-3000:]
        if steps > 2:
            assert f"resumed from checkpoint step {steps - 2}" in log
        assert runuri.read_json(runuri.join(uri, "DONE"))["world_size"] == nproc
    assert losses(uri) == pytest.approx(losses(ref), abs=2e-4)

"""FSDP2 (world 2, MoE with ep 1), TP 2, dp2×tp2 (world 4) and EP 2 under real torchrun/gloo compute the same
training run as one process: their per-step losses match a world-1 run of the same job."""

from __future__ import annotations

import json

import pytest
from conftest import DENSE, MOE, REPO, Trainer, free_port, losses, two_nodes, worlds_per_size

from orchestrator.contract import runuri
from orchestrator.plan.presets import ModelSpec

pytestmark = pytest.mark.slow

STEPS = 8
TIED = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "pos": "learned",
        "bias": True, "tie_embeddings": True}

# Every trainer run of this module but the two-node HSDP one: name → (nproc, model, parallel, trainer
# fields, the tests that read it). All optimizers are Muon but the tied pair's (AdamW, the default).
MUON = {"optimizer": "muon"}
RUNS = {
    # World-1 references: the dense model (Muon, full activation checkpointing) and the MoE (Muon).
    "ref-dense": (1, DENSE, None, {**MUON, "activation_checkpointing": "full"},
                  ["test_reference_runs_train_with_muon", "test_tp2_matches_world1",
                   "test_dp2_tp2_world4_matches_world1", "test_hsdp_two_nodes_of_two_ranks_matches_world1"]),
    "ref-moe": (1, MOE, None, MUON,
                ["test_reference_runs_train_with_muon", "test_fsdp2_world2_matches_world1",
                 "test_ep2_matches_world1_and_checkpoint_keeps_every_expert", "test_ep2_world4_matches_world1",
                 "test_replicate_ddp_rung_world2_matches_world1", "test_tp2_moe_matches_world1"]),
    # The MoE model with ep = 1: experts are ordinary FSDP-sharded parameters here.
    "fsdp": (2, MOE, None, {**MUON, "activation_checkpointing": "selective", "micro_batch_size": 1},  # 2 accum.
             ["test_fsdp2_world2_matches_world1"]),
    "tp": (2, DENSE, {"dp_shard": 1, "tp": 2}, MUON, ["test_tp2_matches_world1"]),
    "dptp": (4, DENSE, {"dp_shard": 2, "tp": 2}, MUON, ["test_dp2_tp2_world4_matches_world1"]),
    "ep": (2, MOE, {"dp_shard": 2, "ep": 2}, MUON, ["test_ep2_matches_world1_and_checkpoint_keeps_every_expert"]),
    "ep4": (4, MOE, {"dp_shard": 4, "ep": 2}, {**MUON, "activation_checkpointing": "full"},
            ["test_ep2_world4_matches_world1"]),
    # parallel.replicate (the planner's DDP rung): HSDP with a shard group of one.
    "ddp": (2, MOE, {"dp_shard": 2, "replicate": True}, MUON, ["test_replicate_ddp_rung_world2_matches_world1"]),
    "tpmoe": (2, MOE, {"dp_shard": 1, "tp": 2}, MUON, ["test_tp2_moe_matches_world1"]),
    "tied1": (1, TIED, {"dp_shard": 1}, {}, ["test_tp2_tied_learned_positions_matches_world1"]),
    "tied-dp2tp2": (4, TIED, {"dp_shard": 2, "tp": 2}, {}, ["test_tp2_tied_learned_positions_matches_world1"]),
}


@pytest.fixture(scope="module")
def worlds(request, tmp_path_factory):
    """``worlds(nproc)``: one torchrun world per size (1, 2, 4) running the real trainer once per
    selected run of that size, in turn (each run its own process group, run URI and output:
    tests/trainer/trainer_world.py): a torch start-up per rank per size, not per run."""
    tmp = tmp_path_factory.mktemp("parallel")
    t = Trainer(tmp)
    cases = []
    for name, (nproc, model, parallel, extra, tests) in RUNS.items():
        uri = f"file://{tmp}/{name}/run"
        job = t.job(name, nproc=nproc, run_uri=uri, model=model, parallel=parallel, steps=STEPS, **extra)
        cases.append((nproc, {"name": name, "job": str(job), "run_uri": uri, "tests": tests}))
    for name, (text, test) in SCRIPTS.items():  # muon_split last: it patches trainer.optim.newton_schulz
        (tmp / f"{name}.py").write_text(text)
        cases.append((2, {"name": name, "script": str(tmp / f"{name}.py"), "tests": [test]}))
    return worlds_per_size(request, tmp, REPO / "tests/trainer/trainer_world.py", cases)


def _ran(worlds, name: str) -> str:
    """The run URI of ``RUNS[name]``, which exited 0."""
    world = worlds(RUNS[name][0])
    rc, log = world.case(name)
    assert rc == 0, log[-3000:]
    return world.cases[name]["run_uri"]


@pytest.fixture(scope="module")
def refs(worlds):
    """``refs(name)``: the per-step losses of the world-1 reference ``ref-<name>`` (dense, moe)."""
    return lambda name: losses(_ran(worlds, f"ref-{name}"))


def _check_matches(ref: list[float], got: list[float]) -> None:
    assert len(got) == len(ref) == STEPS
    assert got == pytest.approx(ref, abs=2e-4), (got, ref)


def test_reference_runs_train_with_muon(refs):
    # Muon on the dense and the MoE model: the loss goes down from ln(256) ≈ 5.55.
    for name in ("dense", "moe"):
        assert refs(name)[-1] < refs(name)[0] - 0.05, (name, refs(name))


def test_fsdp2_world2_matches_world1(worlds, refs):
    uri = _ran(worlds, "fsdp")
    _check_matches(refs("moe"), losses(uri))
    done = runuri.read_json(runuri.join(uri, "DONE"))
    assert done["step"] == STEPS and done["param_digest"]
    # Each rank holds half of the parameters (FSDP2 shards), summing to the model exactly.
    per_rank = done["state_bytes_per_rank"]
    n = ModelSpec(**MOE).num_params()
    assert sum(r["params"] for r in per_rank) == 4 * n
    assert all(r["params"] < 4 * n * 0.6 for r in per_rank)
    assert all(r["grads"] == r["params"] for r in per_rank)


def test_tp2_matches_world1(worlds, refs):
    _check_matches(refs("dense"), losses(_ran(worlds, "tp")))


def test_dp2_tp2_world4_matches_world1(worlds, refs):
    _check_matches(refs("dense"), losses(_ran(worlds, "dptp")))


def test_ep2_matches_world1_and_checkpoint_keeps_every_expert(worlds, refs):
    uri = _ran(worlds, "ep")
    _check_matches(refs("moe"), losses(uri))

    # The checkpoint holds all 4 experts (each rank owns 2): global shape and chunks covering both halves.
    import torch.distributed.checkpoint as dcp

    path = runuri.local_path(runuri.checkpoint_uri(uri, STEPS))
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in ("model.layers.0.ffn.experts.w1", "model.layers.1.ffn.experts.w2"):
        assert md[key].size[0] == 4, key
        offsets = sorted(c.offsets[0] for c in md[key].chunks)
        assert offsets == [0, 2], (key, offsets)
    commit = json.loads(open(f"{path}/COMMITTED").read())
    assert commit["parallel"]["ep"] == 2 and commit["world_size"] == 2


def test_ep2_world4_matches_world1(worlds, refs):
    """ep 2 at world 4: two replicas (dp_rep 2) of each expert half. The experts are an FSDP unit
    on dp_rep (reduce-scattered in backward, ÷ dp), prefetched explicitly, recomputed under full
    activation checkpointing: the run still equals one process."""
    _check_matches(refs("moe"), losses(_ran(worlds, "ep4")))


def test_replicate_ddp_rung_world2_matches_world1(worlds, refs):
    uri = _ran(worlds, "ddp")
    _check_matches(refs("moe"), losses(uri))
    n = ModelSpec(**MOE).num_params()
    assert all(r["params"] == 4 * n for r in runuri.read_json(runuri.join(uri, "DONE"))["state_bytes_per_rank"])


def test_hsdp_two_nodes_of_two_ranks_matches_world1(trainer, tmp_path, refs):
    """HSDP (dp_replicate 2 × dp_shard 2) as two "nodes": two torchrun launchers, --nnodes 2 with
    a static rendezvous on 127.0.0.1 (what the node bootstrap runs on each node of a cluster).
    Each node's two ranks shard the model; the two nodes hold a replica each: the run equals one
    process, every rank holds half of the parameters, and the checkpoint records the layout."""
    uri = f"file://{tmp_path}/hsdp"
    job = trainer.job("hsdp", nproc=4, run_uri=uri, model=DENSE, steps=STEPS, optimizer="muon",
                      activation_checkpointing="full", parallel={"dp_replicate": 2, "dp_shard": 2})
    port = free_port()
    nodes = [trainer.start(job, 2, launch=two_nodes(port, r)) for r in (0, 1)]
    outs = []
    for p in nodes:
        out, _ = p.communicate(timeout=240)
        outs.append(out)
        assert p.returncode == 0, out[-3000:]
    _check_matches(refs("dense"), losses(uri))
    done = runuri.read_json(runuri.join(uri, "DONE"))
    assert done["world_size"] == 4 and done["parallel"]["dp_replicate"] == 2 and done["parallel"]["dp_shard"] == 2
    n = ModelSpec(**DENSE).num_params()
    per_rank = done["state_bytes_per_rank"]
    # Sharded within a node (two halves per node), replicated across nodes: 2 × the model in all.
    assert sum(r["params"] for r in per_rank) == 2 * 4 * n
    assert all(r["params"] < 4 * n * 0.6 for r in per_rank)
    commit = json.loads(open(runuri.local_path(runuri.checkpoint_uri(uri, STEPS)) + "/COMMITTED").read())
    assert commit["parallel"]["dp_replicate"] == 2 and commit["world_size"] == 4


def test_tp2_moe_matches_world1(worlds, refs):
    """MoE blocks under TP: router and experts run on each rank's sequence shard; their gradients
    are summed over TP."""
    _check_matches(refs("moe"), losses(_ran(worlds, "tpmoe")))


def test_tp2_tied_learned_positions_matches_world1(worlds):
    """The documented choice for tied embeddings: replicated over TP, the head on the whole
    sequence; learned positions added before the sequence is split (world 1 vs dp 2 × tp 2)."""
    _check_matches(losses(_ran(worlds, "tied1")), losses(_ran(worlds, "tied-dp2tp2")))


def world2(worlds, name: str) -> str:
    """What the layout script ``name`` printed (every rank's output), run as a case of the world-2
    torchrun (in its own process group, after this module's world-2 trainer runs)."""
    world = worlds(2)
    rc, log = world.case(name)
    assert rc == 0, log[-3000:]
    return "".join((world.dir(name) / f"rank{r}.log").read_text() for r in range(2))


_TP_LAYOUT_SCRIPT = '''
import sys, torch, torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from orchestrator.plan.presets import ModelSpec
from trainer.model import build_model, loss_context, loss_fn
from trainer.parallel import ParallelDims, build_meshes, parallelize
dist.init_process_group("gloo")
spec = ModelSpec.model_validate({"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                                 "max_seq_len": 64, "tie_embeddings": False, "mlp": "swiglu", "norm": "rmsnorm"})
dims = ParallelDims(1, 2, 1, 2)
meshes = build_meshes(dims, "cpu")
model = build_model(spec, device="meta")
parallelize(model, dims, meshes, device=torch.device("cpu"))
model.to_empty(device="cpu")
model.init_weights(0)
shapes = []
model.layers["0"].register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
x = torch.randint(0, 256, (2, 32))
with loss_context(model):
    logits = model(x)
    loss, _ = loss_fn(logits, x)
    loss.backward()
if dist.get_rank() == 0:
    print("LOGITS", type(logits).__name__, logits.placements if isinstance(logits, DTensor) else None,
          tuple(logits.to_local().shape) if isinstance(logits, DTensor) else tuple(logits.shape), flush=True)
    print("BLOCK_OUT", shapes[0], flush=True)
    print("NORM", type(model.layers["0"].norm1.weight).__name__, flush=True)
dist.destroy_process_group()
'''


def test_tp_is_sequence_parallel_with_a_vocab_sharded_loss(worlds):
    """The residual stream between blocks holds this rank's half of the sequence; the head's
    logits stay vocab-sharded (loss parallel: no full-vocab all-gather)."""
    out = world2(worlds, "tp_layout")
    assert "LOGITS DTensor (Shard(dim=2),) (2, 32, 128)" in out, out
    assert "BLOCK_OUT (2, 16, 64)" in out, out
    assert "NORM DTensor" in out, out


_Z_LOSS_SCRIPT = '''
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel
from trainer.model import loss_fn
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
full = torch.randn(2, 3, 16, requires_grad=True)
tgt = torch.randint(0, 16, (2, 3))
ref, _ = loss_fn(full, tgt, z_loss=0.1)
ref.backward()
lg = distribute_tensor(full.detach(), mesh, [Shard(2)]).requires_grad_()
comms = CommDebugMode()
with loss_parallel(), comms:
    loss, _ = loss_fn(lg, tgt, z_loss=0.1)
    loss.backward()
names = sorted(str(k) for k in comms.get_comm_counts())
err = (lg.grad.full_tensor() - full.grad).abs().max().item()
if dist.get_rank() == 0:
    print("LOSS", float(loss.to_local()), "REF", float(ref), "GRAD_ERR", err, flush=True)
    print("COMMS", names, flush=True)
dist.destroy_process_group()
'''


def test_z_loss_under_loss_parallel_keeps_the_vocabulary_sharded(worlds):
    """z-loss's logsumexp on vocab-sharded logits: before, ``torch.logsumexp`` on the DTensor
    all-gathered the whole vocabulary on every TP rank (mb·T·V fp32, the memory loss parallel
    exists to avoid). Now two small all-reduces; loss and gradient equal the unsharded ones."""
    import re

    out = world2(worlds, "z_loss")
    m = re.search(r"LOSS (\S+) REF (\S+) GRAD_ERR (\S+)", out)
    assert m and abs(float(m.group(1)) - float(m.group(2))) < 1e-5 and float(m.group(3)) < 1e-6, out
    comms = re.search(r"COMMS (.*)", out).group(1)
    assert "all_gather" not in comms, comms


_MUON_SPLIT_SCRIPT = '''
import torch, torch.distributed as dist
from orchestrator.plan.presets import ModelSpec
from trainer import optim
from trainer.model import build_model, loss_fn
from trainer.parallel import ParallelDims, build_meshes, parallelize
dist.init_process_group("gloo")
calls = [0]
real = optim.newton_schulz
def counting(g, *a, **k):
    calls[0] += 1
    return real(g, *a, **k)
optim.newton_schulz = counting
spec = ModelSpec.model_validate({"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64})
dims = ParallelDims(2, 1, 1, 2)
meshes = build_meshes(dims, "cpu")
model = build_model(spec, device="meta")
parallelize(model, dims, meshes, device=torch.device("cpu"))
model.to_empty(device="cpu")
model.init_weights(0)
mats, _, _ = optim.param_groups(model)
opt = optim.Muon([{"params": mats, "kind": "muon"}], lr=0.01)
x = torch.randint(0, 256, (2, 16))
loss_fn(model(x), x)[0].backward()
opt.step()
print(f"RANK{dist.get_rank()} NS={calls[0]} MATS={len(mats)}", flush=True)
dist.destroy_process_group()
'''


def test_muon_splits_newton_schulz_across_ranks(worlds):
    import re

    out = world2(worlds, "muon_split")
    got = {int(r): (int(n), int(m)) for r, n, m in re.findall(r"RANK(\d) NS=(\d+) MATS=(\d+)", out)}
    assert set(got) == {0, 1}
    mats = got[0][1]
    assert got[0][0] + got[1][0] == mats and abs(got[0][0] - got[1][0]) <= 1  # each matrix once, split evenly


SCRIPTS = {"tp_layout": (_TP_LAYOUT_SCRIPT, "test_tp_is_sequence_parallel_with_a_vocab_sharded_loss"),
           "z_loss": (_Z_LOSS_SCRIPT, "test_z_loss_under_loss_parallel_keeps_the_vocabulary_sharded"),
           "muon_split": (_MUON_SPLIT_SCRIPT, "test_muon_splits_newton_schulz_across_ranks")}

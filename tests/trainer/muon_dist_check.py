"""Worker for tests/trainer/test_muon.py (run under torchrun, gloo): one layout's Muon steps vs
one process's, and the bytes each rank moves through collectives during ``Muon.step``.

    torchrun --nproc-per-node=N tests/trainer/muon_dist_check.py CASES.json

Every case (``{"name", "out", "layout", "ns_dtype", "bucket_bytes"}``; the protocol is
tests/trainer/world_cases.py) runs in turn in one process group. LAYOUT: fsdp (dp_shard = world),
fsdp-moe, tp (tp = world), tp-moe, dptp (2 × world/2), ddp (replicate), ep-moe (ep 2, experts
FSDP-sharded over dp_rep = world/2); ns_dtype: fp32, bf16 or null (Muon's default). Each rank
writes its result to ``out/rank{r}.json``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from world_cases import run_cases

from orchestrator.plan.presets import ModelSpec
from trainer import optim
from trainer.model import build_model
from trainer.parallel import ParallelDims, build_meshes, parallelize

DENSE = {"vocab_size": 128, "d_model": 40, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64,
         "tie_embeddings": False, "mlp": "swiglu", "norm": "rmsnorm"}
MOE = {"vocab_size": 128, "d_model": 40, "n_layers": 2, "n_heads": 4, "max_seq_len": 64, "tie_embeddings": False,
       "moe": {"n_experts": 4, "top_k": 2, "d_expert": 40}}


def _bytes(x) -> int:
    leaves, _ = tree_flatten(x)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


class CollectiveBytes(TorchDispatchMode):
    """Bytes this rank hands to (sent) and gets from (received) every c10d collective."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.sent, self.recv, self.ops = rank, 0, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns in ("c10d", "_c10d_functional"):
            if name in ("alltoall_base_",) or name in ("allgather_", "allgather_into_tensor_coalesced_", "_allgather_base_"):
                s, r = _bytes(args[1]), _bytes(args[0])
            elif name in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
                s, r = _bytes(args[0]), _bytes(out)
            elif name == "broadcast_":
                root = args[2]
                b = _bytes(args[0])
                try:
                    me = args[1].rank()
                except Exception:  # noqa: BLE001 - a ScriptObject without rank(): the world group here
                    me = dist.get_rank()
                s, r = (b, 0) if root == me else (0, b)
            else:  # wait_tensor, _wrap_tensor_autograd, barrier: no payload of their own
                s = r = 0
            if s or r:
                self.ops.append((name, s, r))
            self.sent += s
            self.recv += r
        return out


def check(case: dict, rank: int) -> None:
    layout = case["layout"]
    ns_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(case.get("ns_dtype") or "")
    bucket = case.get("bucket_bytes")
    world = dist.get_world_size()
    torch.manual_seed(0)
    spec = ModelSpec.model_validate(MOE if layout.endswith("moe") else DENSE)
    dims = {"fsdp": ParallelDims(world, 1, 1, world), "fsdp-moe": ParallelDims(world, 1, 1, world),
            "tp": ParallelDims(1, world, 1, world), "tp-moe": ParallelDims(1, world, 1, world),
            "dptp": ParallelDims(2, world // 2, 1, world),
            "ddp": ParallelDims(world, 1, 1, world, replicate=True),
            "ep-moe": ParallelDims(world, 1, 2, world)}[layout]
    meshes = build_meshes(dims, "cpu")
    model = build_model(spec, device="meta")
    parallelize(model, dims, meshes, device=torch.device("cpu"))
    model.to_empty(device="cpu")
    model.init_weights(0)
    ref = build_model(spec, device="cpu")
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p.detach()) for n, p in model.named_parameters()}
    ref.load_state_dict(full, strict=False)
    kw = {} if ns_dtype is None else {"ns_dtype": ns_dtype}
    if bucket is not None:
        kw["bucket_bytes"] = bucket

    def make(m):
        mats, decay, no_decay = optim.param_groups(m)
        return optim.Muon([{"params": mats, "kind": "muon", "weight_decay": 0.1},
                           {"params": decay, "kind": "adamw", "weight_decay": 0.1},
                           {"params": no_decay, "kind": "adamw", "weight_decay": 0.0}], lr=0.02, **kw), mats

    opt, mats = make(model)
    ref_opt, _ = make(ref)
    ref_params = dict(ref.named_parameters())
    placements = {}
    steps = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 + step)
        for n, p in model.named_parameters():
            g = torch.randn(ref_params[n].shape, generator=gen)
            ref_params[n].grad = g.clone()
            if isinstance(p, DTensor):
                p.grad = DTensor.from_local(g, p.device_mesh, [Replicate()] * p.device_mesh.ndim,
                                            run_check=False).redistribute(p.device_mesh, p.placements)
                placements[n] = str(p.placements)
            else:
                p.grad = g
        ref_opt.step()
        mode = CollectiveBytes(rank)
        with mode:
            opt.step()
        steps.append({"sent": mode.sent, "recv": mode.recv, "ops": sorted({o[0] for o in mode.ops}),
                      "calls": len(mode.ops)})
    diff = {}
    for n, p in model.named_parameters():
        got = (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        diff[n] = float((got - ref_params[n].detach()).abs().max())
    # The matrices whose NS needs a communication: sharded over > 1 rank, not whole experts.
    mom, rows = 0, []
    for p in mats:
        if isinstance(p, DTensor) and p.device_mesh.size() > 1 and not getattr(optim, "_expert_local", lambda p: p.ndim == 3)(p):
            mom += p.to_local().numel() * p.to_local().element_size()
            rows.append(tuple(p.to_local().shape))
    result = json.dumps({"rank": rank, "max_diff": max(diff.values()), "worst": max(diff, key=diff.get),
                         "momentum_bytes": mom, "steps": steps, "local_shapes": rows,
                         "placements": sorted(set(placements.values()))})
    with open(os.path.join(case["out"], f"rank{rank}.json"), "w") as f:
        f.write(result)
    print("RESULT " + result, flush=True)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    run_cases(sys.argv[1], check)
    dist.destroy_process_group()

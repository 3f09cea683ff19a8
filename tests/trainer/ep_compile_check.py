"""Run under torchrun (2 ranks, gloo): an expert-parallel MoE layer under torch.compile (backend
eager: graph breaks and recompiles do not depend on the backend) for 4 steps whose token counts
per expert differ. Prints the graphs after the first step and after the last, and the breaks."""
import torch, torch.distributed as dist
import torch._dynamo
from torch._dynamo.utils import counters
from orchestrator.plan.presets import ModelSpec
from trainer.model import MoE, Experts

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
spec = ModelSpec.model_validate({"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 64,
    "mlp": "swiglu", "moe": {"n_experts": 4, "top_k": 2, "d_expert": 32}})
torch.manual_seed(0)
moe = MoE(spec)
moe.ep_group, moe.ep_size = dist.group.WORLD, world
moe.experts = Experts(spec, 4 // world, 32)
for p in moe.parameters():
    torch.nn.init.normal_(p, std=0.02)
compiled = torch.compile(moe, backend="eager")
counters.clear()
for step in range(4):
    torch.manual_seed(100 * step + rank)
    x = torch.randn(2, 8, 32) * (1 + step)  # same shape, other routing
    compiled(x).sum().backward()
    if step == 0:
        first = counters["stats"]["unique_graphs"]
frames = counters["stats"]["unique_graphs"]
breaks = sum(counters["graph_break"].values())
print(f"RANK{rank} FIRST={first} GRAPHS={frames} BREAKS={breaks}", flush=True)
dist.destroy_process_group()

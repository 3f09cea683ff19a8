"""Known traps: each fires on its own spec and on none of the clean ones."""

from __future__ import annotations

import copy

import pytest

from orchestrator.plan.spec import parse_spec
from orchestrator.plan.traps import Trap, find_traps
from providers.base import Offer

# Clean jobs: a careful engineer's specs. No trap may fire on them.
CLEAN = {
    "gpt2-124m-8xh100": {
        "name": "gpt2",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8},
        "trainer": {"model": "gpt2-124m", "tokens": 10_000_000_000, "batch_size": 512, "seq_len": 1024,
                    "parallel": "auto"},
        "checkpoint": {"uri": "s3://bucket/runs/{name}"},
    },
    "llama3-8b-spot": {
        "name": "llama",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8, "spot": True},
        "trainer": {"model": "llama3-8b", "tokens": 2_000_000_000, "batch_size": 64, "seq_len": 8192,
                    "activation_checkpointing": "full", "parallel": "auto"},
        "checkpoint": {"uri": "s3://bucket/runs/{name}", "every_steps": "auto"},
    },
    "tiny-cpu": {
        "name": "tiny",
        "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 2},
        "trainer": {"model": "tiny", "steps": 50, "batch_size": 8, "seq_len": 64},
    },
    "moe-small-8xh100": {
        "name": "moe",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8},
        "trainer": {"model": "moe-small", "tokens": 5_000_000_000, "batch_size": 256, "seq_len": 2048,
                    "parallel": "auto"},
        "checkpoint": {"uri": "s3://bucket/runs/{name}"},
    },
}


def spec_of(base: str, **edits):
    data = copy.deepcopy(CLEAN[base])
    for path, value in edits.items():
        node = data
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        if value is _DEL:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return parse_spec(data)


_DEL = object()
MOE_NONE = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128,
            "moe": {"n_experts": 4, "top_k": 2, "balance": "none"}}
H100x8 = Offer("fake", "us", "H100", 8, False, 2.5)

# (trap code, clean base, edits, offer)
TABLE = [
    ("fp16-on-bf16-gpu", "gpt2-124m-8xh100", {"trainer__precision": "fp16"}, None),
    ("fp16-on-bf16-gpu", "gpt2-124m-8xh100", {"trainer__precision": "fp16", "resources__gpu": "A100"}, None),
    ("spot-without-checkpoints", "llama3-8b-spot", {"checkpoint__every_steps": 10_000_000}, None),
    ("spot-checkpoints-on-node", "llama3-8b-spot",
     {"checkpoint__uri": "file:///tmp/runs/{name}", "resources__providers": ["runpod"]}, None),
    ("checkpoint-interval-too-long", "llama3-8b-spot", {"checkpoint__every_steps": 3000}, None),
    ("no-lr-warmup", "gpt2-124m-8xh100", {"trainer__warmup_steps": 0}, None),
    ("no-grad-clip", "gpt2-124m-8xh100", {"trainer__grad_clip": None}, None),
    ("moe-no-load-balancing", "tiny-cpu", {"trainer__model": MOE_NONE}, None),
    ("tp-across-nodes", "llama3-8b-spot",
     {"resources__gpus_per_node": 4, "resources__nodes": 2, "trainer__parallel": {"tp": 8}}, None),
    ("fsdp-across-nodes", "llama3-8b-spot", {"resources__nodes": 2, "trainer__parallel": {"dp_shard": 16}}, None),
    ("heavier-rung-than-needed", "gpt2-124m-8xh100", {"trainer__parallel": {"tp": 2}}, None),
    ("heavier-rung-than-needed", "gpt2-124m-8xh100", {"trainer__parallel": {"dp_shard": 8}}, None),
    ("debug-job-on-big-node", "gpt2-124m-8xh100",
     {"trainer__tokens": _DEL, "trainer__steps": 20, "trainer__batch_size": 8}, None),
    ("debug-job-on-big-node", "tiny-cpu",
     {"resources__gpu": "H100", "resources__providers": ["fake"], "resources__gpus_per_node": 1}, H100x8),
    ("fp32-at-scale", "llama3-8b-spot", {"trainer__precision": "fp32", "trainer__activation_checkpointing": "full",
                                         "resources__nodes": 2}, None),
    ("does-not-fit", "llama3-8b-spot", {"trainer__model": "llama3-70b"}, None),
    ("does-not-fit", "llama3-8b-spot", {"trainer__parallel": {"replicate": True}}, None),
]


@pytest.mark.parametrize("name", list(CLEAN))
def test_clean_specs_have_no_traps(name):
    spec = parse_spec(copy.deepcopy(CLEAN[name]))
    assert find_traps(spec, None, None) == []


@pytest.mark.parametrize("code,base,edits,offer", TABLE, ids=[f"{t[0]}-{i}" for i, t in enumerate(TABLE)])
def test_trap_fires(code, base, edits, offer):
    spec = spec_of(base, **edits)
    traps = find_traps(spec, offer, None)
    codes = [t.code for t in traps]
    assert code in codes, [t.message for t in traps]
    msg = next(t.message for t in traps if t.code == code)
    assert len(msg) > 30 and "\n" not in msg


def test_trap_messages_name_the_fix():
    t = {x.code: x for x in find_traps(spec_of("gpt2-124m-8xh100", trainer__precision="fp16"))}
    assert "bf16" in t["fp16-on-bf16-gpu"].message
    spec = spec_of("gpt2-124m-8xh100", **{"trainer__tokens": _DEL, "trainer__steps": 20, "trainer__batch_size": 8})
    t = {x.code: x for x in find_traps(spec)}
    assert "resources.gpu:" in t["debug-job-on-big-node"].message  # names the smallest GPU that fits
    assert isinstance(t["debug-job-on-big-node"], Trap)
    assert t["debug-job-on-big-node"].to_dict()["code"] == "debug-job-on-big-node"


def test_fp16_on_t4_is_fine():
    spec = spec_of("gpt2-124m-8xh100", trainer__precision="fp16", resources__gpu="T4",
                   resources__gpus_per_node=1, trainer__batch_size=8, trainer__micro_batch_size=1)
    assert "fp16-on-bf16-gpu" not in [t.code for t in find_traps(spec)]


def test_offer_overrides_resources():
    spec = spec_of("gpt2-124m-8xh100", trainer__precision="fp16")
    t4 = Offer("fake", "us", "T4", 8, False, 0.3)
    assert "fp16-on-bf16-gpu" not in [t.code for t in find_traps(spec, t4, None)]

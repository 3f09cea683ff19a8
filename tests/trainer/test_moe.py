"""MoE layer: dropless by default and equal to a per-token reference; the grouped GEMM equals the
per-expert loop in values and gradients; a capacity factor drops exactly the overflow
assignments; no host synchronisation and no torch.compile graph break in a dense block or in a
MoE block without expert parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orchestrator.plan.presets import ModelSpec
from trainer import model as tm

SPEC = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 4, "max_seq_len": 64, "mlp": "swiglu",
        "norm": "rmsnorm", "bias": True, "moe": {"n_experts": 4, "top_k": 2, "d_expert": 48, "balance": "aux_loss"}}


def _moe(spec: dict) -> tm.MoE:
    torch.manual_seed(0)
    ms = ModelSpec.model_validate(spec)
    m = tm.MoE(ms)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m


def _reference(m: tm.MoE, x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Token by token, expert by expert, with first-come capacity."""
    xf = x.reshape(-1, x.shape[-1])
    probs = F.softmax(m.router(xf).float(), -1)
    sel = torch.topk(probs + m.expert_bias, m.top_k, -1).indices
    gates = probs.gather(1, sel)
    gates = gates / gates.sum(-1, keepdim=True)
    ex = m.experts
    out = torch.zeros_like(xf)
    N, E, k = xf.shape[0], m.n_experts, m.top_k
    limit = None if cap is None else max(1, -(-int(cap * N * k) // E))
    taken = [0] * E
    for t in range(N):
        for j in range(k):
            e = int(sel[t, j])
            if limit is not None:
                taken[e] += 1
                if taken[e] > limit:
                    continue
            h = xf[t] @ ex.w1[e] + ex.b1[e]
            g = xf[t] @ ex.w3[e] + ex.b3[e]
            y = (F.silu(h) * g) @ ex.w2[e] + ex.b2[e]
            out[t] += gates[t, j] * y
    return out.view_as(x)


@pytest.mark.parametrize("cap", [None, 0.5])
def test_dropless_default_and_capacity_match_the_per_token_reference(cap):
    spec = {**SPEC, "moe": {**SPEC["moe"], **({"capacity_factor": cap} if cap else {})}}
    m = _moe(spec)
    assert (m.capacity_factor is None) == (cap is None)  # dropless is the default
    x = torch.randn(2, 24, 32)
    torch.testing.assert_close(m(x), _reference(m, x, cap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cap", [None, 0.5])
def test_gradients_match_the_per_token_reference(cap):
    """The routing's own backward (dispatch and combine gather through the inverse permutation)
    gives autograd's gradients of the per-token reference: input, router, experts."""
    spec = {**SPEC, "moe": {**SPEC["moe"], **({"capacity_factor": cap} if cap else {})}}
    m = _moe(spec)
    x = torch.randn(2, 24, 32, requires_grad=True)
    g = torch.randn(2, 24, 32)
    (m(x) * g).sum().backward()
    got = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    (_reference(m, x, cap) * g).sum().backward()
    want = [p.grad for p in m.parameters()] + [x.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_equals_the_loop_in_values_and_gradients(monkeypatch):
    m = _moe(SPEC)
    x = torch.randn(2, 24, 32, requires_grad=True)
    g = torch.randn(2, 24, 32)
    assert tm._gmm_ok(torch.zeros(1, 32), torch.zeros(1, 32, 48))  # the grouped kernel is used here
    (m(x) * g).sum().backward()
    got = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    monkeypatch.setattr("trainer.moe._gmm_ok", lambda *a: False)
    (m(x) * g).sum().backward()
    want = [p.grad for p in m.parameters()] + [x.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_host_sync_in_the_moe_forward_without_ep(monkeypatch):
    """A host sync is a device→host read (``.item()``, ``.tolist()``, boolean indexing, ``bincount``'s
    size): make every one of them fail and run forward + backward."""
    m = _moe(SPEC)
    x = torch.randn(2, 24, 32, requires_grad=True)

    def boom(*a, **k):
        raise AssertionError("host sync")

    for name in ("item", "tolist", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    monkeypatch.setattr(torch, "bincount", boom)
    monkeypatch.setattr(torch, "nonzero", boom)
    m(x).sum().backward()


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_no_graph_break_in_a_block(moe):
    spec = SPEC if moe else {k: v for k, v in SPEC.items() if k != "moe"}
    block = tm.Block(ModelSpec.model_validate(spec), 0).to(torch.bfloat16)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(block)(torch.randn(2, 16, 32, dtype=torch.bfloat16))
    assert ex.graph_break_count == 0, ex.break_reasons


def test_attention_uses_sdpa_gqa_and_a_cached_rope_table(monkeypatch):
    """Grouped-query attention without copying kv heads (SDPA ``enable_gqa``), same result as the
    repeat; the rotary table is built once per shape, not per layer and step."""
    spec = ModelSpec.model_validate({"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4,
                                     "n_kv_heads": 2, "max_seq_len": 64})
    torch.manual_seed(0)
    attn = tm.Attention(spec)
    x = torch.randn(2, 16, 32)
    tm._ROPE_CACHE.clear()
    y = attn(x)

    def no_repeat(*a, **k):
        raise AssertionError("kv heads copied")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", no_repeat)
    torch.testing.assert_close(attn(x), y)
    assert len(tm._ROPE_CACHE) == 1
    table = next(iter(tm._ROPE_CACHE.values()))
    attn(x)
    assert next(iter(tm._ROPE_CACHE.values())) is table
    monkeypatch.undo()
    # Reference: explicit repeat of kv heads.
    B, T, _ = x.shape
    q = tm._rope(attn.wq(x).view(B, T, -1, 8)).transpose(1, 2)
    k = tm._rope(attn.wk(x).view(B, T, -1, 8)).transpose(1, 2).repeat_interleave(2, 1)
    v = attn.wv(x).view(B, T, -1, 8).transpose(1, 2).repeat_interleave(2, 1)
    ref = attn.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(y, ref)

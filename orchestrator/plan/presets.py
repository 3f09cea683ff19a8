"""Model shapes shared by the orchestrator (estimate, planner) and the trainer (build).

Pure Python: importing this module imports neither torch nor anything heavy, so the dry run can
count parameters and FLOPs without the trainer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class MoESpec(BaseModel):
    """Mixture-of-experts feed-forward layers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_experts: int = Field(8, gt=0)
    """Routed experts per MoE layer."""
    top_k: int = Field(2, gt=0)
    """Experts each token is routed to."""
    capacity_factor: float | None = Field(None, gt=0)
    """None (default): dropless — every routed token is processed (torchtitan, Megatron). A
    number: tokens an expert accepts, as a multiple of its fair share; overflow assignments are
    dropped (their gate is zeroed: the token keeps the residual for that slot)."""
    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"
    """Load balancing: an auxiliary loss (Switch/GShard) or a DeepSeek-V3 style router-bias update."""
    aux_loss_coef: float = Field(0.01, ge=0)
    """Weight of the auxiliary load-balancing loss."""
    bias_update_rate: float = Field(0.001, ge=0)
    """Step size of the DeepSeek-style bias update (balance: bias)."""
    every: int = Field(1, gt=0)
    """Make every N-th block a MoE block (1 = all blocks)."""
    d_expert: int | None = Field(None, gt=0)
    """Hidden size of one expert; defaults to the dense d_ff."""

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must not exceed n_experts ({self.n_experts})")
        return self


class ModelSpec(BaseModel):
    """An explicit GPT shape (or the resolved shape of a preset)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(50304, gt=0)
    """Vocabulary size (GPT-2's 50257 rounded up to a multiple of 64)."""
    d_model: int = Field(768, gt=0)
    """Width of the residual stream."""
    n_layers: int = Field(12, gt=0)
    """Transformer blocks."""
    n_heads: int = Field(12, gt=0)
    """Attention heads."""
    n_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads for grouped-query attention; defaults to n_heads."""
    d_ff: int | None = Field(None, gt=0)
    """Feed-forward hidden size; defaults to 4 × d_model (gelu) or ~8/3 × d_model (swiglu)."""
    mlp: Literal["gelu", "swiglu"] = "gelu"
    """Feed-forward kind."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Normalisation layer."""
    pos: Literal["rope", "learned"] = "rope"
    """Rotary or learned absolute positions."""
    max_seq_len: int = Field(1024, gt=0)
    """Longest sequence the model supports (sizes learned position tables)."""
    tie_embeddings: bool = True
    """Share the token embedding with the output head."""
    bias: bool = False
    """Biases in linear layers."""
    qk_norm: bool = False
    """Normalise queries and keys per head before attention (stabilises large LR)."""
    moe: MoESpec | None = None
    """Mixture-of-experts feed-forward; None for a dense model."""

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})")
        if self.pos == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim (d_model/n_heads = {self.head_dim})")
        return self

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ff_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.mlp == "gelu":
            return 4 * self.d_model
        hidden = int(8 * self.d_model / 3)
        return 256 * ((hidden + 255) // 256)

    @property
    def expert_dim(self) -> int:
        assert self.moe is not None
        return self.moe.d_expert or self.ff_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and (i % self.moe.every) == self.moe.every - 1

    def _mlp_params(self, hidden: int) -> int:
        mats = 3 if self.mlp == "swiglu" else 2
        p = mats * self.d_model * hidden
        if self.bias:
            p += (2 if self.mlp == "swiglu" else 1) * hidden + self.d_model
        return p

    def _norm_params(self) -> int:
        return self.d_model * (2 if (self.norm == "layernorm" and self.bias) else 1)

    def layer_params(self, i: int) -> dict[str, int]:
        """Parameters of block ``i`` by group: attention, mlp (dense or all experts), router, norms."""
        d, hd = self.d_model, self.head_dim
        attn = d * (self.n_heads * hd) + 2 * d * (self.kv_heads * hd) + (self.n_heads * hd) * d
        if self.bias:
            attn += self.n_heads * hd + 2 * self.kv_heads * hd + d
        if self.qk_norm:
            attn += 2 * hd
        norms = 2 * self._norm_params()
        if self.is_moe_layer(i):
            assert self.moe is not None
            return {
                "attention": attn,
                "experts": self.moe.n_experts * self._mlp_params(self.expert_dim),
                "router": d * self.moe.n_experts,
                "norms": norms,
            }
        return {"attention": attn, "mlp": self._mlp_params(self.ff_dim), "norms": norms}

    def num_params(self) -> int:
        """Every parameter, embeddings included (tied embeddings counted once)."""
        total = self.vocab_size * self.d_model  # token embedding
        if self.pos == "learned":
            total += self.max_seq_len * self.d_model
        for i in range(self.n_layers):
            total += sum(self.layer_params(i).values())
        total += self._norm_params()  # final norm
        if not self.tie_embeddings:
            total += self.vocab_size * self.d_model
        return total

    def active_params(self) -> int:
        """Parameters one token touches: for MoE, top_k experts instead of all of them."""
        total = self.num_params()
        if self.moe is None:
            return total
        for i in range(self.n_layers):
            if self.is_moe_layer(i):
                per_expert = self._mlp_params(self.expert_dim)
                total -= (self.moe.n_experts - self.moe.top_k) * per_expert
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 × active non-embedding params (and the head) + causal
        attention. PaLM's appendix B counts attention as 12·L·d·T, every query against every key;
        a causal kernel (flash, SDPA ``is_causal``) computes only the lower triangle, about half:
        6·L·d·T. Counting the full square made MFU read high (1.12× for llama3-8b at T = 8192)."""
        non_embed = self.active_params() - self.vocab_size * self.d_model
        if self.pos == "learned":
            non_embed -= self.max_seq_len * self.d_model
        head = self.vocab_size * self.d_model  # the output projection is a matmul either way
        return 6.0 * (non_embed + head) + 6.0 * self.n_layers * self.d_model * seq_len


PRESETS: dict[str, ModelSpec] = {
    # CPU tests: trains in seconds.
    "tiny": ModelSpec(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=128),
    # CPU tests of expert parallelism.
    "tiny-moe": ModelSpec(
        vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=128,
        moe=MoESpec(n_experts=4, top_k=2),
    ),
    # The classic reproduction (nanoGPT / llm.c): target validation loss ~3.28 on FineWeb 10B.
    "gpt2-124m": ModelSpec(
        vocab_size=50304, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024,
        pos="learned", bias=True,
    ),
    "gpt2-1.5b": ModelSpec(
        vocab_size=50304, d_model=1600, n_layers=48, n_heads=25, max_seq_len=1024,
        pos="learned", bias=True,
    ),
    "llama3-8b": ModelSpec(
        vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
        mlp="swiglu", norm="rmsnorm", pos="rope", max_seq_len=8192, tie_embeddings=False,
    ),
    "llama3-70b": ModelSpec(
        vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
        mlp="swiglu", norm="rmsnorm", pos="rope", max_seq_len=8192, tie_embeddings=False,
    ),
    # A small MoE (~0.5B total, ~0.2B active) for expert-parallel runs on one 8-GPU node.
    "moe-small": ModelSpec(
        vocab_size=50304, d_model=768, n_layers=12, n_heads=12, max_seq_len=2048,
        mlp="swiglu", norm="rmsnorm", pos="rope", d_ff=2048,
        moe=MoESpec(n_experts=8, top_k=2, d_expert=2048, balance="bias"),
    ),
}


LOSS_CHUNK_BYTES = 256 << 20
"""fp32 logits bytes the trainer's loss (``trainer.model.loss_fn``) upcasts at a time; the memory
planner (``plan/memory.py``) counts one such chunk. Here, beside the shapes, because both sides
read it and the trainer imports nothing of the planner."""


def resolve_model(model: str | ModelSpec) -> ModelSpec:
    """A preset name or an explicit shape → the shape."""
    if isinstance(model, ModelSpec):
        return model
    try:
        return PRESETS[model]
    except KeyError:
        raise ValueError(f"unknown model preset {model!r}; known: {', '.join(PRESETS)}") from None

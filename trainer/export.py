"""``dtrun weights``: the model (no optimizer state) out of a DCP checkpoint, tensor by tensor.

The checkpoint is any COMMITTED ``<run-uri>/checkpoints/step-N/`` whatever layout wrote it (FSDP
over 4 ranks, TP, one process): DCP's metadata names every ``model.*`` tensor with its global
shape, and ``dcp.load`` of a one-tensor state dict (``allow_partial_load``) assembles that tensor
from whichever shard files hold its pieces. One tensor is in memory at a time (the GPT-2 layout's
fused ``c_attn`` holds three), so a model larger than this machine's memory still exports.

The safetensors file is written by hand, streaming: the header (names, dtypes, shapes, offsets)
is known from the metadata before any tensor is read; then each tensor's bytes are appended.

Formats:

* ``safetensors``: dtrun's own parameter names, ``model.safetensors`` + ``config.json`` holding the
  ``ModelSpec`` (``trainer.model.build_model`` loads it: ``load_dtrun``).
* ``hf``: a folder ``transformers`` loads with its standard class: ``LlamaForCausalLM`` for
  llama-style models (rotary positions, RMSNorm, SwiGLU; dtrun's rotary pairs ``(i, i + D/2)`` are
  Llama's ``rotate_half``, so no permutation), ``GPT2LMHeadModel`` for the classic GPT-2 shape
  (learned positions, LayerNorm, GELU MLP, no grouped-query heads; Conv1D weights transposed,
  q/k/v fused into ``c_attn``; absent biases written as zeros). Shapes neither class computes
  exactly (MoE, QK-norm, rotary with LayerNorm…) are refused with a message; use ``safetensors``.
  The data's ``tokenizer.json`` (from the ``data prepare`` manifest) is copied beside the weights.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Any, Callable

import torch

from orchestrator.contract import runuri
from orchestrator.plan.presets import ModelSpec


GROUP_BYTES = int(float(os.environ.get("DTRUN_EXPORT_GROUP_MB", "256")) * (1 << 20))
"""Checkpoint bytes read per ``dcp.load`` while exporting (the export's memory, beside one output
tensor; a single larger tensor is read alone). ``DTRUN_EXPORT_GROUP_MB`` changes it."""


class ExportError(ValueError):
    """The checkpoint or format cannot be exported (the message says why)."""


_ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
             torch.int32: "I32", torch.float64: "F64"}


@dataclass
class _Out:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    sources: tuple[str, ...]  # checkpoint tensors it is made of
    fn: Callable[..., torch.Tensor] = lambda t: t  # sources → the output tensor

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def pick_checkpoint(run_uri: str, step: int | None) -> tuple[int, str]:
    if step is None:
        lc = runuri.latest_committed(run_uri)
        if lc is None:
            raise ExportError(f"{run_uri}: no COMMITTED checkpoint yet")
        step = lc[0]
    elif runuri.committed(run_uri, step) is None:
        have = [s for s in runuri.checkpoint_steps(run_uri) if runuri.committed(run_uri, s) is not None]
        raise ExportError(f"{run_uri}: no COMMITTED checkpoint at step {step} (committed: {have or 'none'})")
    return step, runuri.checkpoint_uri(run_uri, step)


class _Reader:
    """One tensor at a time from a DCP checkpoint."""

    def __init__(self, uri: str):
        from trainer.checkpoint import _reader

        self.uri = uri
        # One reader, its metadata read once: dcp.load asks for it on every call (a GET each on S3).
        self._rd = _reader(uri)
        full = self._rd.read_metadata()
        self._rd.read_metadata = lambda *a, **k: full
        md = full.state_dict_metadata
        self.meta = {k[len("model."):]: v for k, v in md.items() if k.startswith("model.") and hasattr(v, "size")}
        if not self.meta:
            raise ExportError(f"{uri}: the checkpoint holds no model tensors")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta[name].size)

    def dtype(self, name: str) -> torch.dtype:
        return self.meta[name].properties.dtype

    def nbytes(self, name: str) -> int:
        if name.startswith("zeros:"):
            return 0
        return torch.empty(self.shape(name), dtype=self.dtype(name), device="meta").nbytes

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full tensors for ``names`` (one ``dcp.load``: each shard file is read once per group)."""
        import warnings

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner

        sd = {"model": {n: torch.empty(self.shape(n), dtype=self.dtype(n)) for n in names}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, storage_reader=self._rd, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
        return sd["model"]


def write_safetensors(path: str, items: list[_Out], reader: "_Reader", metadata: dict[str, str] | None = None,
                      group_bytes: int | None = None) -> None:
    """A safetensors file, streamed: header first, then each tensor's bytes in order. Source
    tensors are read in groups of consecutive items up to ``group_bytes`` (one ``dcp.load`` each;
    a single tensor larger than that is its own group): memory stays near ``group_bytes``."""
    group_bytes = GROUP_BYTES if group_bytes is None else group_bytes
    header: dict[str, Any] = {"__metadata__": metadata or {}}
    off = 0
    for it in items:
        header[it.name] = {"dtype": _ST_DTYPE[it.dtype], "shape": list(it.shape), "data_offsets": [off, off + it.nbytes]}
        off += it.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        i = 0
        while i < len(items):
            j, size, names = i, 0, []
            while j < len(items) and (j == i or size + sum(reader.nbytes(n) for n in items[j].sources) <= group_bytes):
                for n in items[j].sources:
                    if n not in names:
                        names.append(n)
                        size += reader.nbytes(n)
                j += 1
            loaded = reader.load([n for n in names if not n.startswith("zeros:")])
            for it in items[i:j]:
                t = it.fn(*[loaded.get(n) for n in it.sources]).to(it.dtype).contiguous()
                if tuple(t.shape) != it.shape:
                    raise ExportError(f"{it.name}: shape {tuple(t.shape)}, planned {it.shape}")
                f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                del t
            del loaded
            i = j
    os.replace(tmp, path)


def hf_arch(ms: ModelSpec) -> str | None:
    """``llama`` / ``gpt2`` when transformers has a standard class for this shape, else None."""
    if ms.moe is not None or ms.qk_norm:
        return None
    if ms.pos == "rope" and ms.norm == "rmsnorm" and ms.mlp == "swiglu":
        return "llama"
    if ms.pos == "learned" and ms.norm == "layernorm" and ms.mlp == "gelu" and ms.kv_heads == ms.n_heads:
        return "gpt2"
    return None


def _plan_dtrun(r: _Reader, ms: ModelSpec) -> list[_Out]:
    names = [n for n in r.meta if not (ms.tie_embeddings and n == "head.weight")]
    return [_Out(n, r.shape(n), r.dtype(n), (n,)) for n in names]


def _plan_llama(r: _Reader, ms: ModelSpec) -> list[_Out]:
    m = {"tok_emb.weight": "model.embed_tokens.weight"}
    for i in range(ms.n_layers):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        for a, b in (("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")):
            m[p + a + ".weight"] = q + b + ".weight"
        for a, b in (("attn.wq", "self_attn.q_proj"), ("attn.wk", "self_attn.k_proj"), ("attn.wv", "self_attn.v_proj"),
                     ("attn.wo", "self_attn.o_proj"), ("ffn.w1", "mlp.gate_proj"), ("ffn.w3", "mlp.up_proj"),
                     ("ffn.w2", "mlp.down_proj")):
            m[p + a + ".weight"] = q + b + ".weight"
            if ms.bias:
                m[p + a + ".bias"] = q + b + ".bias"
    m["norm.weight"] = "model.norm.weight"
    if not ms.tie_embeddings:
        m["head.weight"] = "lm_head.weight"
    missing = [k for k in m if k not in r.meta]
    if missing:
        raise ExportError(f"the checkpoint lacks {missing[:3]} for a Llama export")
    return [_Out(b, r.shape(a), r.dtype(a), (a,)) for a, b in m.items()]


def _plan_gpt2(r: _Reader, ms: ModelSpec) -> list[_Out]:
    d, ff, dt = ms.d_model, ms.ff_dim, r.dtype("tok_emb.weight")

    def src(name: str, n: int) -> str:  # an absent bias is written as zeros (GPT-2 always has them)
        return name if name in r.meta else f"zeros:{n}"

    def fix(*ts: torch.Tensor | None, n: int = 0) -> list[torch.Tensor]:
        return [t if t is not None else torch.zeros(n, dtype=dt) for t in ts]

    out = [_Out("transformer.wte.weight", r.shape("tok_emb.weight"), dt, ("tok_emb.weight",)),
           _Out("transformer.wpe.weight", r.shape("pos_emb.weight"), dt, ("pos_emb.weight",))]
    for i in range(ms.n_layers):
        p, q = f"layers.{i}.", f"transformer.h.{i}."
        for a, b in (("norm1", "ln_1"), ("norm2", "ln_2")):
            out.append(_Out(q + b + ".weight", (d,), dt, (p + a + ".weight",)))
            out.append(_Out(q + b + ".bias", (d,), dt, (src(p + a + ".bias", d),), lambda t: fix(t, n=d)[0]))
        out.append(_Out(q + "attn.c_attn.weight", (d, 3 * d), dt, tuple(p + f"attn.{w}.weight" for w in ("wq", "wk", "wv")),
                        lambda a, b, c: torch.cat([a.t(), b.t(), c.t()], 1)))
        out.append(_Out(q + "attn.c_attn.bias", (3 * d,), dt, tuple(src(p + f"attn.{w}.bias", d) for w in ("wq", "wk", "wv")),
                        lambda a, b, c: torch.cat(fix(a, b, c, n=d))))
        out.append(_Out(q + "attn.c_proj.weight", (d, d), dt, (p + "attn.wo.weight",), lambda t: t.t()))
        out.append(_Out(q + "attn.c_proj.bias", (d,), dt, (src(p + "attn.wo.bias", d),), lambda t: fix(t, n=d)[0]))
        out.append(_Out(q + "mlp.c_fc.weight", (d, ff), dt, (p + "ffn.w1.weight",), lambda t: t.t()))
        out.append(_Out(q + "mlp.c_fc.bias", (ff,), dt, (src(p + "ffn.w1.bias", ff),), lambda t: fix(t, n=ff)[0]))
        out.append(_Out(q + "mlp.c_proj.weight", (ff, d), dt, (p + "ffn.w2.weight",), lambda t: t.t()))
        out.append(_Out(q + "mlp.c_proj.bias", (d,), dt, (src(p + "ffn.w2.bias", d),), lambda t: fix(t, n=d)[0]))
    out.append(_Out("transformer.ln_f.weight", (d,), dt, ("norm.weight",)))
    out.append(_Out("transformer.ln_f.bias", (d,), dt, (src("norm.bias", d),), lambda t: fix(t, n=d)[0]))
    if not ms.tie_embeddings:
        out.append(_Out("lm_head.weight", r.shape("head.weight"), dt, ("head.weight",)))
    return out


def hf_config(ms: ModelSpec, arch: str, eot: int | None) -> dict[str, Any]:
    common = {"vocab_size": ms.vocab_size, "tie_word_embeddings": ms.tie_embeddings, "torch_dtype": "float32",
              "bos_token_id": eot, "eos_token_id": eot, "use_cache": True}
    if arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": ms.d_model,
                "intermediate_size": ms.ff_dim, "num_hidden_layers": ms.n_layers, "num_attention_heads": ms.n_heads,
                "num_key_value_heads": ms.kv_heads, "head_dim": ms.head_dim, "max_position_embeddings": ms.max_seq_len,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                "hidden_act": "silu", "attention_bias": ms.bias, "mlp_bias": ms.bias, "attention_dropout": 0.0,
                "initializer_range": 0.02, **common}
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": ms.d_model, "n_layer": ms.n_layers,
            "n_head": ms.n_heads, "n_positions": ms.max_seq_len, "n_ctx": ms.max_seq_len, "n_inner": ms.ff_dim,
            "activation_function": "gelu", "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "scale_attn_weights": True, "initializer_range": 0.02, **common}


def export(run_uri: str, ms: ModelSpec, out_dir: str, *, step: int | None = None, fmt: str = "safetensors",
           manifest: dict[str, Any] | None = None, data_uri: str | None = None) -> dict[str, Any]:
    """Write the weights of ``step`` (default newest COMMITTED) into ``out_dir``; returns a summary."""
    if fmt not in ("safetensors", "hf"):
        raise ExportError(f"--format {fmt!r}: use safetensors or hf")
    arch = hf_arch(ms) if fmt == "hf" else None
    if fmt == "hf" and arch is None:
        raise ExportError(
            "--format hf: transformers has no standard class for this model's shape (Llama needs rotary "
            "positions + rmsnorm + swiglu; GPT-2 needs learned positions + layernorm + gelu and no grouped-query "
            f"heads; neither takes MoE or qk_norm; this one is pos={ms.pos}, norm={ms.norm}, mlp={ms.mlp}"
            f"{', moe' if ms.moe else ''}{', qk_norm' if ms.qk_norm else ''}); use --format safetensors")
    step, ck = pick_checkpoint(run_uri, step)
    r = _Reader(ck)
    want = {n: tuple(s) for n, s in _expected_shapes(ms).items()}
    got = {n: r.shape(n) for n in r.meta}
    bad = [n for n in want if want[n] != got.get(n)]
    if bad:
        raise ExportError(f"{ck}: saved from a different model shape than the job's trainer.model "
                          f"({bad[0]}: checkpoint {got.get(bad[0])} vs model {want[bad[0]]})")
    plan = {"safetensors": _plan_dtrun, "llama": _plan_llama, "gpt2": _plan_gpt2}[arch or "safetensors"](r, ms)
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), plan, r,
                      {"format": "pt", "dtrun_step": str(step), "dtrun_run_uri": run_uri})
    eot = (manifest or {}).get("tokenizer", {}).get("eot") if manifest else None
    if arch is None:
        cfg: dict[str, Any] = {"dtrun_model": ms.model_dump(mode="json"), "step": step, "run_uri": run_uri}
    else:
        cfg = hf_config(ms, arch, eot)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1, sort_keys=True)
    tok_files = _copy_tokenizer(manifest, data_uri, out_dir, eot, hf=arch is not None)
    if arch is not None:
        with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": eot, "eos_token_id": eot}, f)
    return {"step": step, "checkpoint": ck, "format": arch or "safetensors", "tensors": len(plan),
            "bytes": sum(p.nbytes for p in plan), "out": out_dir, "tokenizer_files": tok_files}


def _expected_shapes(ms: ModelSpec) -> dict[str, tuple[int, ...]]:
    from trainer.model import build_model

    m = build_model(ms, device="meta")
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def _copy_tokenizer(manifest: dict[str, Any] | None, data_uri: str | None, out_dir: str, eot: int | None,
                    hf: bool) -> list[str]:
    t = (manifest or {}).get("tokenizer") or {}
    if not t.get("file") or not data_uri:
        return []
    fs, path = runuri._fs(runuri.join(data_uri, t["file"]))
    with fs.open(path, "rb") as f, open(os.path.join(out_dir, "tokenizer.json"), "wb") as g:
        shutil.copyfileobj(f, g)
    files = ["tokenizer.json"]
    if hf:
        vocab = json.load(open(os.path.join(out_dir, "tokenizer.json"))).get("added_tokens") or []
        eot_tok = next((a["content"] for a in vocab if a.get("id") == eot), None)
        if eot_tok:
            _start_documents_with(os.path.join(out_dir, "tokenizer.json"), eot_tok, eot)
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
        if eot_tok:
            cfg.update(bos_token=eot_tok, eos_token=eot_tok, unk_token=eot_tok)
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        files.append("tokenizer_config.json")
    return files


def _start_documents_with(path: str, eot_tok: str, eot: int) -> None:
    """The exported tokenizer puts the end-of-text token before a text, as ``data prepare`` put it
    before every document and ``dtrun sample`` before its prompt: ``transformers`` then continues a
    prompt from the same context (greedy continuations identical). ``add_special_tokens=False``
    encodes without it."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import processors

    tok = HFTok.from_file(path)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{eot_tok} $A", pair=f"{eot_tok} $A {eot_tok} $B:1", special_tokens=[(eot_tok, eot)])
    tok.save(path)


def load_dtrun(out_dir: str):
    """The dtrun GPT from a ``--format safetensors`` export (for tests and sampling)."""
    from safetensors.torch import load_file

    from trainer.model import build_model

    cfg = json.load(open(os.path.join(out_dir, "config.json")))
    ms = ModelSpec.model_validate(cfg["dtrun_model"])
    model = build_model(ms, device="cpu")
    sd = load_file(os.path.join(out_dir, "model.safetensors"))
    if ms.tie_embeddings:
        sd["head.weight"] = sd["tok_emb.weight"]
    model.load_state_dict(sd, strict=True)
    return model


def load_model_from_checkpoint(run_uri: str, ms: ModelSpec, step: int | None = None, device: str = "cpu"):
    """(model in eval mode, step): the full model from a checkpoint, for ``dtrun sample``."""
    from trainer.model import build_model

    step, ck = pick_checkpoint(run_uri, step)
    r = _Reader(ck)
    model = build_model(ms, device="cpu")
    sd = model.state_dict()
    missing = [k for k in sd if k not in r.meta]
    if missing:
        raise ExportError(f"{ck}: saved from a different model ({missing[0]} missing)")
    with torch.no_grad():
        loaded = r.load(list(sd))
        for k, v in sd.items():
            t = loaded[k]
            if tuple(t.shape) != tuple(v.shape):
                raise ExportError(f"{ck}: {k} is {tuple(t.shape)} in the checkpoint, {tuple(v.shape)} in the model")
            v.copy_(t)
    return model.to(device).eval(), step

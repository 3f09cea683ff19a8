"""Issue 32, the planner side: PP and CP in the memory model (bytes per stage and per context
shard against hand-computed numbers; the in-flight microbatches against torch's own schedules),
the bubble formula, the ladder choosing PP across nodes (llama3-70b on 2 × 8 H100) or refusing
with a reason, and the dry run pricing the bubble."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from orchestrator.cli.app import main
from orchestrator.plan import planner
from orchestrator.plan.hours import RECOMPUTE_FACTOR
from orchestrator.plan.ladder import candidate_rungs, cp_supported, evaluate_rung
from orchestrator.plan.memory import block_activation_bytes
from orchestrator.plan.pipeline import (
    ZB_RESIDUAL, bubble_fraction, evaluate_pp_cp, in_flight, microbatch_problem, rank_bytes, rank_layers,
)
from orchestrator.plan.presets import PRESETS
from orchestrator.plan.spec import Parallel, parse_spec


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch, provider_credentials):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "home"))


def data(model="llama3-70b", gpu="H100", gpn=8, nodes=2, parallel="auto", **trainer):
    return {
        "name": "pp-plan",
        "resources": {"providers": ["lambda"], "gpu": gpu, "gpus_per_node": gpn, "nodes": nodes, "spot": False},
        "trainer": {"model": model, "parallel": parallel, "tokens": 1_000_000_000, "batch_size": 512,
                    "seq_len": 8192, "data": "synthetic", **trainer},
        "checkpoint": {"uri": "s3://my-bucket/dtrun/{name}"},
        "budget": {"max_usd": 100_000},
    }


# ---- in-flight microbatches: the planner's counts are torch's ---------------------------------

def _torch_peak_chunks(cls_name: str, p: int, v: int, m: int, rank: int, vshape: bool) -> int:
    """Replay torch's own action list for one rank: +1 per forward, −1 per full or weight backward
    (a chunk's activations are held from its forward until its backward has consumed them).
    The stages are only the attributes the schedule reads to build its order: nothing runs."""
    from torch.distributed import pipelining

    ids = [rank, 2 * p - 1 - rank] if vshape else [rank + k * p for k in range(v)]
    stages = [SimpleNamespace(num_stages=p * v, group_size=p, group_rank=rank, stage_index=i, is_first=i == 0,
                              is_last=i == p * v - 1, submod=None, stage_index_to_group_rank=None,
                              has_backward=True) for i in ids]
    sched = getattr(pipelining, cls_name)(stages, n_microbatches=m)

    def flat(a):
        yield from (x for s in a.sub_actions for x in flat(s)) if a.sub_actions else (a,)

    cur = peak = 0
    for action in sched.pipeline_order[rank]:
        for a in flat(action) if action is not None else ():
            t = a.computation_type.value
            cur += 1 if t == "F" else -1 if t in ("B", "W") else 0
            peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("schedule,cls,v,vshape", [
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, False),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 4, False),
    ("zbv", "ScheduleZBVZeroBubble", 2, True),
    ("dualpipev", "ScheduleDualPipeV", 2, True),
])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_in_flight_equals_torch_schedule(schedule, cls, v, vshape, p, m):
    for rank in range(p):
        torch_chunks = _torch_peak_chunks(cls, p, v, m, rank, vshape)
        assert in_flight(schedule, p, m, v, rank) * v == torch_chunks, (schedule, p, m, v, rank)


def test_in_flight_gpipe_1f1b_by_hand():
    # gpipe: every forward before the first backward; 1f1b: p − r warm-up forwards (capped at m).
    assert [in_flight("gpipe", 4, 8, 1, r) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, 8, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 2, 1, r) for r in range(4)] == [2, 2, 2, 1]


def test_rank_layers_follow_the_trainer_placement():
    assert rank_layers(8, 2, 1, "1f1b", 0) == ([0, 1, 2, 3], True, False)
    assert rank_layers(8, 2, 1, "1f1b", 1) == ([4, 5, 6, 7], False, True)
    assert rank_layers(8, 2, 2, "interleaved-1f1b", 0) == ([0, 1, 4, 5], True, False)
    assert rank_layers(8, 2, 2, "zbv", 0) == ([0, 1, 6, 7], True, True)  # V: first and last stage
    assert rank_layers(8, 2, 2, "zbv", 1) == ([2, 3, 4, 5], False, False)


# ---- the bubble --------------------------------------------------------------------------------

def test_bubble_formula():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(2, 4, 1, "gpipe") == pytest.approx(1 / 5)
    assert bubble_fraction(2, 4, 1, "1f1b") == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8, 1, "1f1b") == pytest.approx(3 / 11)
    assert bubble_fraction(2, 4, 2, "interleaved-1f1b") == pytest.approx(1 / 9)
    assert bubble_fraction(4, 8, 4, "interleaved-1f1b") == pytest.approx(3 / 35)
    assert bubble_fraction(2, 4, 2, "zbv") == pytest.approx(1 / 9 * ZB_RESIDUAL)
    assert bubble_fraction(2, 4, 2, "1f1b") == pytest.approx(1 / 5)  # one stage per rank whatever v says


# ---- bytes per stage, by hand ------------------------------------------------------------------

D, V, FF, KV, L = 8192, 128256, 28672, 1024, 80
LAYER = D * (D + 2 * KV) + D * D + 3 * D * FF + 2 * D  # wq, wk, wv; wo; w1, w2, w3; two norms


def test_llama70b_stage_state_by_hand():
    """pp 2 × dp_shard 8, AdamW: each rank holds 40 layers (and the embedding, or the norm and
    head) / 8, at 4 + 4 + 8 bytes a parameter. Every dimension divides by 8: no padding."""
    spec = parse_spec(data())
    par = Parallel(pp=2, dp_shard=8)
    r0 = rank_bytes(spec, par, 0, 1, 2, True, "full", True)
    r1 = rank_bytes(spec, par, 1, 1, 2, True, "full", True)
    n0, n1 = (V * D + 40 * LAYER) // 8, (40 * LAYER + D + V * D) // 8
    assert (r0["params"], r0["grads"], r0["optimizer"]) == (4 * n0, 4 * n0, 8 * n0)
    assert (r1["params"], r1["grads"], r1["optimizer"]) == (4 * n1, 4 * n1, 8 * n1)
    # 16 B/param of the whole model over 16 GPUs: ~70.6 GB each whatever the split — PP moves no state.
    assert (16 * n1) / 1e9 == pytest.approx(16 * PRESETS["llama3-70b"].num_params() / 16 / 1e9, rel=1e-4)


def test_llama70b_stage_activations_by_hand():
    """1f1b at pp 2, full checkpointing, micro-batch 1, bf16: rank 0 holds p = 2 microbatches of
    its 40 block inputs (s·h·2 bytes each) plus one block recomputed; rank 1 one microbatch, and
    its head: norm input (s·h·2), head input (s·h·2), the logits and their gradient (2 × s·V·2)
    and one 256 MiB fp32 loss chunk three times."""
    spec = parse_spec(data())
    s, a = 8192, 64
    block = 4 * s * D * 2 + 5 * s * D * 2 + 4 * a * s + s * FF * 2 * 4  # fused attention, swiglu
    par = Parallel(pp=2, dp_shard=8)
    r0 = rank_bytes(spec, par, 0, 1, 2, True, "full", True)
    r1 = rank_bytes(spec, par, 1, 1, 2, True, "full", True)
    assert r0["activations"] == 2 * 40 * s * D * 2 + block
    assert r1["activations"] == 1 * 40 * s * D * 2 + block + (2 * s * D * 2 + 2 * s * V * 2 + 3 * (256 << 20))
    # gpipe holds every one of the m = 64 microbatches (batch 512 / dp 8).
    g0 = rank_bytes(spec, par.model_copy(update={"pp_schedule": "gpipe"}), 0, 1, 2, True, "full", True)
    assert g0["activations"] == 64 * 40 * s * D * 2 + block


def test_cp_divides_tokens_and_adds_the_gathered_kv():
    """cp 2: every block saves what a seq/2 sequence would, plus K and V of the other half
    (2 · s/2 · h elements); the state is sharded over dp_shard × cp (FSDP's folded mesh)."""
    M = dict(vocab_size=32000, d_model=1024, n_layers=4, n_heads=8, n_kv_heads=8, d_ff=4096, mlp="swiglu",
             norm="rmsnorm", pos="rope", max_seq_len=65536, tie_embeddings=False)
    spec = parse_spec(data(M, gpn=2, nodes=1, batch_size=2, seq_len=32768))
    ms = spec.trainer.model_spec
    one = evaluate_pp_cp(spec, Parallel(dp_shard=2, cp=1), 1, 2, True, "none", True)
    two = evaluate_pp_cp(spec, Parallel(dp_shard=1, cp=2), 1, 2, True, "none", True)
    assert one["params"] == two["params"]  # 2 shards either way
    per_block = block_activation_bytes(ms, 0, 16384, 1, 2, fused_attention=True) + 2 * 16384 * 1024 * 2
    head = 16384 * 1024 * 2 * 2 + 16384 * 32000 * 2 * 2 + 3 * min(16384 * 32000 * 4, 256 << 20)
    assert two["activations"] == 4 * per_block + head
    assert two["activations"] < one["activations"]


# ---- the ladder --------------------------------------------------------------------------------

def test_70b_adamw_on_2x8_h100_fits_nowhere_and_says_what_would():
    """16 B/param × 70.6B over 16 GPUs is 70.6 GB each before activations and the 10 % + 2 GB
    overhead: no layout fits 80 GB, PP included. The refusal names the PP layouts that would."""
    spec = parse_spec(data())
    p = planner.auto_plan(spec)
    assert not p.fits
    pp = next(r for r in p.rungs if r.strategy == "pp2+fsdp-zero3")
    assert pp.breakdown["params"] + pp.breakdown["grads"] + pp.breakdown["optimizer"] > 70e9
    assert "4 nodes × 8 H100 fit with pp4+fsdp-zero3+tp8" in p.suggestion, p.suggestion
    with pytest.raises(planner.DoesNotFit, match="does not fit.*4 nodes × 8 H100 fit with pp4"):
        planner.resolve_parallel(spec)


def test_70b_muon_on_2x8_h100_plans_pp_across_the_nodes():
    """Muon (4 B momentum on the matrices): PP with one stage per node, 1f1b, 128 microbatches
    of one sequence — chosen over FSDP across the nodes, which would also fit."""
    spec = parse_spec(data(optimizer="muon"))
    p = planner.auto_plan(spec)
    assert p.fits and p.strategy.startswith("pp2+fsdp-zero3"), (p.strategy, p.memory_per_gpu_gb)
    assert p.parallel.pp == 2 and p.parallel.pp_schedule == "1f1b" and p.micro_batch_size == 1
    assert p.pipeline["microbatches"] == 512 // p.parallel.dp_shard
    assert p.pipeline["bubble"] == pytest.approx(1 / (p.pipeline["microbatches"] + 1))
    assert "one pipeline stage per node" in p.why
    across = [r for r in p.rungs if r.strategy.startswith("fsdp") and r.fits]
    assert across, "an FSDP layout across nodes fits too: PP must win on the link, not by default"
    out = planner.resolve_parallel(spec)
    assert out.trainer.parallel.pp == 2 and out.trainer.micro_batch_size == 1
    assert out.parallel_degrees.dp_shard * out.trainer.parallel.tp * 2 == 16


def test_no_pp_rungs_on_one_node_and_notes_for_tied_models():
    assert not [n for n, _, _ in candidate_rungs(parse_spec(data(nodes=1)), 8, 8) if n.startswith("pp")]
    tied = parse_spec(data("gpt2-124m", seq_len=1024))  # tied embedding and head
    notes = {n: note for n, _, note in candidate_rungs(tied, 16, 8) if n.startswith("pp")}
    assert notes and all("ties its embedding" in v for v in notes.values())


def test_pinned_pp_with_too_few_microbatches_is_refused_with_the_field():
    spec = parse_spec(data(optimizer="muon", batch_size=4, parallel={"pp": 2, "dp_shard": 4, "tp": 2}))
    assert "pp_microbatches (1) < 2" in microbatch_problem(spec, spec.parallel_degrees, 1)
    _, why = planner.fit_check(spec)
    assert why is not None and "trainer.parallel.pp_microbatches (1) < 2" in why


def test_cp_chosen_when_activations_dominate():
    """A 8B-shaped model at 256k tokens on one 8 × H100 node: TP 8 does not fit at any
    checkpointing, CP 8 does with full checkpointing (while the job check refuses cp, its rungs
    carry that reason instead)."""
    M = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336, mlp="swiglu",
             norm="rmsnorm", pos="rope", max_seq_len=262144, tie_embeddings=False)
    spec = parse_spec(data(M, nodes=1, batch_size=8, seq_len=262144))
    refusal = cp_supported()
    cps = [(n, par, note) for n, par, note in candidate_rungs(spec, 8, 8) if "+cp" in n]
    assert cps
    if refusal:
        assert all(note == refusal for _, _, note in cps)
        return
    tp8 = next(par for n, par, note in candidate_rungs(spec, 8, 8) if n == "fsdp-zero3+tp8")
    assert evaluate_rung(spec, tp8, "tp8", "gpu", 1, "full").memory_per_gpu_gb > 80
    p = planner.auto_plan(spec)
    assert p.fits and "+cp" in p.strategy and p.activation_checkpointing == "full", p.strategy


# ---- the dry run -------------------------------------------------------------------------------

def test_dry_run_prices_and_shows_the_bubble(tmp_path, capsys):
    import yaml

    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data(optimizer="muon")))
    main(["up", str(f), "--dry-run", "--json"])
    rep = json.loads(capsys.readouterr().out)
    b = rep["breakdown"]  # the offer shown (lambda needs credentials here: "would choose")
    pipe = b["pipeline"]
    assert pipe["schedule"] == "1f1b" and pipe["pp"] == 2
    # The FLOPs' time (with auto's full checkpointing: 8/6), divided by the busy share 1 − bubble.
    assert rep["plan"]["activation_checkpointing"] == "full"
    flops = 6 * PRESETS["llama3-70b"].active_params() * 512 * 8192 * RECOMPUTE_FACTOR["full"]
    assert b["flops_step_seconds"] * (1 - pipe["bubble"]) == pytest.approx(
        flops / (16 * b["peak_flops_per_gpu"] * b["mfu"]))
    assert b["compute_hours"] == pytest.approx(b["steps"] * b["step_seconds"] / 3600)
    main(["up", str(f), "--dry-run"])
    out = capsys.readouterr().out
    assert f"pipeline bubble: {pipe['bubble']:.1%} (1f1b, {pipe['microbatches']} microbatches, pp 2" in out


def test_pinned_pp_dry_run_on_cpu_names_the_layout_and_its_bubble(tmp_path, capsys):
    """Pinned interleaved-1f1b at pp 2 on two CPU ranks: 4 microbatches (batch 8 / micro-batch 2),
    v 2: bubble 1/9; a model this small is bound by the per-step floor, and the line says so."""
    import yaml

    job = {"name": "tinypp", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 2},
           "trainer": {"model": {"vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 64,
                                 "tie_embeddings": False},
                       "parallel": {"pp": 2, "dp_shard": 1, "pp_schedule": "interleaved-1f1b"},
                       "steps": 10, "batch_size": 8, "micro_batch_size": 2, "seq_len": 32},
           "checkpoint": {"uri": str(tmp_path / "run")}}
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(job))
    main(["up", str(f), "--dry-run"])
    out = capsys.readouterr().out
    assert "pipeline bubble: 11.1% (interleaved-1f1b, 4 microbatches, pp 2; under the per-step floor)" in out
    assert "your trainer.parallel (pp2)" in out


def test_written_pp_without_micro_batch_runs_the_trainers_default():
    """pp written without micro_batch_size: the trainer's micro-batch is batch / dp (one
    accumulation step), so m = 1 unless pp_microbatches splits it — the dry run says so, and
    pp_microbatches 8 makes the same job plannable (8 microbatches of 8 / 8 = 1 sequence)."""
    base = {"pp": 2, "dp_shard": 8}
    spec = parse_spec(data(optimizer="muon", batch_size=64, activation_checkpointing="full", parallel=base))
    _, why = planner.fit_check(spec)
    assert why is not None and "pp_microbatches (1) < 2" in why
    ok = parse_spec(data(optimizer="muon", batch_size=64, activation_checkpointing="full",
                         parallel={**base, "pp_microbatches": 8}))
    rung = planner.evaluate_spec_parallel(ok)
    assert not rung.note and rung.strategy == "pp2+fsdp-zero3"
    from orchestrator.plan.hours import pipeline_for
    assert pipeline_for(ok, "H100", 8, 2)["microbatches"] == 8
    assert pipeline_for(ok, "H100", 8, 2)["microbatch_rows"] == 1

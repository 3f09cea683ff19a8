"""The memory planner's front door: will the job fit, and with what.

``trainer.parallel: auto`` → :func:`auto_plan` (the cheapest plan that fits: the lowest rung of
the ladder, then a smaller micro-batch, then activation checkpointing); :func:`fit_check` (GPU
memory, and the host memory dtrun requests on Modal) for the dry run and the traps;
:func:`resolve_parallel`, which the controller applies before writing the job to the run URI, so
the trainer runs exactly the plan the dry run printed. Pure Python (no torch).

The parts: ``plan/memory.py`` (the bytes one rank holds: parameters, gradients, optimizer state,
gathered parameters, activations, host memory) and ``plan/ladder.py`` (the rungs, their bytes,
:func:`plan`: the lowest rung that fits); ``plan/suggest.py`` words what would fit when nothing
does, checked with auto's own search here (:func:`_auto_fits_on`).
"""

from __future__ import annotations

from orchestrator.contract.errors import EXIT_NO_FIT, DtrunError, SpecError
from orchestrator.contract.gpus import GPUS
from orchestrator.plan.ladder import (
    MemoryPlan, Rung, candidate_rungs, dp_degree, evaluate_rung, evaluate_spec_parallel, layout_valid,
    multi_node_why, plan, plan_target, planned_micro_batch,
)
from orchestrator.plan.memory import host_bytes_per_node
from orchestrator.plan.pipeline import pipeline_info
from orchestrator.plan.spec import JobSpec
from orchestrator.plan.suggest import suggest_fit

# Importable from here for callers outside plan/ that still name this module (benchmarks/
# bench_planner.py: Parallel; tests/trainer/test_planner_exact.py: state_bytes_per_rank;
# tests/trainer/test_trainer_units.py: LOSS_CHUNK_BYTES). New code imports them from their homes.
from orchestrator.plan.memory import LOSS_CHUNK_BYTES, state_bytes_per_rank  # noqa: F401
from orchestrator.plan.spec import Parallel  # noqa: F401


class DoesNotFit(DtrunError):
    """No plan fits the GPU's memory (``auto`` found none, or the pinned settings do not fit):
    exit 4, nothing rented."""

    exit_code = EXIT_NO_FIT


AC_ORDER = ("none", "selective", "full")
"""Activation checkpointing from cheapest (no recompute) to dearest (every block recomputed)."""


def pinned(spec: JobSpec) -> dict[str, bool]:
    """What the user wrote (auto keeps it): ``micro_batch_size`` (set, not None) and
    ``activation_checkpointing`` (written in the YAML, whatever its value)."""
    t = spec.trainer
    return {"micro_batch_size": t.micro_batch_size is not None,
            "activation_checkpointing": "activation_checkpointing" in t.model_fields_set}


def _mb_below(per_dp: int, target: int) -> int:
    """The largest micro-batch ≤ target that divides the per-replica batch (≥ 1)."""
    return max(m for m in range(1, max(1, target) + 1) if per_dp % m == 0)


def auto_plan(spec: JobSpec, gpu: str | None = None, gpus_per_node: int | None = None,
              nodes: int | None = None, *, suggest: bool = True) -> MemoryPlan:
    """``trainer.parallel: auto`` in full: the cheapest plan that fits by this module's bytes.

    In order of cost, the first that fits wins:

    1. the lowest parallel rung at the default micro-batch, no activation checkpointing;
    2. a smaller micro-batch (halved each round; gradient accumulation keeps ``batch_size``),
       again lowest rung first;
    3. the same with selective, then with full activation checkpointing.

    On several nodes the layouts whose sharding stays within a node (DDP, HSDP) get that whole
    search first: one that fits at a smaller micro-batch or with checkpointing beats a layout
    whose every all-gather crosses nodes (FSDP over all GPUs, TP × FSDP) at the default — the
    advice the ``fsdp-across-nodes`` trap gives a pinned layout. Only when no node-local layout
    fits at all does the search go on over every rung.

    A ``micro_batch_size`` or ``activation_checkpointing`` the user wrote is kept (only what is
    left to auto is searched). ``.fits`` False: nothing fits; ``.suggestion`` says what would."""
    g, gpn, nn, n, device, limit = plan_target(spec, gpu, gpus_per_node, nodes)
    pin = pinned(spec)
    t = spec.trainer
    acs = [t.activation_checkpointing] if pin["activation_checkpointing"] else list(AC_ORDER)
    cands = candidate_rungs(spec, n, gpn)
    valid = [(name, par) for name, par, note in cands if not note]
    if not valid:
        raise SpecError(
            f"trainer.parallel: no parallel layout is valid for {n} GPUs: "
            + "; ".join(f"{name}: {note}" for name, _, note in cands))

    def rungs_at(ac: str, k: int, names: set[str]) -> list[tuple[Rung, int]]:
        out = []
        for name, par in valid:
            if name not in names:
                continue
            default = planned_micro_batch(spec, par)
            if pin["micro_batch_size"]:
                if k:
                    continue
                mb = default
            else:
                if default >> k < 1:
                    continue
                mb = _mb_below(max(1, t.batch_size // dp_degree(par)), default >> k)
            rung = evaluate_rung(spec, par, name, device, micro_batch=mb, checkpointing=ac)
            if rung.note:  # a pipeline with too few microbatches at this micro-batch
                continue
            rung.fits = limit is None or rung.memory_bytes <= limit
            out.append((rung, mb))
        return out

    def search(names: set[str]) -> tuple[tuple[Rung, int, str] | None, tuple[Rung, int, str] | None]:
        """(the first that fits in cost order, the smallest seen) among the rungs named."""
        best: tuple[Rung, int, str] | None = None
        for ac in acs:
            k = 0
            while True:
                evald = rungs_at(ac, k, names)
                if not evald:
                    break
                for rung, mb in evald:
                    if best is None or rung.memory_bytes < best[0].memory_bytes:
                        best = (rung, mb, ac)
                hit = next(((rung, mb) for rung, mb in evald if rung.fits), None)
                if hit is not None:
                    return (hit[0], hit[1], ac), best
                k += 1
        return None, best

    chosen: tuple[Rung, int, str] | None = None
    best: tuple[Rung, int, str] | None = None
    hsdp_best: tuple[Rung, int, str] | None = None
    local = {name for name, _ in valid if name == "ddp" or name.startswith("hsdp")}
    if nn > 1 and any(name.startswith("hsdp") for name in local):
        chosen, best = search(local)
        if chosen is None:
            hsdp_best = best
    piped = {name for name, _ in valid if name.startswith("pp")}
    if chosen is None and piped:
        # One pipeline stage per node: only activations cross nodes (point to point) — before any
        # layout whose every all-gather crosses them.
        chosen, _ = search(piped)
    if chosen is None:
        chosen, best = search({name for name, _ in valid})
    fits = chosen is not None
    pick = chosen or best
    assert pick is not None
    rung, mb, ac = pick
    # The ladder shown is the one at the chosen micro-batch and checkpointing.
    shown: list[Rung] = []
    for name, par, note in cands:
        if note:
            shown.append(Rung(name, par, note=note))
            continue
        default = planned_micro_batch(spec, par)
        m = default if pin["micro_batch_size"] else _mb_below(
            max(1, t.batch_size // dp_degree(par)), min(default, mb))
        x = evaluate_rung(spec, par, name, device, micro_batch=m, checkpointing=ac)
        x.fits = not x.note and (limit is None or x.memory_bytes <= limit)
        shown.append(x)
    default_mb = planned_micro_batch(spec, rung.parallel)
    changed = []
    if not pin["micro_batch_size"] and mb != default_mb:
        changed.append(f"micro_batch_size {default_mb} → {mb} (gradient accumulation keeps batch_size "
                       f"{t.batch_size})")
    if not pin["activation_checkpointing"] and ac != t.activation_checkpointing:
        changed.append(f"activation_checkpointing {t.activation_checkpointing} → {ac}")
    notes = ["CPU ranks: host memory is not checked; the lowest rung is chosen"] if device == "cpu" else []
    p = MemoryPlan(
        strategy=rung.strategy, memory_per_gpu_gb=rung.memory_per_gpu_gb, fits=fits,
        parallel=rung.parallel, breakdown=dict(rung.breakdown), rungs=shown, gpu=g,
        gpu_memory_gb=None if limit is None else GPUS[g].memory_gb, gpus_per_node=gpn, nodes=nn,
        micro_batch_size=mb, notes=notes, activation_checkpointing=ac,
        auto={"pinned": [k for k, v in pin.items() if v], "changed": changed},
        parallel_info={"pipeline": pipeline_info(spec, rung.parallel, mb)},
        why=multi_node_why(rung.strategy, shown, nn, gpn, hsdp_searched=None if hsdp_best is None else (
            f"{hsdp_best[0].strategy} at {hsdp_best[0].memory_per_gpu_gb:.1f} GB/GPU with micro_batch_size "
            f"{hsdp_best[1]}, activation_checkpointing {hsdp_best[2]}")),
    )
    if not fits and suggest:
        p.suggestion = suggest_fit(spec, g, gpn, nn, fits_on=_auto_fits_on, pinned=pin,
                                   layout_valid=lambda m: layout_valid(spec, gpn, m))
    return p


def _could_fit(spec: JobSpec, gpu: str, gpn: int, nodes: int) -> bool:
    """Whether auto could fit at all there: some valid rung at the least memory auto may choose
    (micro-batch 1 and full checkpointing, unless pinned). Memory only falls with a smaller
    micro-batch and more checkpointing, so when this fails the whole search would; it costs one
    evaluation per rung instead of the search's dozens (suggestions try many targets)."""
    _, _, _, n, device, limit = plan_target(spec, gpu, gpn, nodes)
    if limit is None:
        return True
    pin = pinned(spec)
    t = spec.trainer
    ac = t.activation_checkpointing if pin["activation_checkpointing"] else "full"
    for name, par, note in candidate_rungs(spec, n, gpn):
        if note:
            continue
        mb = planned_micro_batch(spec, par) if pin["micro_batch_size"] else 1
        r = evaluate_rung(spec, par, name, device, micro_batch=mb, checkpointing=ac)
        if not r.note and r.memory_bytes <= limit:
            return True
    return False


def _auto_fits_on(spec: JobSpec, gpu: str, gpn: int, nodes: int) -> MemoryPlan | None:
    """Auto's plan there when it fits (for a suggestion: auto searches wherever it runs), else None."""
    try:
        if not _could_fit(spec, gpu, gpn, nodes):
            return None
        p = auto_plan(spec, gpu=gpu, gpus_per_node=gpn, nodes=nodes, suggest=False)
    except DtrunError:
        return None
    return p if p.fits else None


def host_memory_problem(spec: JobSpec, p: MemoryPlan) -> str | None:
    """Where dtrun sizes the node's host memory (Modal: ``resources.memory_gb_per_gpu`` × GPUs is
    the container's limit), why the plan's host memory does not fit it (else None). Instance
    providers give the instance's memory, which the offers do not carry: the trainer checks
    that at start (``trainer/checkpoint.py``, sync saves when the staging copy does not fit)."""
    if p.gpu == "cpu" or "modal" not in spec.resources.providers:
        return None
    need = host_bytes_per_node(spec, p.parallel, p.gpus_per_node)
    have = spec.resources.memory_gb_per_gpu * p.gpus_per_node * 2**30
    if need["total"] <= have:
        return None
    per_gpu = need["total"] / p.gpus_per_node / 2**30
    return (f"resources.memory_gb_per_gpu ({spec.resources.memory_gb_per_gpu:g} GiB) is too little host memory "
            f"on Modal: each GPU's rank needs about {per_gpu:.0f} GiB (async checkpoint staging "
            f"{need['staging'] / p.gpus_per_node / 2**30:.1f} GiB, loader and process "
            f"{(need['loader'] + need['fixed']) / p.gpus_per_node / 2**30:.1f} GiB); raise it to "
            f"{int(per_gpu) + 1}, or set checkpoint.async_mode: sync")


def fit_check(spec: JobSpec, gpu: str | None = None) -> tuple[MemoryPlan, str | None]:
    """The memory plan the job would run with on ``gpu`` and, when it does not fit — GPU memory,
    or the host memory dtrun requests on Modal — why (else None)."""
    p, why = _gpu_fit_check(spec, gpu)
    return p, why or host_memory_problem(spec, p)


def _gpu_fit_check(spec: JobSpec, gpu: str | None = None) -> tuple[MemoryPlan, str | None]:
    """The memory plan the job would run with on ``gpu`` (auto: :func:`auto_plan`; explicit
    degrees: the ladder for reference) and, when it does not fit, why (else None).
    CPU ranks always fit (host memory is not checked)."""
    if spec.trainer.parallel == "auto":
        p = auto_plan(spec, gpu=gpu)
        if p.fits:
            return p, None
        pin = p.auto["pinned"] if p.auto else []
        kept = (f" (auto kept what you pinned: {', '.join('trainer.' + k for k in pin)})" if pin else "")
        return p, (f"no plan fits {p.nodes}×{p.gpus_per_node} {p.gpu} ({p.gpu_memory_gb:g} GB){kept}: "
                   f"the smallest is {p.strategy} at {p.memory_per_gpu_gb:.1f} GB/GPU "
                   f"(micro_batch_size {p.micro_batch_size}, activation_checkpointing "
                   f"{p.activation_checkpointing}); {p.suggestion}")
    p = plan(spec, gpu=gpu)
    g = p.gpu
    if g == "cpu":
        return p, None
    # The nodes run the degrees you wrote on whichever GPU serves the job — the spec's own, one of
    # its variants (``gpu: H100`` rented as H100-SXM or H100-PCIe), or another GPU asked about:
    # so the check is always of those degrees, against that GPU's memory.
    mine = evaluate_spec_parallel(spec, gpu=g)
    assert mine is not None
    if mine.fits:
        return p, None
    if mine.note:  # a pipeline that cannot run as written (too few microbatches)
        return p, mine.note
    other = f"; {p.strategy} fits at {p.memory_per_gpu_gb:.1f} GB/GPU (or use parallel: auto)" if p.fits \
        else f"; {p.suggestion}"
    return p, (f"trainer.parallel ({mine.strategy}) needs {mine.memory_per_gpu_gb:.1f} GB/GPU on {g} "
               f"({GPUS[g].memory_gb:g} GB){other}")


def resolve_parallel(spec: JobSpec, force: bool = False) -> JobSpec:
    """A copy of the spec with explicit degrees: ``trainer.parallel: auto`` becomes
    :func:`auto_plan`'s pick — degrees, and the micro-batch and activation checkpointing it chose
    where the user left them open (validated through the spec's own checks); explicit degrees are
    returned unchanged. Raises :class:`DoesNotFit` (exit 4) when nothing fits (the message says
    what would) unless ``force`` (``dtrun up --force``: the smallest plan found, which may OOM).
    This is what the controller writes to the run URI's job.yaml: the trainer runs exactly the
    plan the dry run printed."""
    if spec.trainer.parallel != "auto":
        return spec.model_copy(deep=True)
    p, why = fit_check(spec)
    if why is not None and not force:
        raise DoesNotFit(f"trainer.parallel: auto: {spec.trainer.model_spec.num_params() / 1e9:.2f}B-parameter "
                         f"model does not fit: {why}")
    data = spec.model_dump(mode="json", exclude_none=True)
    data["trainer"]["parallel"] = p.parallel.model_dump()
    if spec.trainer.micro_batch_size is None and p.micro_batch_size != spec.trainer.batch_size // dp_degree(p.parallel):
        data["trainer"]["micro_batch_size"] = p.micro_batch_size  # TP or auto's smaller micro-batch
    data["trainer"]["activation_checkpointing"] = p.activation_checkpointing
    return JobSpec.model_validate(data)

"""Restore preflight: a small DCP checkpoint round trip against the real run URI, before the
expensive part.

Run under torchrun (every rank takes part; gloo on CPU)::

    torchrun --standalone --nproc-per-node 2 -m trainer.preflight --run-uri s3://bucket/run --result out.json

1. rank 0 probes the storage (write, read back, delete a small object: ``orchestrator.contract.
   storeprobe``, the words ``dtrun up``'s own probe uses) — the common failures (no such bucket,
   bad credentials, unreachable endpoint) stop here with one clear sentence;
2. every rank saves a small model and its AdamW state, FSDP2-sharded over the world (the trainer's
   own fsspec writer, the same path real checkpoints take) to ``<run-uri>/preflight/<id>/``;
3. every rank restores it twice and compares bit for bit: into the same sharded layout, and
   *resharded* into whole (unsharded) tensors — what a resume on another node count does;
4. rank 0 deletes the preflight folder and writes the verdict (JSON) to ``--result``:
   ``{"ok": bool, "problem": null|"bucket"|"credentials"|"endpoint"|"storage"|"restore"|"resharding",
   "message": str, "seconds": float, "world_size": int, "uri": str}``.

Exit 0 when the round trip is exact, 2 when it is not (the message names the problem).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from typing import Any

from orchestrator.contract import runuri
from orchestrator.contract.storeprobe import PREFLIGHT_DIR, classify, probe


def _roundtrip(uri: str, rank: int, world: int) -> tuple[str, str] | None:
    """Save a sharded model + optimizer state to ``uri`` and restore it twice; compare exactly."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import DTensor

    from orchestrator.plan.presets import PRESETS
    from trainer.checkpoint import _reader, _writer
    from trainer.model import build_model, loss_fn
    from trainer.parallel import ParallelDims, build_meshes, parallelize

    ms = PRESETS["tiny"]
    dims = ParallelDims(world, 1, 1, world)
    meshes = build_meshes(dims, "cpu")
    model = build_model(ms, device="meta")
    parallelize(model, dims, meshes, device=torch.device("cpu"))
    model.to_empty(device="cpu")
    model.init_weights(1234)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, ms.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank))
    loss_fn(model(x), x)[0].backward()
    opt.step()  # non-trivial optimizer state
    # Named, non-aliased tensors: parameters and the AdamW moments (DTensor shards).
    sd: dict[str, Any] = {}
    for name, p in model.named_parameters():
        sd[f"model.{name}"] = p.detach()
        st = opt.state[p]
        sd[f"optim.{name}.exp_avg"] = st["exp_avg"]
        sd[f"optim.{name}.exp_avg_sq"] = st["exp_avg_sq"]
    try:
        dcp.save(sd, storage_writer=_writer(uri))
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        return classify(_root_cause(e), uri)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    # Same layout.
    same = {k: (DTensor.from_local(torch.zeros_like(local(v)), v.device_mesh, v.placements,
                                   shape=v.shape, stride=v.stride(), run_check=False)
                if isinstance(v, DTensor) else torch.zeros_like(v)) for k, v in sd.items()}
    # Resharded: whole tensors on every rank (a resume at world 1 reads exactly this).
    whole = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    try:
        dcp.load(same, storage_reader=_reader(uri))
        dcp.load(whole, storage_reader=_reader(uri))
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        cause = _root_cause(e)
        problem, msg = classify(cause, uri)
        if problem == "storage":
            return "resharding", f"the checkpoint saved to {uri} could not be restored: {msg}"
        return problem, msg
    bad = [k for k in sd if not torch.equal(local(same[k]), local(sd[k]))]
    if bad:
        return "restore", (f"restoring the checkpoint into the same layout changed {len(bad)} tensors "
                              f"(first: {bad[0]}): the storage returned different bytes")
    for k, v in sd.items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if not torch.equal(whole[k], full):
            return "resharding", (f"restoring the world-{world} checkpoint resharded into whole tensors gave "
                                  f"different values for {k}: resuming on another node count would be wrong")
    if dist.is_initialized():
        dist.barrier()
    return None


def _root_cause(e: BaseException) -> BaseException:
    """DCP wraps per-rank failures in CheckpointException(failures={rank: exc or traceback})."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for v in failures.values():
            inner = v[0] if isinstance(v, tuple) and v and isinstance(v[0], BaseException) else v
            if isinstance(inner, BaseException):
                return _root_cause(inner)
    cur: BaseException = e
    for _ in range(8):
        nxt = cur.__cause__ or cur.__context__
        if nxt is None:
            break
        cur = nxt
    return cur


def run(uri: str) -> dict[str, Any]:
    """The preflight on this process (a torchrun rank, or alone): the verdict dict (same on every
    rank)."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    t0 = time.time()
    verdict: tuple[str, str] | None = None
    folder = runuri.join(uri, PREFLIGHT_DIR, uuid.uuid4().hex[:12])
    try:
        if rank == 0:
            verdict = probe(uri)
        if dist.is_initialized():
            box: list[Any] = [verdict, folder]
            dist.broadcast_object_list(box, src=0)
            verdict, folder = box
        if verdict is None:
            verdict = _roundtrip(folder, rank, world)
            if dist.is_initialized():  # one verdict: the first rank that saw a problem
                every: list[Any] = [None] * world
                dist.all_gather_object(every, verdict)
                verdict = next((v for v in every if v is not None), None)
        if rank == 0 and (verdict is None or verdict[0] in ("restore", "resharding")):
            try:
                runuri.remove(folder, recursive=True)
            except Exception:  # noqa: BLE001 - leftover preflight files are harmless; the verdict stands
                pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = {"ok": verdict is None, "problem": None if verdict is None else verdict[0],
           "message": "checkpoint round trip restored exactly (same layout and resharded)"
           if verdict is None else verdict[1],
           "seconds": round(time.time() - t0, 3), "world_size": world, "uri": folder}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.preflight", allow_abbrev=False)
    p.add_argument("--run-uri", dest="run_uri", required=True)
    p.add_argument("--result", dest="result", default=None, help="write the verdict (JSON) here")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    uri = a.run_uri if "://" in a.run_uri else "file://" + os.path.abspath(a.run_uri)
    verdict = run(uri)
    if int(os.environ.get("RANK", "0")) == 0:
        line = json.dumps(verdict)
        print("PREFLIGHT " + line, flush=True)
        if a.result:
            with open(a.result, "w") as f:
                f.write(line)
    return 0 if verdict["ok"] else 2


if __name__ == "__main__":
    sys.exit(main())

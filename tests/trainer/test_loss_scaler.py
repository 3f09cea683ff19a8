"""fp16 dynamic loss scaling (trainer.parallel.DynamicLossScaler): an overflow skips the step on
every rank and halves the scale; the scale grows back; under FSDP2 at world 2 a run with
``precision: fp16`` (CPU computes in fp32, so power-of-two scaling is exact) trains exactly like
fp32 and keeps its scale in the checkpoint."""

from __future__ import annotations

import pytest
import torch

from orchestrator.contract import runuri
from orchestrator.plan.presets import ModelSpec
from trainer.model import build_model, loss_fn
from trainer.parallel import DynamicLossScaler, clip_grad_norm_

TINY = {"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16}


def _step(model, scaler, opt, x, y):
    loss, _ = loss_fn(model(x), y)
    scaler.scale_loss(loss).backward()
    params = list(model.parameters())
    scaler.unscale_(params)
    norm = clip_grad_norm_(params, 1.0)
    took = scaler.update(norm)
    if took:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return took


def test_overflow_skips_the_step_and_halves_the_scale_then_grows():
    torch.manual_seed(0)
    model = build_model(ModelSpec.model_validate(TINY), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    scaler = DynamicLossScaler(True, init_scale=2.0 ** 140, growth_interval=3)  # fp32 overflows
    before = [p.detach().clone() for p in model.parameters()]
    assert not _step(model, scaler, opt, x, y)
    assert scaler.scale == 2.0 ** 139 and scaler.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing applied
    while not _step(model, scaler, opt, x, y):
        pass
    assert scaler.scale < 2.0 ** 128 and scaler.skipped > 1
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    s = scaler.scale
    _step(model, scaler, opt, x, y), _step(model, scaler, opt, x, y)
    assert scaler.scale == 2 * s  # growth after 3 good steps
    # Unscaled gradients equal unscaled-loss gradients (power-of-two scale: exact).
    ref = build_model(ModelSpec.model_validate(TINY), seed=1)
    other = build_model(ModelSpec.model_validate(TINY), seed=1)
    for m, sc in ((ref, DynamicLossScaler(False)), (other, DynamicLossScaler(True, init_scale=2.0 ** 20))):
        loss, _ = loss_fn(m(x), y)
        sc.scale_loss(loss).backward()
        sc.unscale_(list(m.parameters()))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), other.parameters()))
    assert DynamicLossScaler(False).update(torch.tensor(float("inf")))  # disabled: never skips


@pytest.mark.slow
def test_fp16_under_fsdp2_world2_trains_like_fp32_and_checkpoints_the_scale(tmp_path):
    from conftest import REPO, Trainer, losses, run_world

    # Both runs in one world-2 torchrun, in turn (tests/trainer/trainer_world.py): each its own
    # process group, run URI, output and exit code.
    cases = []
    for prec in ("fp32", "fp16"):
        uri = f"file://{tmp_path}/{prec}"
        job = Trainer(tmp_path).job(prec, nproc=2, run_uri=uri, steps=4, every=2, precision=prec,
                                    batch_size=8, micro_batch_size=2)
        cases.append({"name": prec, "job": str(job), "run_uri": uri})
    world = run_world(tmp_path / "world", 2, REPO / "tests/trainer/trainer_world.py", cases)
    runs = {}
    for prec in ("fp32", "fp16"):
        rc, out = world.case(prec)
        assert rc == 0, out[-3000:]
        runs[prec] = world.cases[prec]["run_uri"]
    assert losses(runs["fp16"]) == losses(runs["fp32"])
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(runuri.local_path(runuri.checkpoint_uri(runs["fp16"], 4))).read_metadata()
    assert any(k.startswith("loss_scaler.") for k in md.state_dict_metadata)

"""Validation (trainer/evaluate.py) through the real trainer under torchrun/gloo (world 2)."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.contract import runuri
from tests.trainer.conftest import DENSE

pytestmark = pytest.mark.slow


def test_out_of_vocab_validation_token_on_one_rank_is_a_config_error_before_step_1(trainer, tmp_path):
    # Only data-parallel rank 1's validation windows (2 and 3: tokens 64…128) hold an id ≥ vocab_size.
    # Before: rank 1 raised at the first evaluation (step 2) while rank 0 waited in the all-reduce,
    # so the job exited 2 with a gloo "Connection closed by peer" traceback and no error line.
    val = (np.arange(4096) % 200).astype(np.uint16)
    val[100] = 300
    (tmp_path / "v").mkdir()
    np.save(tmp_path / "v" / "held_out_val.npy", val)
    uri = f"file://{tmp_path}/run"
    job = trainer.job("badval", nproc=2, run_uri=uri, model=DENSE, steps=4, every=4,
                      val_data=str(tmp_path / "v"), eval_every=2, eval_tokens=256)
    rc, out = trainer.run(job, 2, timeout=200)
    assert rc == 2, out[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("dtrun trainer: error:")]
    assert len(lines) == 1 and "trainer.val_data" in lines[0] and "vocab_size 256" in lines[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert runuri.checkpoint_steps(uri) == []  # refused before training, nothing to resume

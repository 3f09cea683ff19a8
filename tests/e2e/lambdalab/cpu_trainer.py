"""The lab's instances have no GPUs (see node.py): this runs dtrun's real trainer
(``trainer.train.main``) with the job's ``resources.gpu`` read as ``cpu`` (and, as the spec requires for ``cpu``,
``providers`` as ``[local]``) — the only change. The
trainer itself (correctly) refuses a GPU spec on a CPU build of torch. Every lab node exports
``DTRUN_TRAINER_MODULE=tests.e2e.lambdalab.cpu_trainer`` (the bootstrap's test-only knob), so
the model, FSDP over gloo, checkpoints and resume are the product's own."""

from __future__ import annotations

import sys
import tempfile

import yaml

from trainer.train import main


def run(argv: list[str]) -> int:
    argv = list(argv)
    i = argv.index("--job") + 1
    with open(argv[i]) as f:
        spec = yaml.safe_load(f)
    spec["resources"]["gpu"] = "cpu"
    spec["resources"]["providers"] = ["local"]  # the spec's rule: gpu cpu runs only on local/fake
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(spec, f)
    argv[i] = f.name
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

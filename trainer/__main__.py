"""``torchrun --nproc-per-node N -m trainer --job JOB.yaml --run-uri URI`` (see trainer/train.py)."""

import sys

from trainer.train import main

if __name__ == "__main__":
    sys.exit(main())

"""The bundled trainer with timestamps for bench_recovery.py (benchmark instrumentation only).

Run as ``torchrun ... -m _bench_timed_trainer --job ... --run-uri ...`` (through the node
bootstrap's ``DTRUN_TRAINER_MODULE``). It prints ``BENCH <event> <unix time>`` lines for: this
Python process started, the checkpoint load began, the load ended; then runs ``trainer``'s
``main()`` unchanged.
"""

import os
import sys
import time

_T0 = time.time()


def _mark(what: str, t: float | None = None) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"BENCH {what} {time.time() if t is None else t:.6f}", flush=True)


def main() -> int:
    _mark("python_start", _T0)
    from trainer import checkpoint

    orig = checkpoint.CheckpointManager.load_latest

    def timed(self, *a, **kw):
        _mark("load_start")
        try:
            return orig(self, *a, **kw)
        finally:
            _mark("load_end")

    checkpoint.CheckpointManager.load_latest = timed
    from trainer.train import main as trainer_main

    return trainer_main()


if __name__ == "__main__":
    sys.exit(main())

"""torchrun, with the trainer's exit code passed through.

Plain ``torchrun`` turns any failed worker into exit 1, which would hide the trainer's contract
(75 = preempted, resume me; 2 = bad config, do not retry). This runs torchrun's own ``main``
in-process and, when a worker fails, exits with the most telling worker exit code:
2 if any rank said "bad config", else 75 if any rank said "preempted", else the first failure's
code. A signal to torchrun itself exits 128 + signal (the bootstrap maps that to 75 when it was
the one forwarding a spot notice).

It also gives every worker ``PR_SET_PDEATHSIG(SIGKILL)``: torchrun starts each worker in its own
session, so without it a SIGKILLed launcher would leave the workers training (and billing) on.

Usage (what ``infra/node_bootstrap.py`` runs): ``python infra/torchrun_launch.py <torchrun args>``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1

EXIT_BAD_CONFIG = 2
EXIT_PREEMPTED = 75


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    libc = _libc()
    if libc is None or not sys.platform.startswith("linux"):
        return False
    return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def pick_exit_code(codes: list[int]) -> int:
    """One exit code for the node from every failed rank's code (negative = killed by signal)."""
    if not codes:
        return 1
    if EXIT_BAD_CONFIG in codes:
        return EXIT_BAD_CONFIG
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    first = codes[0]
    if first < 0:
        return 128 + (-first)
    return first if 0 < first < 256 else 1


def _patch_worker_popen() -> bool:
    """Make torchrun's worker processes die with it (PR_SET_PDEATHSIG in the child)."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler as sh
    except ImportError:
        return False
    orig = getattr(sh, "Popen", None)
    if orig is None:
        return False
    libc = _libc()
    if libc is None or not sys.platform.startswith("linux"):
        return False
    parent = os.getpid()

    def _preexec() -> None:  # runs in the forked child, before exec
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died between fork and prctl
            os._exit(128 + int(signal.SIGKILL))

    def popen(*args, **kwargs):
        kwargs.setdefault("preexec_fn", _preexec)
        return orig(*args, **kwargs)

    sh.Popen = popen
    return True


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    _patch_worker_popen()
    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        codes = [f.exitcode for _, f in sorted(e.failures.items())]
        return pick_exit_code(codes)
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

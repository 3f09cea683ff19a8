"""The node's process tree: the trainer's launcher (torchrun) in its own process group, the node's
signals forwarded to it, and nothing it started left alive.

* torchrun runs in its own process group with ``PR_SET_PDEATHSIG(SIGKILL)``, so a SIGKILLed
  bootstrap takes it along (:func:`child_preexec`).
* torchrun starts each worker in its own session, so a group signal never reaches them:
  :func:`signal_tree` signals the group and then every descendant found in ``/proc``.
* The bootstrap is a child subreaper (:func:`become_subreaper`): what the trainer left behind is
  re-parented to it and :func:`reap_leftovers` terminates it before the node exits.

Linux ``prctl`` through ctypes (no-ops elsewhere); standard library only: never torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from infra.node_log import log

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def become_subreaper() -> bool:
    """Orphaned descendants (torchrun's workers) are re-parented to us, so we can find them."""
    return _LIBC is not None and _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def child_preexec(parent: int):
    """For ``Popen(preexec_fn=…)``: the child gets its own process group and dies with ``parent``
    (``PR_SET_PDEATHSIG``; it exits at once if ``parent`` is already gone)."""
    def preexec() -> None:
        os.setpgid(0, 0)  # own process group: we signal torchrun without signalling ourselves
        if _LIBC is not None:
            _LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os._exit(128 + int(signal.SIGKILL))
    return preexec


def _ppid_map() -> dict[int, int]:
    out: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses
        rest = stat.rsplit(")", 1)[-1].split()
        if len(rest) >= 2:
            out[int(name)] = int(rest[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; empty where there is no /proc)."""
    ppids = _ppid_map()
    children: dict[int, list[int]] = {}
    for p, pp in ppids.items():
        children.setdefault(pp, []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def signal_tree(pid: int, sig: int) -> None:
    """Signal ``pid``'s process group, then each descendant (torchrun's workers have sessions of
    their own, so a group signal does not reach them)."""
    targets = descendants(pid)
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in targets:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def reap_leftovers(grace: float = 5.0) -> list[int]:
    """After torchrun exits: SIGTERM, then SIGKILL, whatever it left behind (re-parented to us)."""
    me = os.getpid()
    left = descendants(me)
    if not left:
        return []
    log(f"cleaning up {len(left)} leftover process(es): {left}")
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        for p in descendants(me):
            try:
                os.kill(p, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end:
            _reap_nohang()
            if not descendants(me):
                return left
            time.sleep(0.05)
    _reap_nohang()
    return left


def _reap_nohang() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class ChildGroup:
    """One child (torchrun, or a ``command:`` job's launcher) in its own process group, dying with
    this process; SIGTERM/SIGINT to this process are forwarded to its group (a spot notice becomes
    the trainer's emergency checkpoint)."""

    def __init__(self) -> None:
        self.forwarded: list[int] = []
        self.proc: subprocess.Popen | None = None

    def forward_signals(self) -> None:
        signal.signal(signal.SIGTERM, self._forward)
        signal.signal(signal.SIGINT, self._forward)

    def _forward(self, signum: int, _frame) -> None:
        self.forwarded.append(signum)
        if self.proc is None:
            return  # not started yet: the bootstrap sees `forwarded` and does not start it
        log(f"got signal {signum}; forwarding to torchrun (pid {self.proc.pid})")
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def start(self, argv: list[str], env: dict[str, str], cwd: str | None = None) -> subprocess.Popen:
        """Start the child with its stdout and stderr piped (the node's report copies them)."""
        self.proc = subprocess.Popen(argv, env=env, preexec_fn=child_preexec(os.getpid()), cwd=cwd,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        return self.proc

    def resend(self) -> None:
        """Forward again the newest signal (one that landed between ``Popen`` and the caller's
        next line reached nobody)."""
        if self.forwarded and self.proc is not None:
            os.killpg(self.proc.pid, self.forwarded[-1])

"""The local provider: this machine, the embedded default (``make demo`` runs on it).

A node is a process group: ``providers/local/wrapper.py`` leads it (started with
``start_new_session=True``) and runs ``LaunchRequest.command`` — the node bootstrap — in the same
group, with ``LaunchRequest.env`` merged over ``os.environ`` and stdout+stderr appended to the
log file (``LaunchRequest.log_path``, default ``$DTRUN_HOME/logs/<instance>.log``). The wrapper
writes the command's exit status to ``<log>.exit`` so a process that did not start the node (a
restarted controller, ``dtrun status``) still learns how it ended.

Poll: running → RUNNING; exit 0 → SUCCEEDED; 75 (trainer preempted) or 76 (watchdog stop) or
killed by a signal → PREEMPTED; any other exit → FAILED; gone after our ``terminate`` →
TERMINATED.

Terminate: SIGTERM to the group, SIGKILL once ``grace_seconds`` (default 30) have passed since
the SIGTERM; confirmed only when no live (non-zombie) process of the group is left. Each call
waits up to ``confirm_wait_seconds`` for that and otherwise raises ``TerminateNotConfirmed``
(call again). Idempotent.

Every node is recorded in ``$DTRUN_HOME/local/instances.json`` (locked with ``fcntl``) with its
pid, process-group id and the kernel's start time of the leader, so another process can list and
terminate it. A pid counts as ours only if its start time matches and (where readable) its
environment carries ``DTRUN_LOCAL_ID=<instance id>`` — a recycled pid is never signalled.

Temp files: each node gets its own temp folder, ``$DTRUN_HOME/local/tmp/<instance id>/``, as
``TMPDIR`` (``TMP``, ``TEMP``), so what the bootstrap and the trainer make with ``tempfile`` (the
node's ``dtrun-<job>-*.yaml``, the user command's ``dtrun-<job>-…/`` home) lives there. The folder
is removed once the node's whole process group is gone — by ``terminate``, by a ``poll`` that
sees it ended, and by ``list_owned`` (so ``dtrun gc`` clears it) — also after a SIGKILL of the node,
which gives the node no chance to clean up itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from providers import errors as perr
from providers._jsonstore import dtrun_home, locked_json
from providers.base import (
    PREEMPT_EXIT_CODES,
    NAME_PREFIX,
    Capabilities,
    Capability,
    Handle,
    LaunchRequest,
    NodeState,
    Offer,
    OwnedInstance,
    Provider,
    Requirements,
)

MARKER_ENV = "DTRUN_LOCAL_ID"
WRAPPER = str(Path(__file__).with_name("wrapper.py"))
_PROC = Path("/proc")


# ---- /proc helpers (Linux; elsewhere we fall back to kill(pid, 0)) -----------------------------

def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, starttime) of a process from /proc, or None if it does not exist."""
    try:
        raw = (_PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    rest = raw.rsplit(")", 1)[1].split()
    return rest[0], int(rest[2]), int(rest[19])


def _starttime(pid: int) -> int | None:
    st = _stat(pid) if _PROC.exists() else None
    return st[2] if st else None


def _environ_marker(pid: int) -> str | None:
    try:
        raw = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(MARKER_ENV.encode() + b"="):
            return item.split(b"=", 1)[1].decode(errors="replace")
    return None


def _group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the group?"""
    if _PROC.exists():
        for d in _PROC.iterdir():
            if not d.name.isdigit():
                continue
            st = _stat(int(d.name))
            if st and st[1] == pgid and st[0] != "Z":
                return True
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class LocalProvider(Provider):
    """This machine. One free "cpu" offer; every rank is a CPU process under torchrun."""

    name = "local"

    def __init__(self, home: str | os.PathLike[str] | None = None, *, grace_seconds: float = 30.0,
                 confirm_wait_seconds: float = 5.0) -> None:
        self._home = Path(home) if home is not None else None
        self.grace_seconds = grace_seconds
        self.confirm_wait_seconds = confirm_wait_seconds
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._tlock = threading.RLock()

    # ---- registry file ---------------------------------------------------------------------------
    @property
    def home(self) -> Path:
        return self._home if self._home is not None else dtrun_home()

    @property
    def registry_path(self) -> Path:
        return self.home / "local" / "instances.json"

    @contextlib.contextmanager
    def _registry(self) -> Iterator[dict[str, Any]]:
        """The registry of launched nodes, locked across threads and processes."""
        with self._tlock, locked_json(self.registry_path, {"instances": {}}) as reg:
            yield reg

    # ---- Provider interface ----------------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        return Capabilities(
            spot=Capability(False, "this machine is not rented: there is no spot capacity"),
            multi_node=Capability(False, "the local provider is one machine"),
            max_gpus_per_node=16,
        )

    def offers(self, req: Requirements) -> list[Offer]:
        if req.gpu != "cpu" or self.refuse(req) is not None:
            return []
        if req.regions and "local" not in req.regions:
            return []
        return [Offer("local", "local", "cpu", req.gpus_per_node, False, 0.0, "this machine", nodes=1)]

    def refuse(self, req: Requirements) -> str | None:
        if req.gpu != "cpu":
            return f"the local provider runs CPU ranks only (asked {req.gpu}); use gpu: cpu"
        return super().refuse(req)

    def launch(self, request: LaunchRequest) -> Handle:
        req = Requirements(gpu=request.offer.gpu, gpus_per_node=request.offer.gpus_per_node,
                           nodes=request.nodes, spot=request.offer.spot)
        reason = self.refuse(req)
        if reason:
            raise perr.NotSupported(reason, provider="local")
        if not request.command:
            raise perr.NotSupported("LaunchRequest.command is empty", provider="local")
        name = request.instance_name
        iid = f"local-{uuid.uuid4().hex[:12]}"
        log_path = Path(request.log_path) if request.log_path else self.home / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        exit_path = Path(f"{log_path}.exit")
        exit_path.unlink(missing_ok=True)
        tmp_dir = self._tmp_root / iid
        tmp_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, WRAPPER, "--exit-file", str(exit_path), "--grace", str(self.grace_seconds)]
        if request.deadline is not None:
            argv += ["--deadline", repr(float(request.deadline))]
        argv += ["--", *request.command]
        # The node inherits this process's environment (the controller leaves ``secrets`` empty
        # for local nodes); secrets a caller does pass reach the child only, never the registry.
        tmp = {"TMPDIR": str(tmp_dir), "TMP": str(tmp_dir), "TEMP": str(tmp_dir)}
        env = {**os.environ, **tmp, **request.env, **request.secrets, MARKER_ENV: iid}
        now = time.time()
        with open(log_path, "ab") as log:
            try:
                proc = subprocess.Popen(argv, env=env, cwd=request.workdir or None, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                raise perr.NotSupported(f"cannot start the local node: {e}", provider="local") from None
        self._procs[iid] = proc
        pid = proc.pid
        data = {"pid": pid, "pgid": pid, "log_path": str(log_path), "exit_path": str(exit_path),
                "starttime": _starttime(pid), "tmp_dir": str(tmp_dir)}
        rec = {"id": iid, "name": name, "owner": request.owner, "created_at": now, "terminated_at": None,
               "term_sent_at": None, "killed_at": None, **data}
        with self._registry() as reg:
            reg["instances"][iid] = rec
        return Handle(provider="local", name=name, instance_id=iid, region="local", launched_at=now, data=data)

    def poll(self, handle: Handle) -> NodeState:
        rec = self._record(handle)
        if self._alive(rec):
            return NodeState.RUNNING
        self._clean_tmp(rec)
        code = self._exit_code(rec)
        if rec.get("terminated_at") is not None and rec.get("term_was_live"):
            return NodeState.TERMINATED  # we ended it (whatever it exited with then)
        if code is None:
            return NodeState.PREEMPTED  # killed (SIGKILL to the group) or vanished: not by us
        return _state_for(code)

    def terminate(self, handle: Handle) -> None:
        rec = self._record(handle)
        iid = rec["id"]
        now = time.time()
        live = self._alive(rec) or self._group_alive(rec)
        with self._registry() as reg:
            r = reg["instances"].get(iid, rec)
            if r.get("terminated_at") is None:
                r["terminated_at"] = now
                r["term_was_live"] = live
            reg["instances"][iid] = r
            rec = r
        if not live:
            self._clean_tmp(rec)
            return  # already gone: not an error
        pgid = int(rec["pgid"])
        if rec.get("term_sent_at") is None:
            self._signal(rec, signal.SIGTERM)
            self._update(iid, term_sent_at=time.time())
            rec["term_sent_at"] = time.time()
        deadline = time.time() + self.confirm_wait_seconds
        while True:
            self._reap(iid)
            if not _group_alive(pgid):
                self._clean_tmp(rec)
                return
            if time.time() - float(rec["term_sent_at"]) >= self.grace_seconds and rec.get("killed_at") is None:
                self._signal(rec, signal.SIGKILL)
                self._update(iid, killed_at=time.time())
                rec["killed_at"] = time.time()
            if time.time() >= deadline:
                break
            time.sleep(0.05)
        raise perr.TerminateNotConfirmed(
            f"{rec['name']} (pid {rec['pid']}): SIGTERM sent, still running; "
            f"SIGKILL {self.grace_seconds:g}s after it", provider="local")

    def list_owned(self, prefix: str = NAME_PREFIX) -> list[OwnedInstance]:
        with self._registry() as reg:
            recs = list(reg["instances"].values())
            # Forget nodes gone for more than a week.
            cutoff = time.time() - 7 * 86400
            for r in recs:
                if r["created_at"] < cutoff and not self._group_alive(r):
                    reg["instances"].pop(r["id"], None)
        out = []
        for r in sorted(recs, key=lambda r: r["created_at"]):
            # one look at the group per record: a node not listed has had its temp folder removed
            # in this same call (two looks raced: alive at the cleanup, gone at the listing)
            alive = self._group_alive(r)
            if not alive and r.get("tmp_dir") and Path(r["tmp_dir"]).exists():
                self._clean_tmp(r)
            if r["name"].startswith(prefix) and alive:
                state = NodeState.RUNNING if r.get("terminated_at") is None else NodeState.TERMINATED
                out.append(OwnedInstance(r["name"], r["id"], state, "local", r["created_at"], r.get("owner")))
        return out

    def logs(self, handle: Handle, tail: int = 200) -> str:
        path = handle.data.get("log_path")
        if not path:
            return ""
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-tail:])

    # ---- internals -------------------------------------------------------------------------------
    @property
    def _tmp_root(self) -> Path:
        return self.home / "local" / "tmp"

    def _clean_tmp(self, rec: dict[str, Any]) -> None:
        """Remove the node's temp folder once no process of its group is left (only a folder
        under ``_tmp_root``: a record never points the cleanup elsewhere)."""
        d = rec.get("tmp_dir")
        if not d or not Path(d).exists():
            return
        p = Path(d).resolve()
        if p.parent != self._tmp_root.resolve() or self._group_alive(rec):
            return
        shutil.rmtree(p, ignore_errors=True)

    def _record(self, handle: Handle) -> dict[str, Any]:
        with self._registry() as reg:
            rec = reg["instances"].get(handle.instance_id)
        if rec is None:  # registry lost (another DTRUN_HOME): the handle has what we need
            rec = {"id": handle.instance_id, "name": handle.name, "created_at": handle.launched_at,
                   "terminated_at": None, "term_sent_at": None, "killed_at": None, **handle.data}
        return rec

    def _update(self, iid: str, **kv: Any) -> None:
        with self._registry() as reg:
            if iid in reg["instances"]:
                reg["instances"][iid].update(kv)

    def _reap(self, iid: str) -> int | None:
        p = self._procs.get(iid)
        return p.poll() if p is not None else None

    def _is_ours(self, rec: dict[str, Any]) -> bool:
        """The leader pid still exists, is not a zombie, and is the process we started."""
        pid = int(rec["pid"])
        if _PROC.exists():
            st = _stat(pid)
            if st is None or st[0] == "Z":
                return False
            if rec.get("starttime") is not None and st[2] != rec["starttime"]:
                return False
            marker = _environ_marker(pid)
            return marker is None or marker == rec["id"]  # unreadable environ: start time decided
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return False

    def _alive(self, rec: dict[str, Any]) -> bool:
        p = self._procs.get(rec["id"])
        if p is not None:
            return p.poll() is None
        return self._is_ours(rec)

    def _group_alive(self, rec: dict[str, Any]) -> bool:
        self._reap(rec["id"])
        if self._alive(rec):
            return True
        # The leader is gone; members it left behind still belong to the node (the kernel does not
        # hand out a pid that is still some group's id). A different process now holding the
        # leader's pid (other start time) means the group is long gone.
        return self._leader_was_ours(rec) and _group_alive(int(rec["pgid"]))

    def _leader_was_ours(self, rec: dict[str, Any]) -> bool:
        st = _stat(int(rec["pid"])) if _PROC.exists() else None
        if st is None:
            return True  # the leader exited; its group id is not reused while members remain
        return rec.get("starttime") is None or st[2] == rec["starttime"]

    def _signal(self, rec: dict[str, Any], sig: int) -> None:
        if not (self._alive(rec) or self._leader_was_ours(rec)):
            return
        try:
            os.killpg(int(rec["pgid"]), sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def _exit_code(rec: dict[str, Any]) -> int | None:
        try:
            return int(Path(rec["exit_path"]).read_text().strip())
        except (FileNotFoundError, ValueError, KeyError):
            return None


def _state_for(code: int) -> NodeState:
    if code == 0:
        return NodeState.SUCCEEDED
    if code < 0 or code in PREEMPT_EXIT_CODES:
        return NodeState.PREEMPTED
    return NodeState.FAILED

"""dtrun node bootstrap: fetch the job, run the trainer under torchrun, and guard the money.

Run on every node as ``python infra/node_bootstrap.py`` (the controller puts this command in
``LaunchRequest.command``). It needs only the standard library and fsspec (through
``orchestrator.contract.runuri``); it never imports torch, so the watchdog stays light and responsive.

What it does, in order:

1. Reads ``<DTRUN_RUN_URI>/job.yaml`` (written by the controller before launch) into a temp file.
2. Maps the provider's environment to torchrun flags (single node: ``--standalone``; SkyPilot
   multi-node: ``SKYPILOT_NODE_RANK``/``SKYPILOT_NODE_IPS``/``SKYPILOT_NUM_GPUS_PER_NODE`` →
   ``--nnodes/--node-rank/--master-addr/--master-port``).
   Multi-node: ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` name the interface that carries this
   node's private IP (:func:`network_env`); a master hostname that resolves to loopback, or a
   loopback address for this node, is refused (exit 2).
3. Starts ``torchrun ... -m trainer --job <file> --run-uri <uri>`` as a child in its own process
   group (through ``infra/torchrun_launch.py``, which passes the trainer's exit code through
   instead of torchrun's blanket 1). The child dies with the bootstrap (``PR_SET_PDEATHSIG``) and
   the bootstrap is a child subreaper, so nothing the trainer started outlives it.
4. Forwards SIGTERM/SIGINT to torchrun: a spot notice becomes the trainer's emergency checkpoint
   (exit 75).
5. Runs a watchdog thread every ``DTRUN_WATCHDOG_SECONDS`` (default 10) that, with or without a
   controller, stops the run when
     - ``budget``: this node's spend (``DTRUN_PRICE_PER_HOUR`` × time since launch) would reach
       ``DTRUN_BUDGET_LEFT_USD`` by the next check plus a whole stop sequence (both graces below),
       so even a trainer that has to be killed is gone before the money runs out;
     - ``deadline``: ``DTRUN_DEADLINE`` (unix time) is within two check intervals plus both graces;
     - ``restart``: the provider ends this node ``DTRUN_NODE_TIMEOUT_SECONDS`` after its start
       (Modal's 24-hour sandbox cap); ``DTRUN_RESTART_GRACE_SECONDS`` (default 1200) before that, less
       the same margins, it stops for a planned restart (checkpoint, exit 76, resume elsewhere) —
       so the watchdog's deadline is the earlier of the job's deadline and the node's timeout less
       the grace;
     - ``controller_lost``: ``lease.json`` has been expired for longer than
       ``DTRUN_CONTROLLER_LOST_MINUTES`` (only when set);
     - ``idle``: ``progress.json``'s step has not advanced for ``DTRUN_IDLE_MINUTES``.
   Stopping = write ``watchdog.json`` ({"reason", "time", ...}) and ``STOP`` to the run URI (the
   trainer checkpoints and exits 0); if the trainer is still there after
   ``DTRUN_STOP_GRACE_SECONDS`` (default 120), SIGTERM the torchrun group (emergency checkpoint),
   and after ``DTRUN_KILL_GRACE_SECONDS`` (default 40) SIGKILL it and every descendant.
6. Exits with 76 (``EXIT_WATCHDOG``) when the watchdog stopped the run (0 if the trainer still
   wrote ``DONE``), 75 when a forwarded SIGTERM ended it, otherwise the trainer's exit code.
7. Runs ``DTRUN_SELF_TERMINATE`` (a shell command, remote nodes only) after the trainer exits,
   so the node removes itself even when no controller is left to do it.
8. Reports itself to the run URI all along (``infra/node_report.py``): ``nodes/a<attempt>/
   node-<rank>.json`` (rank, private IP, host, state, exit code) and ``node-<rank>.log`` (the
   node's output: its own lines, torchrun's and the ranks', which it also passes through to its
   stdout/stderr).

Other environment (all optional but the first two): ``DTRUN_JOB``, ``DTRUN_ATTEMPT``,
``DTRUN_NPROC_PER_NODE`` (default: ``SKYPILOT_NUM_GPUS_PER_NODE``, ``RUNPOD_GPU_COUNT``,
``GPU_COUNT``, else 1), ``DTRUN_NNODES``, ``DTRUN_NODE_RANK``, ``DTRUN_MASTER_ADDR``,
``DTRUN_MASTER_PORT`` (29500), ``DTRUN_LAUNCHED_AT`` (unix time the instance was requested, so
provisioning counts against the node's budget; default: the bootstrap's start).

For tests only: ``DTRUN_TRAINER_MODULE`` replaces ``trainer`` after ``-m`` (a fake trainer under
real torchrun); ``DTRUN_TRAINER_CMD`` (a shell-quoted argv prefix) replaces the whole torchrun
invocation; ``--job``/``--run-uri`` are appended either way.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from orchestrator.contract import runuri  # noqa: E402  (stdlib + lazily fsspec; never torch)
from infra.node_report import NodeReport, node_ip, report_seconds  # noqa: E402

EXIT_WATCHDOG = getattr(runuri, "EXIT_WATCHDOG", 76)
EXIT_PREEMPTED = runuri.EXIT_PREEMPTED
EXIT_BAD_CONFIG = runuri.EXIT_BAD_CONFIG
WATCHDOG_FILE = getattr(runuri, "WATCHDOG", "watchdog.json")
JOB_FILE = getattr(runuri, "JOB_FILE", "job.yaml")

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

REASONS = ("budget", "deadline", "restart", "controller_lost", "idle")


_REPORT: list[NodeReport] = []
"""The node's report, once started: the bootstrap's own lines go into the node's log too."""


def log(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    line = f"[dtrun-node {stamp}] {msg}"
    print(line, file=sys.stderr, flush=True)
    for r in _REPORT:
        r.feed((line + "\n").encode())


# ---- configuration from the environment ----------------------------------------------------

class ConfigError(Exception):
    pass


def _float(env: dict[str, str], key: str) -> float | None:
    raw = env.get(key, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a number") from None


def _int(env: dict[str, str], key: str) -> int | None:
    raw = env.get(key, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer") from None


@dataclass
class NodeConfig:
    run_uri: str
    job: str
    attempt: int = 0
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500
    price_per_hour: float | None = None
    budget_left_usd: float | None = None
    deadline: float | None = None
    node_timeout_seconds: float | None = None
    restart_grace_seconds: float = 1200.0
    controller_lost_minutes: float | None = None
    idle_minutes: float | None = None
    check_seconds: float = 10.0
    stop_grace_seconds: float = 120.0
    kill_grace_seconds: float = 40.0
    launched_at: float | None = None
    self_terminate: str | None = None
    trainer_module: str = "trainer"
    trainer_cmd: list[str] | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "NodeConfig":
        env = dict(os.environ if env is None else env)
        run_uri = env.get("DTRUN_RUN_URI", "").strip()
        job = env.get("DTRUN_JOB", "").strip()
        if not run_uri:
            raise ConfigError("DTRUN_RUN_URI is not set")
        if not job:
            raise ConfigError("DTRUN_JOB is not set")
        nproc = _int(env, "DTRUN_NPROC_PER_NODE")
        for key in ("SKYPILOT_NUM_GPUS_PER_NODE", "RUNPOD_GPU_COUNT", "GPU_COUNT"):
            if nproc is None:
                nproc = _int(env, key)
        ips = [ip.strip() for ip in env.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip()]
        nnodes = _int(env, "DTRUN_NNODES") or (len(ips) if ips else 1)
        rank = _int(env, "SKYPILOT_NODE_RANK")
        if rank is None:
            rank = _int(env, "DTRUN_NODE_RANK") or 0
        master = env.get("DTRUN_MASTER_ADDR", "").strip() or (ips[0] if ips else None)
        cfg = cls(
            run_uri=run_uri,
            job=job,
            attempt=_int(env, "DTRUN_ATTEMPT") or 0,
            nproc_per_node=max(1, nproc or 1),
            nnodes=max(1, nnodes),
            node_rank=rank,
            master_addr=master,
            master_port=_int(env, "DTRUN_MASTER_PORT") or 29500,
            price_per_hour=_float(env, "DTRUN_PRICE_PER_HOUR"),
            budget_left_usd=_float(env, "DTRUN_BUDGET_LEFT_USD"),
            deadline=_float(env, "DTRUN_DEADLINE"),
            node_timeout_seconds=_float(env, "DTRUN_NODE_TIMEOUT_SECONDS"),
            restart_grace_seconds=_float(env, "DTRUN_RESTART_GRACE_SECONDS") or 1200.0,
            controller_lost_minutes=_float(env, "DTRUN_CONTROLLER_LOST_MINUTES"),
            idle_minutes=_float(env, "DTRUN_IDLE_MINUTES"),
            check_seconds=_float(env, "DTRUN_WATCHDOG_SECONDS") or 10.0,
            launched_at=_float(env, "DTRUN_LAUNCHED_AT"),
            self_terminate=env.get("DTRUN_SELF_TERMINATE", "").strip() or None,
            trainer_module=env.get("DTRUN_TRAINER_MODULE", "").strip() or "trainer",
            trainer_cmd=shlex.split(env["DTRUN_TRAINER_CMD"]) if env.get("DTRUN_TRAINER_CMD", "").strip() else None,
        )
        sg = _float(env, "DTRUN_STOP_GRACE_SECONDS")
        kg = _float(env, "DTRUN_KILL_GRACE_SECONDS")
        if sg is not None:
            cfg.stop_grace_seconds = sg
        if kg is not None:
            cfg.kill_grace_seconds = kg
        if cfg.check_seconds <= 0:
            raise ConfigError("DTRUN_WATCHDOG_SECONDS must be positive")
        if cfg.nnodes > 1 and not cfg.master_addr:
            raise ConfigError(f"{cfg.nnodes} nodes but no master address "
                              "(set SKYPILOT_NODE_IPS or DTRUN_MASTER_ADDR)")
        return cfg


# ---- multi-node networking -------------------------------------------------------------------

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def ipv4_by_interface() -> dict[str, list[str]]:
    """Each network interface's IPv4 addresses: ``ip -o -4 addr show`` (secondary addresses too),
    else each interface's primary address through ``SIOCGIFADDR`` (stdlib only)."""
    out: dict[str, list[str]] = {}
    try:
        text = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10,
                              check=True).stdout
        for line in text.splitlines():  # "4: eth0    inet 10.0.0.5/24 brd … scope global eth0\ …"
            parts = line.split()
            if len(parts) >= 4 and parts[2] == "inet":
                out.setdefault(parts[1].split("@")[0], []).append(parts[3].split("/")[0])
        if out:
            return out
    except (OSError, subprocess.SubprocessError):
        pass
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            out.setdefault(name, []).append(socket.inet_ntoa(raw[20:24]))
    return out


def _is_ip(addr: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in addr else socket.AF_INET, addr)
        return True
    except OSError:
        return False


def _loopback(addrs: list[str]) -> list[str]:
    return [a for a in addrs if a.startswith("127.") or a == "::1"]


def _resolve(host: str) -> list[str]:
    try:
        return sorted({i[4][0] for i in socket.getaddrinfo(host, None)})
    except OSError:
        return []


def network_env(cfg: NodeConfig, env: dict[str, str], ip: str | None, interfaces=ipv4_by_interface,
                resolve=_resolve) -> dict[str, str]:
    """Environment for a multi-node rendezvous (empty for one node), or ConfigError (exit 2).

    gloo (every object collective, the checkpoint groups) and NCCL's bootstrap pick their address
    from the hostname or the first interface they like; an image that maps the hostname to
    127.0.1.1, or a docker0 bridge, then makes cross-node connects fail or hang. So both are
    pinned to the interface that carries this node's private IP (``ip``: infra/node_report's
    ``node_ip`` — ``SKYPILOT_NODE_IPS[rank]``, else the source address of the route to the
    master); values already in the environment win. A master *hostname* that resolves to
    loopback is refused: the other nodes would dial themselves. All nodes on one host (a loopback
    master IP, as the tests run) need nothing."""
    if cfg.nnodes <= 1:
        return {}
    master = cfg.master_addr or ""
    if master and not _is_ip(master):
        lo = _loopback(resolve(master))
        if lo:
            raise ConfigError(f"master address {master!r} resolves to loopback ({', '.join(lo)}): the other "
                              f"nodes cannot reach it; set DTRUN_MASTER_ADDR (or SKYPILOT_NODE_IPS) to the "
                              f"master node's private IP")
    if _loopback([master]) or all(env.get(k) for k in SOCKET_IFNAME_VARS):
        return {}
    if not ip or _loopback([ip]):
        raise ConfigError(f"this node's address is {ip or 'unknown'} for a {cfg.nnodes}-node rendezvous at "
                          f"{master}: gloo would listen on loopback; set SKYPILOT_NODE_IPS or GLOO_SOCKET_IFNAME "
                          f"and NCCL_SOCKET_IFNAME")
    names = [n for n, ips in interfaces().items() if ip in ips]
    if not names:  # e.g. a public IP behind NAT (a container host): leave the choice to gloo/NCCL
        return {}
    return {k: names[0] for k in SOCKET_IFNAME_VARS if not env.get(k)}


def torchrun_flags(cfg: NodeConfig) -> list[str]:
    """torchrun's launcher flags for this node (everything before ``-m trainer``)."""
    # torchrun SIGKILLs workers --shutdown-timeout seconds after forwarding a SIGTERM (default 30):
    # give the emergency checkpoint the same grace the watchdog gives the whole node.
    flags = ["--nproc-per-node", str(cfg.nproc_per_node),
             "--shutdown-timeout", str(max(1, int(cfg.kill_grace_seconds)))]
    if cfg.nnodes == 1:
        return ["--standalone", *flags]
    return [*flags, "--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank),
            "--master-addr", str(cfg.master_addr), "--master-port", str(cfg.master_port)]


def trainer_argv(cfg: NodeConfig, job_file: str) -> list[str]:
    """The full child command: torchrun (through torchrun_launch) running the trainer module."""
    tail = ["--job", job_file, "--run-uri", cfg.run_uri]
    if cfg.trainer_cmd:
        return [*cfg.trainer_cmd, *tail]
    launcher = os.path.join(_HERE, "torchrun_launch.py")
    return [sys.executable, launcher, *torchrun_flags(cfg), "-m", cfg.trainer_module, *tail]


# ---- process handling (Linux prctl through ctypes; no-ops elsewhere) ----------------------

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


def _child_preexec(parent: int):
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


def _signal_tree(pid: int, sig: int) -> None:
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


# ---- the watchdog ------------------------------------------------------------------------

class Watchdog:
    """Checks budget, deadline, lease and progress every ``check_seconds``; stops the trainer
    (STOP, grace, SIGTERM, SIGKILL) on the first reason it finds."""

    def __init__(self, cfg: NodeConfig, start: float, clock=time.time):
        self.cfg = cfg
        self.clock = clock
        self.spend_since = cfg.launched_at if cfg.launched_at is not None else start
        self.started = start
        self.restart_at = (start + cfg.node_timeout_seconds - cfg.restart_grace_seconds
                           if cfg.node_timeout_seconds else None)
        self.reason: str | None = None
        self.detail: str = ""
        self._last_step: tuple | None = None
        self._last_progress_at = start
        self._read_errors = 0

    # -- individual checks (each returns a detail string when it fires) --
    def spend_usd(self, at: float) -> float:
        if self.cfg.price_per_hour is None:
            return 0.0
        return self.cfg.price_per_hour * max(0.0, at - self.spend_since) / 3600.0

    def check_budget(self, now: float) -> str | None:
        c = self.cfg
        if c.price_per_hour is None or c.budget_left_usd is None:
            return None
        # the whole stop sequence must fit: the next check, the STOP grace, the SIGTERM grace
        ahead = now + c.check_seconds + c.stop_grace_seconds + c.kill_grace_seconds
        if self.spend_usd(ahead) >= c.budget_left_usd:
            return (f"spend ${self.spend_usd(now):.4f} would reach the node's budget "
                    f"${c.budget_left_usd:.4f} by the next check plus a full stop sequence")
        return None

    def check_deadline(self, now: float) -> str | None:
        c = self.cfg
        if c.deadline is None:
            return None
        if now + 2 * c.check_seconds + c.stop_grace_seconds + c.kill_grace_seconds >= c.deadline:
            return f"deadline {c.deadline:.0f} is {c.deadline - now:.0f}s away"
        return None

    def check_restart(self, now: float) -> str | None:
        """The provider's own end of this node (its timeout) less the grace is near, and comes
        before the job's deadline (that one is ``deadline``)."""
        c = self.cfg
        if self.restart_at is None or (c.deadline is not None and c.deadline <= self.restart_at):
            return None
        if now + 2 * c.check_seconds + c.stop_grace_seconds + c.kill_grace_seconds >= self.restart_at:
            end = self.restart_at + c.restart_grace_seconds
            return (f"planned restart: the provider's {c.node_timeout_seconds:.0f}s timeout ends this node "
                    f"in {end - now:.0f}s (restart grace {c.restart_grace_seconds:.0f}s)")
        return None

    def _read(self, name: str):
        try:
            return runuri.read_json(runuri.join(self.cfg.run_uri, name)), True
        except Exception as e:  # a flaky object store must not stop (or crash) a healthy run
            self._read_errors += 1
            if self._read_errors <= 3 or self._read_errors % 100 == 0:
                log(f"watchdog: cannot read {name}: {type(e).__name__}: {e}")
            return None, False

    def check_lease(self, now: float) -> str | None:
        c = self.cfg
        if c.controller_lost_minutes is None:
            return None
        lease, ok = self._read(runuri.LEASE)
        if not ok:
            return None
        expires = None
        if isinstance(lease, dict):
            try:
                expires = float(lease.get("expires"))
            except (TypeError, ValueError):
                expires = None
        if expires is None:
            expires = self.started  # no lease at all: stale from our start
        stale = now - expires
        if stale > c.controller_lost_minutes * 60:
            return f"controller lease expired {stale:.0f}s ago (limit {c.controller_lost_minutes * 60:.0f}s)"
        return None

    def check_idle(self, now: float) -> str | None:
        c = self.cfg
        if c.idle_minutes is None:
            return None
        prog, ok = self._read(runuri.PROGRESS)
        if ok and isinstance(prog, dict):
            key = (prog.get("attempt"), prog.get("step"))
            if key != self._last_step:
                if self._last_step is not None:
                    self._last_progress_at = now
                self._last_step = key
        idle = now - self._last_progress_at
        if idle > c.idle_minutes * 60:
            return f"no training progress for {idle:.0f}s (limit {c.idle_minutes * 60:.0f}s)"
        return None

    def check(self, now: float | None = None) -> tuple[str, str] | None:
        now = self.clock() if now is None else now
        for reason, fn in (("budget", self.check_budget), ("deadline", self.check_deadline),
                           ("restart", self.check_restart),
                           ("controller_lost", self.check_lease), ("idle", self.check_idle)):
            detail = fn(now)
            if detail:
                return reason, detail
        return None

    def record(self, reason: str, detail: str) -> None:
        """watchdog.json first (why), then STOP (the trainer checkpoints and exits 0)."""
        self.reason, self.detail = reason, detail
        now = self.clock()
        rec = {"reason": reason, "detail": detail, "time": now, "job": self.cfg.job,
               "attempt": self.cfg.attempt, "node_rank": self.cfg.node_rank,
               "host": socket.gethostname(), "spend_usd": round(self.spend_usd(now), 6)}
        for name, text in ((WATCHDOG_FILE, json.dumps(rec, sort_keys=True)),
                           (runuri.STOP, json.dumps({"by": "watchdog", **rec}, sort_keys=True))):
            for attempt in range(3):
                try:
                    runuri.write_text(runuri.join(self.cfg.run_uri, name), text)
                    break
                except Exception as e:  # keep trying: STOP is how the trainer checkpoints
                    log(f"watchdog: cannot write {name} ({type(e).__name__}: {e}); retrying")
                    time.sleep(0.5 * (attempt + 1))


def run_watchdog(wd: Watchdog, child: subprocess.Popen, done: threading.Event) -> None:
    cfg = wd.cfg
    while not done.wait(cfg.check_seconds):
        hit = wd.check()
        if hit is None:
            continue
        reason, detail = hit
        log(f"watchdog: stopping the run ({reason}: {detail})")
        wd.record(reason, detail)
        if done.wait(cfg.stop_grace_seconds):
            return
        log(f"watchdog: trainer still running {cfg.stop_grace_seconds:.0f}s after STOP; SIGTERM")
        _signal_tree(child.pid, signal.SIGTERM)
        if done.wait(cfg.kill_grace_seconds):
            return
        log(f"watchdog: trainer still running {cfg.kill_grace_seconds:.0f}s after SIGTERM; SIGKILL")
        _signal_tree(child.pid, signal.SIGKILL)
        return


# ---- main ---------------------------------------------------------------------------------

def fetch_job(cfg: NodeConfig, tries: int = 5) -> str:
    """``<run-uri>/job.yaml`` → a local temp file (its path)."""
    uri = runuri.join(cfg.run_uri, JOB_FILE)
    text, err = None, None
    for i in range(tries):
        try:
            text = runuri.read_text(uri)
            break
        except Exception as e:  # object store hiccup: retried, then reported
            err = e
            time.sleep(min(8.0, 0.5 * 2 ** i))
    if text is None:
        raise ConfigError(f"cannot read {uri}: {err or 'no such file'} "
                          "(the controller writes it before launch)")
    fd, path = tempfile.mkstemp(prefix=f"dtrun-{cfg.job}-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def self_terminate(cmd: str, tries: int = 3) -> None:
    for i in range(tries):
        log(f"self-terminate (try {i + 1}/{tries})")
        try:
            r = subprocess.run(cmd, shell=True, timeout=120)
            if r.returncode == 0:
                return
            log(f"self-terminate exited {r.returncode}")
        except subprocess.TimeoutExpired:
            log("self-terminate timed out")
        time.sleep(5 * (i + 1))


def main() -> int:
    try:
        cfg = NodeConfig.from_env()
    except ConfigError as e:
        log(f"bad node environment: {e}")
        return EXIT_BAD_CONFIG
    start = time.time()
    multi = cfg.nnodes > 1
    report = NodeReport(cfg.run_uri, cfg.attempt, cfg.node_rank, cfg.nnodes,
                        ip=node_ip(dict(os.environ), cfg.node_rank, cfg.master_addr if multi else None),
                        master=f"{cfg.master_addr}:{cfg.master_port}" if multi else None,
                        every=report_seconds(), log=log)
    _REPORT.append(report)
    log(f"job {cfg.job} attempt {cfg.attempt} node {cfg.node_rank}/{cfg.nnodes} "
        f"ip {report.record['ip']} nproc {cfg.nproc_per_node} run {cfg.run_uri}")
    report.start()
    try:
        job_file = fetch_job(cfg)
    except ConfigError as e:
        log(str(e))
        report.close(EXIT_BAD_CONFIG)
        _finish(cfg)
        return EXIT_BAD_CONFIG

    become_subreaper()
    user = _user_command(cfg, job_file)
    if isinstance(user, int):
        report.close(user)
        _finish(cfg)
        return user
    argv = user.argv() if user else trainer_argv(cfg, job_file)
    env = user.env() if user else dict(os.environ)
    try:
        net = network_env(cfg, env, report.record["ip"])
    except ConfigError as e:
        log(f"bad node network: {e}")
        report.close(EXIT_BAD_CONFIG)
        _finish(cfg)
        return EXIT_BAD_CONFIG
    if net:
        log("multi-node network: " + " ".join(f"{k}={v}" for k, v in sorted(net.items())))
    elif multi and not all(env.get(k) for k in SOCKET_IFNAME_VARS):
        log(f"multi-node network: this node's IP {report.record['ip']} is on none of its interfaces; "
            "gloo/NCCL pick their own (set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME if they pick wrong)")
    env.update(net)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH", "")) if p)
    env.setdefault("DTRUN_ATTEMPT", str(cfg.attempt))
    env["PYTHONUNBUFFERED"] = "1"
    log("exec: " + " ".join(shlex.quote(a) for a in argv))

    forwarded: list[int] = []
    holder: list[subprocess.Popen] = []

    def forward(signum, _frame):
        forwarded.append(signum)
        if not holder:
            return  # not started yet: main() sees `forwarded` and does not start it
        log(f"got signal {signum}; forwarding to torchrun (pid {holder[0].pid})")
        try:
            os.killpg(holder[0].pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    if forwarded:
        log("signalled before the trainer started; exiting")
        if user:
            user.finish(EXIT_PREEMPTED, stopped=True)
        report.close(EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    child = subprocess.Popen(argv, env=env, preexec_fn=_child_preexec(os.getpid()),
                             cwd=user.code_dir if user else None,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    holder.append(child)
    out, err = _binary(sys.stdout), _binary(sys.stderr)
    if user:  # a command job's progress comes from its output lines
        out, err = user.tee(out), user.tee(err)
        user.start()
    pumps = [report.pump(child.stdout, out), report.pump(child.stderr, err)]
    report.set("RUNNING")
    if forwarded:  # a signal landed between Popen and here
        os.killpg(child.pid, forwarded[-1])

    wd = Watchdog(cfg, start)
    done = threading.Event()
    t = threading.Thread(target=run_watchdog, args=(wd, child, done), name="dtrun-watchdog", daemon=True)
    t.start()
    rc = child.wait()
    done.set()
    t.join(timeout=5)
    reap_leftovers()
    for p in pumps:
        p.join(timeout=5)
    try:
        os.unlink(job_file)
    except OSError:
        pass

    if rc < 0:
        rc = 128 + (-rc)
    if user:
        rc = user.finish(rc, stopped=bool(forwarded) or wd.reason is not None)
    done_written = _safe_exists(runuri.join(cfg.run_uri, runuri.DONE))
    if wd.reason is not None and not (rc == 0 and done_written):
        log(f"trainer exited {rc} after the watchdog stopped it ({wd.reason}); exit {EXIT_WATCHDOG}")
        rc = EXIT_WATCHDOG
    elif forwarded and rc not in (0, EXIT_BAD_CONFIG, EXIT_PREEMPTED):
        log(f"trainer exited {rc} after a forwarded signal; exit {EXIT_PREEMPTED} (resume me)")
        rc = EXIT_PREEMPTED
    else:
        log(f"trainer exited {rc}")
    report.close(rc)
    _finish(cfg)
    return rc


class _TextSink:
    """A text stream seen as a binary one (when stdout/stderr has no ``.buffer``)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode(errors="replace"))

    def flush(self) -> None:
        self.stream.flush()


def _binary(stream):
    return getattr(stream, "buffer", None) or _TextSink(stream)


def _user_command(cfg: NodeConfig, job_file: str):
    """For a ``command:`` job: the prepared :class:`infra.usercode.UserCommand` (code unpacked,
    setup run, newest COMMITTED checkpoint restored), or the node's exit code when that failed.
    None for the bundled trainer. The watchdog skips the STOP grace for it (a user's script does
    not read STOP): its stop is SIGTERM at once, the contract's "checkpoint now"."""
    from infra import usercode

    try:
        command = usercode.load_command(job_file)
    except (OSError, ValueError) as e:
        log(f"cannot read the job file: {e}")
        return EXIT_BAD_CONFIG
    if command is None:
        return None
    cfg.stop_grace_seconds = 0.0
    user = usercode.UserCommand(cfg, command, torchrun_flags(cfg), os.path.join(_HERE, "torchrun_launch.py"))
    try:
        user.prepare()
    except usercode.SetupFailed as e:
        log(f"setup failed: {e}")
        return user.finish(1, stopped=True)
    except Exception as e:  # the store or the archive: a failure, retried by the controller
        log(f"preparing the command failed: {type(e).__name__}: {e}")
        return user.finish(1, stopped=True)
    return user


def _safe_exists(uri: str) -> bool:
    try:
        return runuri.exists(uri)
    except Exception:  # unreachable store: we cannot claim DONE
        return False


def _finish(cfg: NodeConfig) -> None:
    if cfg.self_terminate:
        self_terminate(cfg.self_terminate)


if __name__ == "__main__":
    sys.exit(main())

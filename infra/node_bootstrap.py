"""dtrun node bootstrap: fetch the job, run the trainer under torchrun, and guard the money.

Run on every node as ``python infra/node_bootstrap.py`` (``orchestrator.contract.nodeenv.
bootstrap_command``: the controller puts it in ``LaunchRequest.command``; no arguments, everything
is in the environment). It needs only the standard library and fsspec (through
``orchestrator.contract.runuri``); it never imports torch, so the watchdog stays light and responsive.
This module is the entry and the order of things; each concern lives beside it:
``infra/node_config.py`` (the environment, read through ``orchestrator.contract.nodeenv``, and the
job file), ``infra/node_network.py`` (IPs, interfaces, rendezvous flags), ``infra/node_proctree.py``
(torchrun's process group, signals, leftovers), ``infra/node_watchdog.py`` (budget, deadline, lease,
idle), ``infra/node_report.py`` (the node's record and log in the run URI), ``infra/usercode.py``
(a ``command:`` job's side).

What it does, in order:

1. Reads ``<DTRUN_RUN_URI>/job.yaml`` (written by the controller before launch) into a temp file.
2. Maps the provider's environment to torchrun flags (single node: ``--standalone``; SkyPilot
   multi-node: ``SKYPILOT_NODE_RANK``/``SKYPILOT_NODE_IPS``/``SKYPILOT_NUM_GPUS_PER_NODE`` →
   ``--nnodes/--node-rank/--master-addr/--master-port``).
   Multi-node: ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` name the interface that carries this
   node's private IP (``infra.node_network.network_env``); a master hostname that resolves to
   loopback, or a loopback address for this node, is refused (exit 2).
3. Starts ``torchrun ... -m trainer --job <file> --run-uri <uri>`` as a child in its own process
   group (through ``infra/torchrun_launch.py``, which passes the trainer's exit code through
   instead of torchrun's blanket 1). The child dies with the bootstrap (``PR_SET_PDEATHSIG``) and
   the bootstrap is a child subreaper, so nothing the trainer started outlives it.
4. Forwards SIGTERM/SIGINT to torchrun: a spot notice becomes the trainer's emergency checkpoint
   (exit 75).
5. Runs a watchdog thread (``infra/node_watchdog.py``) every ``DTRUN_WATCHDOG_SECONDS`` (default
   10) that, with or without a controller, stops the run for ``budget`` (``DTRUN_PRICE_PER_HOUR``,
   ``DTRUN_BUDGET_LEFT_USD``, counted from ``DTRUN_LAUNCHED_AT``), ``deadline`` (``DTRUN_DEADLINE``),
   ``restart`` (the provider's own end of the node, ``DTRUN_NODE_TIMEOUT_SECONDS`` less
   ``DTRUN_RESTART_GRACE_SECONDS``), ``controller_lost`` (``DTRUN_CONTROLLER_LOST_MINUTES``) or
   ``idle`` (``DTRUN_IDLE_MINUTES``): ``watchdog.json`` and ``STOP`` (the trainer checkpoints and
   exits 0), SIGTERM after ``DTRUN_STOP_GRACE_SECONDS`` (120), SIGKILL of the whole tree after
   ``DTRUN_KILL_GRACE_SECONDS`` (40) more.
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

import os
import shlex
import subprocess
import sys
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from infra.node_config import ConfigError, NodeConfig, fetch_job  # noqa: E402
from infra.node_log import also_to, log  # noqa: E402
from infra.node_network import SOCKET_IFNAME_VARS, network_env, node_ip, torchrun_flags  # noqa: E402
from infra.node_proctree import ChildGroup, become_subreaper, reap_leftovers  # noqa: E402
from infra.node_report import NodeReport, report_seconds  # noqa: E402
from infra.node_watchdog import Watchdog, run_watchdog  # noqa: E402
from orchestrator.contract import nodeenv, runuri  # noqa: E402  (stdlib + lazily fsspec; never torch)

EXIT_WATCHDOG = runuri.EXIT_WATCHDOG
EXIT_PREEMPTED = runuri.EXIT_PREEMPTED
EXIT_BAD_CONFIG = runuri.EXIT_BAD_CONFIG
LAUNCHER = os.path.join(_HERE, "torchrun_launch.py")
"""torchrun with the trainer's exit code passed through (``infra/torchrun_launch.py``)."""


def trainer_argv(cfg: NodeConfig, job_file: str) -> list[str]:
    """The full child command: torchrun (through torchrun_launch) running the trainer module, or
    the test's ``DTRUN_TRAINER_CMD``; the trainer's arguments appended either way."""
    tail = nodeenv.trainer_args(job_file, cfg.run_uri)
    if cfg.trainer_cmd:
        return [*cfg.trainer_cmd, *tail]
    return [sys.executable, LAUNCHER, *torchrun_flags(cfg), "-m", cfg.trainer_module, *tail]


def self_terminate(cmd: str, tries: int = 3) -> None:
    """Run ``DTRUN_SELF_TERMINATE`` (the node removes itself), up to ``tries`` times."""
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
    also_to(report)
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
    env.setdefault(nodeenv.ATTEMPT, str(cfg.attempt))
    env["PYTHONUNBUFFERED"] = "1"
    log("exec: " + " ".join(shlex.quote(a) for a in argv))

    group = ChildGroup()
    group.forward_signals()
    forwarded = group.forwarded
    if forwarded:
        log("signalled before the trainer started; exiting")
        if user:
            user.finish(EXIT_PREEMPTED, stopped=True)
        report.close(EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    child = group.start(argv, env, cwd=user.code_dir if user else None)
    out, err = _binary(sys.stdout), _binary(sys.stderr)
    if user:  # a command job's progress comes from its output lines
        out, err = user.tee(out), user.tee(err)
        user.start()
    pumps = [report.pump(child.stdout, out), report.pump(child.stderr, err)]
    report.set("RUNNING")
    group.resend()  # a signal that landed between Popen and here

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
    user = usercode.UserCommand(cfg, command, torchrun_flags(cfg), LAUNCHER)
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

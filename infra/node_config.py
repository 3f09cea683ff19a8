"""What this node runs with: the launch's environment read through the contract
(``orchestrator.contract.nodeenv``), the node's defaults and the provider's own variables filled
in, and the job file the run URI holds.

:meth:`NodeConfig.from_env` is the only place the node reads its ``DTRUN_*`` variables; a value
that is missing or does not parse is a :class:`ConfigError`, which the bootstrap turns into exit
2 (a bad config: never relaunched). Standard library only (plus the contract): never torch.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping

from orchestrator.contract import nodeenv, runuri

DEFAULT_MASTER_PORT = 29500
DEFAULT_RESTART_GRACE_SECONDS = 1200.0
DEFAULT_WATCHDOG_SECONDS = 10.0
DEFAULT_STOP_GRACE_SECONDS = 120.0
DEFAULT_KILL_GRACE_SECONDS = 40.0


class ConfigError(Exception):
    """The node cannot run as configured (exit 2)."""


@dataclass
class NodeConfig:
    """What this node runs with: every value of the contract's ``NodeEnv`` with the node's default
    applied where the launch left it unset (the watchdog's ``check_seconds`` is
    ``DTRUN_WATCHDOG_SECONDS``)."""

    run_uri: str
    job: str
    attempt: int = 0
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    price_per_hour: float | None = None
    budget_left_usd: float | None = None
    deadline: float | None = None
    node_timeout_seconds: float | None = None
    restart_grace_seconds: float = DEFAULT_RESTART_GRACE_SECONDS
    controller_lost_minutes: float | None = None
    idle_minutes: float | None = None
    check_seconds: float = DEFAULT_WATCHDOG_SECONDS
    stop_grace_seconds: float = DEFAULT_STOP_GRACE_SECONDS
    kill_grace_seconds: float = DEFAULT_KILL_GRACE_SECONDS
    launched_at: float | None = None
    self_terminate: str | None = None
    trainer_module: str = "trainer"
    trainer_cmd: list[str] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeConfig:
        """This node's configuration from ``env`` (default: the process environment).

        Ranks per node: ``DTRUN_NPROC_PER_NODE``, else the provider's GPU count
        (``nodeenv.GPU_COUNT_FALLBACKS``), else 1. Node count, rank and master: ``DTRUN_NNODES``/
        ``DTRUN_NODE_RANK``/``DTRUN_MASTER_ADDR``, else SkyPilot's ``SKYPILOT_NODE_IPS`` (one per
        line, the head first) and ``SKYPILOT_NODE_RANK`` (which wins over ``DTRUN_NODE_RANK``)."""
        env = dict(os.environ if env is None else env)
        try:
            e = nodeenv.from_env(env)
            nproc = e.nproc_per_node
            for key in nodeenv.GPU_COUNT_FALLBACKS:
                if nproc is None:
                    nproc = nodeenv.read_int(env, key)
            sky_rank = nodeenv.read_int(env, nodeenv.SKYPILOT_NODE_RANK)
        except nodeenv.NodeEnvError as err:
            raise ConfigError(str(err)) from None
        ips = [ip.strip() for ip in env.get(nodeenv.SKYPILOT_NODE_IPS, "").splitlines() if ip.strip()]
        cfg = cls(
            run_uri=e.run_uri,
            job=e.job,
            attempt=e.attempt or 0,
            nproc_per_node=max(1, nproc or 1),
            nnodes=max(1, e.nnodes or (len(ips) if ips else 1)),
            node_rank=sky_rank if sky_rank is not None else (e.node_rank or 0),
            master_addr=e.master_addr or (ips[0] if ips else None),
            master_port=e.master_port or DEFAULT_MASTER_PORT,
            price_per_hour=e.price_per_hour,
            budget_left_usd=e.budget_left_usd,
            deadline=e.deadline,
            node_timeout_seconds=e.node_timeout_seconds,
            restart_grace_seconds=e.restart_grace_seconds or DEFAULT_RESTART_GRACE_SECONDS,
            controller_lost_minutes=e.controller_lost_minutes,
            idle_minutes=e.idle_minutes,
            check_seconds=e.watchdog_seconds or DEFAULT_WATCHDOG_SECONDS,
            launched_at=e.launched_at,
            self_terminate=e.self_terminate,
            trainer_module=e.trainer_module or "trainer",
            trainer_cmd=e.trainer_cmd or None,
        )
        if e.stop_grace_seconds is not None:
            cfg.stop_grace_seconds = e.stop_grace_seconds
        if e.kill_grace_seconds is not None:
            cfg.kill_grace_seconds = e.kill_grace_seconds
        if cfg.check_seconds <= 0:
            raise ConfigError(f"{nodeenv.WATCHDOG_SECONDS} must be positive")
        if cfg.nnodes > 1 and not cfg.master_addr:
            raise ConfigError(f"{cfg.nnodes} nodes but no master address "
                              f"(set {nodeenv.SKYPILOT_NODE_IPS} or {nodeenv.MASTER_ADDR})")
        return cfg


def fetch_job(cfg: NodeConfig, tries: int = 5) -> str:
    """``<run-uri>/job.yaml`` (the controller writes it before launch) → a local temp file (its
    path). An object-store hiccup is retried; a job file that cannot be read is a ConfigError."""
    uri = runuri.join(cfg.run_uri, runuri.JOB_FILE)
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

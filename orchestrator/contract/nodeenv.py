"""The node environment: what a node is told at launch, defined once for both sides.

The controller (``orchestrator.run``), ``dtrun export`` and the providers write it; the node
bootstrap (``infra/``) reads it back. Everything a launch tells a node travels as ``DTRUN_*``
environment variables, so this module holds:

- the names (``RUN_URI = "DTRUN_RUN_URI"``, …), and those of the provider's own variables the
  node reads (``SKYPILOT_NODE_IPS``, ``RUNPOD_GPU_COUNT``, …);
- :class:`NodeEnv`, the typed record of the values; ``None`` means "not in the environment" (the
  node then applies its default: ``infra/node_config.py``);
- :func:`to_env` / :func:`from_env`, record ↔ ``dict[str, str]``; ``from_env(to_env(r)) == r``
  for values at the precision below;
- :func:`for_launch`, the one builder the controller and the export call, and
  :func:`budget_left_per_node`, the one computation of each node's share of the budget left;
- :func:`bootstrap_command`, how a node is started, and :func:`trainer_args`, the arguments the
  bootstrap gives the trainer.

One formatting for every number: money (price per hour, budget left) with six decimals (a
micro-dollar: fixed point, never an exponent, so ``$1,234,567`` stays exact where ``%g`` wrote
``1.23457e+06``); unix times with three (a millisecond); every other number in its shortest exact
form (``30`` for 30.0, all digits of 1/120). Standard library only: imports nothing of dtrun.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, fields
from typing import Mapping

# ---- the names ---------------------------------------------------------------------------------
# Written at launch (the controller, the export, the providers), read by the node bootstrap.
RUN_URI = "DTRUN_RUN_URI"
JOB = "DTRUN_JOB"
ATTEMPT = "DTRUN_ATTEMPT"
NPROC_PER_NODE = "DTRUN_NPROC_PER_NODE"
NNODES = "DTRUN_NNODES"
NODE_RANK = "DTRUN_NODE_RANK"
MASTER_ADDR = "DTRUN_MASTER_ADDR"
MASTER_PORT = "DTRUN_MASTER_PORT"
PRICE_PER_HOUR = "DTRUN_PRICE_PER_HOUR"
BUDGET_LEFT_USD = "DTRUN_BUDGET_LEFT_USD"
DEADLINE = "DTRUN_DEADLINE"
LAUNCHED_AT = "DTRUN_LAUNCHED_AT"
NODE_TIMEOUT_SECONDS = "DTRUN_NODE_TIMEOUT_SECONDS"
RESTART_GRACE_SECONDS = "DTRUN_RESTART_GRACE_SECONDS"
CONTROLLER_LOST_MINUTES = "DTRUN_CONTROLLER_LOST_MINUTES"
IDLE_MINUTES = "DTRUN_IDLE_MINUTES"
WATCHDOG_SECONDS = "DTRUN_WATCHDOG_SECONDS"
STOP_GRACE_SECONDS = "DTRUN_STOP_GRACE_SECONDS"
KILL_GRACE_SECONDS = "DTRUN_KILL_GRACE_SECONDS"
SELF_TERMINATE = "DTRUN_SELF_TERMINATE"
PIP_CACHE_DIR = "DTRUN_PIP_CACHE_DIR"
JOB_YAML = "DTRUN_JOB_YAML"
TRAINER_MODULE = "DTRUN_TRAINER_MODULE"   # tests: a fake trainer module under real torchrun
TRAINER_CMD = "DTRUN_TRAINER_CMD"         # tests: a shell-quoted argv replacing torchrun

# Node-side tunables, read where they are used (each has a default there).
NODE_REPORT_SECONDS = "DTRUN_NODE_REPORT_SECONDS"   # infra/node_report.py
NODE_DIR = "DTRUN_NODE_DIR"                         # infra/usercode: where a command's folders go
SYNC_SECONDS = "DTRUN_SYNC_SECONDS"                 # infra/usercode: checkpoint scans
HEARTBEAT_SECONDS = "DTRUN_HEARTBEAT_SECONDS"       # infra/usercode: progress.json rewrites
SETUP_PYTHON = "DTRUN_SETUP_PYTHON"                 # infra/node_setup (tests): the interpreter to set up
SETUP_DRY_RUN = "DTRUN_SETUP_DRY_RUN"               # infra/node_setup (tests): "1" decides, installs nothing

# What the node gives a ``command:`` job's own command (infra/usercode), besides RUN_URI, ATTEMPT.
CHECKPOINT_DIR = "DTRUN_CHECKPOINT_DIR"
RESUME_STEP = "DTRUN_RESUME_STEP"
CODE_DIR = "DTRUN_CODE_DIR"
CHECKPOINT_FORMAT = "DTRUN_CHECKPOINT_FORMAT"

# The provider's own variables the node falls back on.
SKYPILOT_NODE_RANK = "SKYPILOT_NODE_RANK"
SKYPILOT_NODE_IPS = "SKYPILOT_NODE_IPS"            # one IP per line, the head node first
SKYPILOT_NUM_GPUS_PER_NODE = "SKYPILOT_NUM_GPUS_PER_NODE"
GPU_COUNT_FALLBACKS = (SKYPILOT_NUM_GPUS_PER_NODE, "RUNPOD_GPU_COUNT", "GPU_COUNT")
"""Ranks per node when ``DTRUN_NPROC_PER_NODE`` is not set, in this order (then 1)."""

BOOTSTRAP = "infra/node_bootstrap.py"
"""The node bootstrap, relative to the project root the node runs in."""


class NodeEnvError(ValueError):
    """A node environment that cannot be read: a required variable missing, or not a number."""


# ---- the record --------------------------------------------------------------------------------
_MONEY, _TIME, _NUM, _INT, _STR, _TEXT, _ARGV = "money", "time", "num", "int", "str", "text", "argv"
# (_STR is read stripped; _TEXT as it is)


def _var(name: str, kind: str):
    return field(default=None, metadata={"env": name, "kind": kind})


@dataclass
class NodeEnv:
    """The values a launch gives a node. ``None``: not set (the node's default applies)."""

    run_uri: str = field(metadata={"env": RUN_URI, "kind": _STR})
    job: str = field(metadata={"env": JOB, "kind": _STR})
    attempt: int | None = _var(ATTEMPT, _INT)
    nproc_per_node: int | None = _var(NPROC_PER_NODE, _INT)
    nnodes: int | None = _var(NNODES, _INT)
    node_rank: int | None = _var(NODE_RANK, _INT)
    master_addr: str | None = _var(MASTER_ADDR, _STR)
    master_port: int | None = _var(MASTER_PORT, _INT)
    price_per_hour: float | None = _var(PRICE_PER_HOUR, _MONEY)
    """This node's price (every GPU of it), USD per hour."""
    budget_left_usd: float | None = _var(BUDGET_LEFT_USD, _MONEY)
    """This node's share of the job's budget left at launch (:func:`budget_left_per_node`)."""
    deadline: float | None = _var(DEADLINE, _TIME)
    """Unix time by which the node must have stopped."""
    launched_at: float | None = _var(LAUNCHED_AT, _TIME)
    """Unix time the instance was requested: provisioning counts against the node's budget."""
    node_timeout_seconds: float | None = _var(NODE_TIMEOUT_SECONDS, _NUM)
    """The provider ends the node this long after its start (Modal's sandbox timeout)."""
    restart_grace_seconds: float | None = _var(RESTART_GRACE_SECONDS, _NUM)
    controller_lost_minutes: float | None = _var(CONTROLLER_LOST_MINUTES, _NUM)
    idle_minutes: float | None = _var(IDLE_MINUTES, _NUM)
    watchdog_seconds: float | None = _var(WATCHDOG_SECONDS, _NUM)
    stop_grace_seconds: float | None = _var(STOP_GRACE_SECONDS, _NUM)
    kill_grace_seconds: float | None = _var(KILL_GRACE_SECONDS, _NUM)
    self_terminate: str | None = _var(SELF_TERMINATE, _STR)
    """A shell command that removes the node (remote nodes), run after the trainer exits."""
    pip_cache_dir: str | None = _var(PIP_CACHE_DIR, _STR)
    job_yaml: str | None = _var(JOB_YAML, _TEXT)
    """The resolved job spec, for a node started without dtrun (``dtrun export``)."""
    trainer_module: str | None = _var(TRAINER_MODULE, _STR)
    trainer_cmd: list[str] | None = _var(TRAINER_CMD, _ARGV)


NAMES: tuple[str, ...] = tuple(f.metadata["env"] for f in fields(NodeEnv))
"""Every variable :class:`NodeEnv` carries, in the record's order."""


def _number(v: float) -> str:
    """The shortest text that reads back as ``v`` (``30`` for 30.0)."""
    short = f"{v:g}"
    return short if float(short) == v else repr(float(v))


def _format(kind: str, v) -> str:
    if kind == _MONEY:
        return f"{v:.6f}"
    if kind == _TIME:
        return f"{v:.3f}"
    if kind == _NUM:
        return _number(float(v))
    if kind == _INT:
        return str(int(v))
    if kind == _ARGV:
        return shlex.join(v)
    return str(v)


def _parse(kind: str, name: str, raw: str):
    if kind in (_STR, _TEXT):
        return raw
    if kind == _ARGV:
        return shlex.split(raw)
    try:
        return int(raw) if kind == _INT else float(raw)
    except ValueError:
        what = "an integer" if kind == _INT else "a number"
        raise NodeEnvError(f"{name}={raw!r} is not {what}") from None


def to_env(rec: NodeEnv) -> dict[str, str]:
    """The environment for ``rec``: one variable per value that is set."""
    out: dict[str, str] = {}
    for f in fields(rec):
        v = getattr(rec, f.name)
        if v is not None:
            out[f.metadata["env"]] = _format(f.metadata["kind"], v)
    return out


def from_env(env: Mapping[str, str]) -> NodeEnv:
    """The record in ``env`` (other variables are ignored; empty ones count as unset).
    Raises NodeEnvError naming the variable when ``DTRUN_RUN_URI``/``DTRUN_JOB`` is missing or a
    number does not parse."""
    values = {}
    for f in fields(NodeEnv):
        name = f.metadata["env"]
        raw = env.get(name) or ""
        if raw.strip():
            kind = f.metadata["kind"]
            values[f.name] = _parse(kind, name, raw if kind == _TEXT else raw.strip())
    for req in ("run_uri", "job"):
        if req not in values:
            raise NodeEnvError(f"{RUN_URI if req == 'run_uri' else JOB} is not set")
    return NodeEnv(**values)


def read_int(env: Mapping[str, str], name: str) -> int | None:
    """One integer variable of ``env`` (a provider's own, e.g. ``SKYPILOT_NODE_RANK``): None when
    unset or empty, NodeEnvError naming it when it is not an integer."""
    raw = (env.get(name) or "").strip()
    return _parse(_INT, name, raw) if raw else None


# ---- what a launch writes ----------------------------------------------------------------------

def budget_left_per_node(max_usd: float | None, spent_usd: float, nodes: int) -> float | None:
    """Each node's share of the job's budget left (None without a budget): ``max(0, max_usd −
    spent) / nodes``. Every node guards its share alone, so together they stop within the budget."""
    if max_usd is None:
        return None
    return max(0.0, max_usd - spent_usd) / max(1, nodes)


def for_launch(*, run_uri: str, job: str, attempt: int, gpus_per_node: int, nodes: int,
               idle_minutes: float | None, price_per_hour: float | None = None,
               max_usd: float | None = None, spent_usd: float = 0.0, deadline: float | None = None,
               controller_lost_minutes: float | None = None, launched_at: float | None = None,
               pip_cache_dir: str | None = None, job_yaml: str | None = None) -> NodeEnv:
    """The record one launch gives each of its nodes: the job's spec values (``resources``,
    ``teardown``, ``budget.max_usd``), what was already spent (so ``DTRUN_BUDGET_LEFT_USD`` is the
    node's share of what is left), the node's price (``price_per_gpu_hour × gpus_per_node``), the
    attempt's deadline and the launch time. The controller and ``dtrun export`` both call this."""
    return NodeEnv(run_uri=run_uri, job=job, attempt=attempt, nproc_per_node=gpus_per_node, nnodes=nodes,
                   price_per_hour=price_per_hour, budget_left_usd=budget_left_per_node(max_usd, spent_usd, nodes),
                   deadline=deadline, launched_at=launched_at, idle_minutes=idle_minutes,
                   controller_lost_minutes=controller_lost_minutes, pip_cache_dir=pip_cache_dir or None,
                   job_yaml=job_yaml)


def bootstrap_command(python: str = "python", root: str | None = None) -> list[str]:
    """How a node starts: ``python infra/node_bootstrap.py`` (no arguments: everything is in the
    environment). ``root``: the project's absolute path, for a node on this machine."""
    return [python, f"{root.rstrip('/')}/{BOOTSTRAP}" if root else BOOTSTRAP]


def trainer_args(job_file: str, run_uri: str) -> list[str]:
    """The arguments the bootstrap appends to the trainer's (or a test's) command."""
    return ["--job", job_file, "--run-uri", run_uri]

"""Is a SkyPilot cloud usable from here? SkyPilot's own offline credential check, per cloud.

SkyPilot enables a cloud when its ``_check_compute_credentials`` passes, and it reads each
cloud's key from one file only — never from the variables other tools use:

* RunPod: ``~/.runpod/config.toml`` with ``api_key`` under ``[default]`` (what ``runpod config``
  writes), and the ``runpod`` package installed. ``RUNPOD_API_KEY`` is not read.
* Lambda: ``~/.lambda_cloud/lambda_keys`` with a line ``api_key = <key>``.
* Vast: ``~/.config/vastai/vast_api_key`` (what ``vastai set api-key`` writes), and the
  ``vastai_sdk`` package installed. ``VAST_API_KEY`` is not read.

SkyPilot's RunPod and Lambda checks then call the cloud's API to validate the key; dtrun runs
only the offline part (the dry run must not need the network, nor import ``sky``: it costs
seconds). This module mirrors those offline steps line for line; ``tests/providers`` runs each
case (no key, env-only key, file key, malformed file) against SkyPilot's real check to keep the
two in step. A key the cloud rejects is found at launch: SkyPilot then reports the cloud as not
enabled, which the adapter turns into an ``AuthError`` naming the same file.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

RUNPOD_FILE = "~/.runpod/config.toml"
LAMBDA_FILE = "~/.lambda_cloud/lambda_keys"
VAST_FILE = "~/.config/vastai/vast_api_key"

FILES = {"runpod": RUNPOD_FILE, "lambda": LAMBDA_FILE, "vast": VAST_FILE}
ENV_KEYS = {"runpod": ("RUNPOD_API_KEY",), "lambda": ("LAMBDA_API_KEY", "LAMBDA_CLOUD_API_KEY"),
            "vast": ("VAST_API_KEY",)}
HOW = {
    "runpod": f"run `pip install runpod && runpod config` (it writes api_key to {RUNPOD_FILE} under [default])",
    "lambda": f"write the line `api_key = <your key>` to {LAMBDA_FILE} (keys: https://cloud.lambdalabs.com/api-keys)",
    "vast": f"run `pip install vastai && vastai set api-key <your key>` (it writes {VAST_FILE})",
}


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _runpod() -> str | None:
    if not _has_module("runpod"):
        return "the runpod package is not installed (pip install 'skypilot[runpod]')"
    path = Path(RUNPOD_FILE).expanduser()
    if not path.exists():
        return f"{RUNPOD_FILE} does not exist"
    import tomllib

    try:
        with path.open("rb") as f:
            cfg = tomllib.load(f)
    except (TypeError, ValueError):
        return f"{RUNPOD_FILE} is not a valid TOML file"
    if "default" not in cfg:
        return f"{RUNPOD_FILE} is missing the [default] profile"
    if "api_key" not in cfg["default"]:
        return f"{RUNPOD_FILE} is missing api_key under [default]"
    return None


def _lambda() -> str | None:
    path = Path(LAMBDA_FILE).expanduser()
    if not path.exists():
        return f"{LAMBDA_FILE} does not exist"
    try:
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if " = " in ln]
    except (OSError, UnicodeDecodeError):
        return f"{LAMBDA_FILE} cannot be read"
    keys = {ln.split(" = ")[0]: ln.split(" = ")[1] for ln in lines}
    if "api_key" not in keys:
        return f"{LAMBDA_FILE} has no `api_key = <key>` line"
    return None


def _vast() -> str | None:
    if not _has_module("vastai_sdk"):
        return "the vastai_sdk package is not installed (pip install 'skypilot[vast]')"
    if not os.path.exists(os.path.expanduser(VAST_FILE)):
        return f"{VAST_FILE} does not exist"
    return None


_CHECKS = {"runpod": _runpod, "lambda": _lambda, "vast": _vast}


def problem(cloud: str) -> str | None:
    """What stops SkyPilot from enabling ``cloud`` (offline), or None when it would pass."""
    return _CHECKS[cloud]()


def message(cloud: str, why: str) -> str:
    """The one line a user reads: what is wrong, the file SkyPilot reads, and how to fix it."""
    env = [v for v in ENV_KEYS[cloud] if os.environ.get(v)]
    hint = ""
    if env:
        hint = (f"; {env[0]} is set, but SkyPilot does not read it: SkyPilot reads only "
                f"{FILES[cloud]}")
    return f"{cloud} is not usable through SkyPilot: {why}{hint}; to fix: {HOW[cloud]}"

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
    if not str(cfg["default"]["api_key"] or "").strip():
        return f"{RUNPOD_FILE} has an empty api_key"  # SkyPilot passes it; every API call then fails
    return None


def _lambda() -> str | None:
    path = Path(LAMBDA_FILE).expanduser()
    if not path.exists():
        return f"{LAMBDA_FILE} does not exist"
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if " = " in ln]
    except (OSError, UnicodeDecodeError):
        return f"{LAMBDA_FILE} cannot be read"
    # `api_key = ` (nothing after it) must not crash the check: partition, not split()[1]
    keys = {ln.partition(" = ")[0].strip(): ln.partition(" = ")[2].strip() for ln in lines}
    if "api_key" not in keys:
        return f"{LAMBDA_FILE} has no `api_key = <key>` line"
    if not keys["api_key"].strip():
        return f"{LAMBDA_FILE} has an empty api_key"
    return None


def _vast() -> str | None:
    if not _has_module("vastai_sdk"):
        return "the vastai_sdk package is not installed (pip install 'skypilot[vast]')"
    path = Path(VAST_FILE).expanduser()
    if not path.exists():
        return f"{VAST_FILE} does not exist"
    try:
        if not path.read_text(encoding="utf-8", errors="replace").strip():
            return f"{VAST_FILE} is empty"  # SkyPilot checks only that it exists
    except OSError:
        return f"{VAST_FILE} cannot be read"
    return None


_CHECKS = {"runpod": _runpod, "lambda": _lambda, "vast": _vast}


def problem(cloud: str) -> str | None:
    """What stops SkyPilot from enabling ``cloud`` (offline), or None when it would pass. Stricter
    than SkyPilot in one way: an empty key (file or value) is refused here, since every API call
    with it fails after SkyPilot enabled the cloud."""
    return _CHECKS[cloud]()


def read_key(cloud: str) -> str | None:
    """The key SkyPilot would use for ``cloud`` (for ``dtrun check --online``; never printed)."""
    if problem(cloud) is not None:
        return None
    path = Path(FILES[cloud]).expanduser()
    if cloud == "runpod":
        import tomllib

        with path.open("rb") as f:
            return str(tomllib.load(f)["default"]["api_key"]).strip()
    text = path.read_text(encoding="utf-8", errors="replace")
    if cloud == "lambda":
        for ln in text.splitlines():
            if " = " in ln and ln.partition(" = ")[0].strip() == "api_key":
                return ln.partition(" = ")[2].strip()
        return None
    return text.strip()


def message(cloud: str, why: str) -> str:
    """The one line a user reads: what is wrong, the file SkyPilot reads, and how to fix it."""
    env = [v for v in ENV_KEYS[cloud] if os.environ.get(v)]
    hint = ""
    if env:
        hint = (f"; {env[0]} is set, but SkyPilot does not read it: SkyPilot reads only "
                f"{FILES[cloud]}")
    return f"{cloud} is not usable through SkyPilot: {why}{hint}; to fix: {HOW[cloud]}"


# ---- online: does the cloud's API accept the key? (`dtrun check --online`) -------------------------

def endpoint(cloud: str) -> tuple[str, str, bytes | None]:
    """(URL, method, body) of a cheap authenticated call: RunPod's GraphQL ``myself`` (the base
    URL from ``RUNPOD_API_BASE_URL``, as the runpod SDK reads it), Lambda's instance list
    (``DTRUN_LAMBDA_API_URL`` overrides SkyPilot's fixed endpoint), Vast's current user
    (``VAST_URL``, as the vastai SDK reads it). Each sends the key as a bearer token."""
    if cloud == "runpod":
        base = os.environ.get("RUNPOD_API_BASE_URL") or "https://api.runpod.io"
        return f"{base.rstrip('/')}/graphql", "POST", b'{"query": "query { myself { id } }"}'
    if cloud == "lambda":
        base = os.environ.get("DTRUN_LAMBDA_API_URL") or "https://cloud.lambdalabs.com/api/v1"
        return f"{base.rstrip('/')}/instances", "GET", None
    base = os.environ.get("VAST_URL") or "https://console.vast.ai"
    return f"{base.rstrip('/')}/api/v0/users/current/", "GET", None


def online_problem(cloud: str, timeout: float) -> str | None:
    """Ask ``cloud``'s API whether the key is accepted (one request, ``timeout`` seconds): None
    when it is, else why not. The key is sent only in the Authorization header and never
    appears in what this returns."""
    import json
    import socket
    import urllib.error
    import urllib.request

    key = read_key(cloud)
    if not key:
        return problem(cloud) or "no key"
    url, method, body = endpoint(cloud)
    host = urllib.request.urlparse(url).netloc

    def masked(text: str) -> str:
        return text.replace(key, "<key>")

    req = urllib.request.Request(url, data=body, method=method, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json", "User-Agent": "dtrun-check"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - fixed https endpoints
            raw = r.read(65536)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return f"{host} rejected the key (HTTP {e.code}); to fix: {HOW[cloud]}"
        return f"{host} answered HTTP {e.code} {masked(str(e.reason))[:80]}"
    except (TimeoutError, socket.timeout):
        return f"no answer from {host} within {timeout:g} s"
    except urllib.error.URLError as e:
        if isinstance(e.reason, (TimeoutError, socket.timeout)):
            return f"no answer from {host} within {timeout:g} s"
        return f"cannot reach {host}: {masked(str(e.reason))[:120]}"
    except OSError as e:
        return f"cannot reach {host}: {masked(str(e))[:120]}"
    if cloud == "runpod":  # GraphQL answers 200 with "errors" for a key it does not know
        try:
            errors = json.loads(raw or b"{}").get("errors")
        except (ValueError, AttributeError):
            errors = None
        if errors:
            msg = errors[0].get("message", "") if isinstance(errors[0], dict) else str(errors[0])
            return f"{host} rejected the key ({masked(msg)[:120]}); to fix: {HOW[cloud]}"
    return None

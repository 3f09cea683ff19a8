"""dtrun node setup: install only what this node is missing, then dtrun itself (no dependencies).

Run once per node before the bootstrap, from the project directory the launch synced (SkyPilot
``setup``; the Modal image build): ``python infra/node_setup.py``. Standard library only, and it
never imports torch into its own process: the torch check runs in a child interpreter.

1. **torch** — ``python -c 'import torch; print(torch.__version__)'`` is compared with the pin in
   ``pyproject.toml`` (``torch==X.Y.Z``; a local build tag such as ``+cu128`` is ignored). A
   prebuilt image (``resources.image``, default: the official PyTorch image of the pin) or
   Lambda's VM PyTorch that matches is kept; otherwise the pinned torch is installed (the
   multi-GB download the prebuilt image exists to avoid). On a GPU node (``nvidia-smi`` answers)
   a CPU-only build (``+cpu``, or ``torch.version.cuda`` None) never counts as a match, and the
   build's CUDA is checked against the driver (:data:`MIN_DRIVER`): a driver too old for it is
   reported in the JSON line (``"driver_ok": false`` and why) — the trainer then refuses to start
   (exit 2) instead of training on CPU.
2. **the other dependencies** of ``pyproject.toml`` — each one whose distribution is not
   installed, or whose installed version does not satisfy the requirement (checked with
   ``packaging`` when pip ships it), is installed; the rest are left alone.
3. **dtrun** — ``pip install --no-deps -e .`` (seconds: nothing is resolved or downloaded).

Wheels are cached where the provider allows it: ``DTRUN_PIP_CACHE_DIR`` (a directory on a volume
that outlives the node) becomes pip's ``--cache-dir``; without it pip uses its default cache,
which lives as long as the node. Modal caches the built image itself.

Prints one JSON line: ``{"torch": <version found>, "torch_pin": ..., "installed": [...],
"kept": [...], "seconds": ...}``; exits non-zero when an install fails.

For tests: ``DTRUN_SETUP_DRY_RUN=1`` decides and prints without installing anything;
``DTRUN_SETUP_PYTHON`` is the interpreter to check and install into (default: this one).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script before dtrun is installed: the contract is stdlib-only
    sys.path.insert(0, str(ROOT))

from orchestrator.contract import nodeenv  # noqa: E402
_REQ_RE = re.compile(r"^\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$")


def dependencies(pyproject: Path) -> list[str]:
    """``[project] dependencies`` of pyproject.toml (tomllib on 3.11+, a small parser before)."""
    text = pyproject.read_text()
    try:
        import tomllib

        return list(tomllib.loads(text)["project"]["dependencies"])
    except ImportError:  # Python 3.10: the list is plain strings, one per line
        m = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
        return re.findall(r'"([^"]+)"', m.group(1)) if m else []


def split(req: str) -> tuple[str, str]:
    """(distribution name, version specifier) of a requirement string."""
    m = _REQ_RE.match(req.split(";")[0])
    if not m:
        return req.strip(), ""
    return m.group(1), m.group(3).strip()


def torch_pin(deps: list[str]) -> str | None:
    for d in deps:
        name, spec = split(d)
        if name.lower() == "torch" and spec.startswith("=="):
            return spec[2:].strip()
    return None


def _torch_says(python: str, expr: str) -> str | None:
    """``print(<expr>)`` after ``import torch`` in ``python`` (a child process): its last line, or
    None when torch does not import."""
    try:
        out = subprocess.run([python, "-c", f"import torch; print({expr})"],
                             capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None


def installed_torch(python: str) -> str | None:
    """``torch.__version__`` in ``python``, or None when it does not import."""
    return _torch_says(python, "torch.__version__")


def torch_matches(found: str | None, pin: str | None, gpu_node: bool = False) -> bool:
    if found is None:
        return False
    if gpu_node and "+cpu" in found:
        return False  # a CPU wheel on a GPU node would train on CPU: replace it
    if pin is None:
        return True
    return found.split("+")[0] == pin


MIN_DRIVER = {12: "525.60.13", 13: "580.65.06"}
"""Oldest Linux driver for each CUDA major version (NVIDIA's CUDA toolkit release notes, "CUDA
Toolkit and Corresponding Driver Versions", minor-version compatibility: any 12.x runs on ≥ 525.60.13,
13.x on ≥ 580.65.06). Not checked on a GPU here."""


def driver_version() -> str | None:
    """The NVIDIA driver version (``nvidia-smi``), or None on a node without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def torch_cuda(python: str) -> str | None:
    """``torch.version.cuda`` in ``python`` (None: a CPU build, or torch does not import)."""
    v = _torch_says(python, "torch.version.cuda")
    return None if v in (None, "None") else v


def driver_problem(cuda: str | None, driver: str | None) -> str | None:
    """Why ``driver`` cannot run a torch built for CUDA ``cuda`` (None: it can, or unknown)."""
    if driver is None:
        return None
    if cuda is None:
        return f"torch is a CPU-only build on a GPU node (driver {driver})"
    try:
        major = int(cuda.split(".")[0])
        have = tuple(int(x) for x in driver.split("."))
    except ValueError:
        return None
    need = MIN_DRIVER.get(major)
    if need is None or have >= tuple(int(x) for x in need.split(".")):
        return None
    return (f"torch is built for CUDA {cuda}, which needs NVIDIA driver ≥ {need}; this node "
            f"has {driver} (use an image whose torch matches the driver, e.g. a cu12x wheel)")


def satisfied(req: str, python: str) -> bool:
    """Is the requirement's distribution installed (in this interpreter) in a satisfying version?"""
    name, spec = split(req)
    if python != sys.executable:  # another interpreter: ask it
        code = f"import importlib.metadata as m; print(m.version({name!r}))"
        out = subprocess.run([python, "-c", code], capture_output=True, text=True)
        if out.returncode != 0:
            return False
        version = out.stdout.strip()
    else:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            return False
    if not spec:
        return True
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        try:
            from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
        except ImportError:
            return True  # installed; no way to compare versions here: keep it
    return version in SpecifierSet(spec)


def pip(python: str, args: list[str]) -> None:
    cmd = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    cache = os.environ.get(nodeenv.PIP_CACHE_DIR)
    if cache:
        cmd += ["--cache-dir", cache]
    subprocess.run(cmd + args, check=True)


def plan(root: Path = ROOT, python: str | None = None) -> dict:
    """What this node has and what it needs: no side effects."""
    python = python or os.environ.get(nodeenv.SETUP_PYTHON) or sys.executable
    deps = dependencies(root / "pyproject.toml")
    pin = torch_pin(deps)
    found = installed_torch(python)
    driver = driver_version()
    install, kept = [], []
    if torch_matches(found, pin, gpu_node=driver is not None):
        kept.append(f"torch=={found}")
    else:
        install.append(f"torch=={pin}" if pin else "torch")
    for d in deps:
        if split(d)[0].lower() == "torch":
            continue
        (kept if satisfied(d, python) else install).append(d)
    return {"python": python, "torch": found, "torch_pin": pin, "install": install, "kept": kept, "driver": driver}


def main() -> int:
    t0 = time.monotonic()
    p = plan()
    dry = os.environ.get(nodeenv.SETUP_DRY_RUN) == "1"
    try:
        if not dry:
            if p["install"]:
                pip(p["python"], p["install"])
            pip(p["python"], ["--no-deps", "-e", str(ROOT)])
    except subprocess.CalledProcessError as e:
        print(json.dumps({"error": f"pip failed ({e.returncode})", **p}), flush=True)
        return 1
    rec = {"torch": p["torch"], "torch_pin": p["torch_pin"], "installed": p["install"], "kept": p["kept"],
           "dry_run": dry, "seconds": round(time.monotonic() - t0, 2), "driver": p["driver"]}
    if p["driver"] is not None:  # after any install: the torch that will run
        cuda = torch_cuda(p["python"])
        why = driver_problem(cuda, p["driver"])
        rec.update(torch_cuda=cuda, driver_ok=why is None, **({"driver_problem": why} if why else {}))
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

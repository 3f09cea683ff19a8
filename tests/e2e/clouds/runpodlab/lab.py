"""Start, drive and stop the RunPod lab (see ``__main__`` for the CLI).

``start``: checks root and namespaces (one line why not), builds the shared runtime cache
(:mod:`tests.e2e.clouds.lambdalab.runtime`) when missing and, beside it, the wheels the RunPod
runtime adds (``runpod`` and its dependencies: SkyPilot installs its wheel as
``[runpod, remote]`` on the node), makes the bridge ``dtrp0`` (10.78.0.1/24), writes the lab
HOME (``~/.runpod/config.toml``, the SkyPilot RunPod catalog with the lab's spot prices) and
starts the GraphQL emulator on 127.0.0.1. No plugin: the runpod SDK reads
``RUNPOD_API_BASE_URL`` on every call, so the SkyPilot API server only needs it in its
environment. ``stop`` removes everything, also what a crashed lab left: every ``dtrp-*`` netns
and its processes, the bridge, the emulator, every process whose ``HOME`` is the lab HOME.

The lab's prices: the US rows of the project's SkyPilot RunPod catalog, with a spot price of
0.6 × on-demand (the catalog's SkyPilot bids: ``bid_per_gpu``) and a minimum bid of 0.5 ×.
"""

from __future__ import annotations

import csv
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.e2e.clouds.lambdalab import lab as llab
from tests.e2e.clouds.lambdalab import runtime
from tests.e2e.clouds.runpodlab import pod as podlib

LAB_DIR = Path(os.environ.get("DTRUN_RUNPOD_LAB_DIR", "/var/lib/dtrun-lab/runpod"))
PORT = int(os.environ.get("DTRUN_RUNPOD_LAB_PORT", "8788"))
REPO = Path(__file__).resolve().parents[4]
REAL_CATALOG = REPO / "tests" / "fakes" / "data" / "skypilot_catalogs" / "v8"
REGIONS = ("US",)
SPOT_FRACTION = 0.6
# One resolve of what the RunPod node installs (SkyPilot's wheel as [runpod, remote], beside the
# runtime's pins): runpod alone resolves pycares 5, which skypilot[runpod] 0.14.1 refuses (<5).
RUNPOD_REQS = [r.replace(runtime.SKY, "skypilot[runpod,remote]==0.14.1") for r in runtime.RUNTIME_REQS] + ["runpod==1.10.1"]
RUNPOD_WHEELS = runtime.CACHE / "runpod" / "wheelhouse"


def home() -> Path:
    return LAB_DIR / "home"


def endpoint() -> str:
    return f"http://127.0.0.1:{PORT}"


API_SERVER_PORT = 46590  # not SkyPilot's default 46580


def env() -> dict[str, str]:
    """What a process that drives SkyPilot against the lab needs in its environment."""
    # Its own SkyPilot API server port (SkyPilot's client and server both honor the variable): a server
    # another lab left on the default 46580 (the Lambda lab's, with its HOME and without
    # RUNPOD_API_BASE_URL, still up while the same pytest session runs on) is never reused here.
    return {"HOME": str(home()), "RUNPOD_API_BASE_URL": endpoint(), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "SKYPILOT_API_SERVER_LOCAL_PORT": str(API_SERVER_PORT), "DTRUN_LAB_HOST_IP": podlib.HOST_IP}


def preflight() -> str | None:
    why = llab.preflight()
    return why.replace("the Lambda lab", "the RunPod lab") if why else None


def runpod_wheels(log=print) -> None:
    wheels(RUNPOD_REQS, RUNPOD_WHEELS, "runpod", log=log)


def wheels(reqs: list[str], dest: Path, what: str, log=print) -> None:
    """One resolve of ``reqs`` into the wheelhouse ``dest`` (sdists built), once per requirement set."""
    stamp = dest / "STAMP"
    if stamp.is_file() and stamp.read_text().strip() == json.dumps(reqs):
        return
    t0 = time.monotonic()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(dest), *reqs], check=True)
    for sdist in list(dest.glob("*.tar.gz")) + list(dest.glob("*.zip")):  # gpustat: an sdist only
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), str(sdist)],
                       check=True)
        sdist.unlink()
    stamp.write_text(json.dumps(reqs))
    log(f"{what} wheels in {time.monotonic() - t0:.1f} s at {dest}")


def write_home() -> None:
    h = home()
    (h / ".runpod").mkdir(parents=True, exist_ok=True)
    cfg = h / ".runpod" / "config.toml"
    if not cfg.exists():
        cfg.write_text(f'[default]\napi_key = "lab-{secrets.token_hex(12)}"\n')
        cfg.chmod(0o600)
    cat = h / ".sky" / "catalogs" / "v8"
    (cat / "runpod").mkdir(parents=True, exist_ok=True)
    (cat / "common").mkdir(parents=True, exist_ok=True)
    shutil.copy(REAL_CATALOG / "common" / "accelerators.csv", cat / "common" / "accelerators.csv")
    with open(REAL_CATALOG / "runpod" / "vms.csv", newline="") as src, \
            open(cat / "runpod" / "vms.csv", "w", newline="") as dst:
        reader = csv.DictReader(src)
        writer = csv.DictWriter(dst, fieldnames=reader.fieldnames)
        writer.writeheader()
        for row in reader:
            if row["Region"] in REGIONS:
                row["SpotPrice"] = f"{float(row['Price']) * SPOT_FRACTION:.4f}"
                writer.writerow(row)


def api_key() -> str:
    import tomllib

    return tomllib.loads((home() / ".runpod" / "config.toml").read_text())["default"]["api_key"]


def call(what: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{endpoint()}/_lab/{what}", data=data, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}") | {"http_status": e.code}


def running() -> bool:
    try:
        call("status", timeout=2)
        return True
    except OSError:
        return False


def start(log=print) -> dict[str, str]:
    why = preflight()
    if why:
        raise SystemExit(why)
    t0 = time.monotonic()
    info = runtime.build(log=log)
    runpod_wheels(log=log)
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    write_home()
    podlib.bridge_up()
    if not running():
        with open(LAB_DIR / "api.out", "ab") as out:
            p = subprocess.Popen([sys.executable, "-m", "tests.e2e.clouds.runpodlab", "serve"], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        (LAB_DIR / "api.pid").write_text(str(p.pid))
        for _ in range(200):
            if running():
                break
            if p.poll() is not None:
                raise SystemExit(f"runpod lab: the API emulator exited ({p.returncode}); see {LAB_DIR / 'api.out'}")
            time.sleep(0.1)
    log(f"runpod lab up in {time.monotonic() - t0:.1f} s (runtime cache: {info})")
    return env()


def serve() -> None:
    from tests.e2e.clouds.runpodlab import api

    cloud = api.Cloud(LAB_DIR, home() / ".sky" / "catalogs" / "v8" / "runpod" / "vms.csv", api_key())
    signal.signal(signal.SIGTERM, lambda *_: (cloud.shutdown(), os._exit(0)))
    api.serve(cloud, "127.0.0.1", PORT)


def _pidfile() -> int | None:
    try:
        return int((LAB_DIR / "api.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def leftovers() -> dict[str, list]:
    """What the lab (or a run against it) left on the machine."""
    links = llab.node.sh("ip -o link show", check=False).stdout.splitlines()
    pid = _pidfile()
    return {"netns": podlib.all_netns(),
            "bridge": [podlib.BRIDGE] if llab.node.sh(f"ip link show {podlib.BRIDGE}", check=False).returncode == 0 else [],
            "veth": [l.split(":")[1].strip().split("@")[0] for l in links
                     if l.split(":")[1].strip().startswith(podlib.VETH_PREFIX)],
            "processes": llab._procs_with_home(str(home())) + ([pid] if pid and llab._alive(pid) else []),
            "mounts": [l.split()[1] for l in Path("/proc/self/mounts").read_text().splitlines()
                       if "dtrp" in l or str(LAB_DIR) in l]}


def stop(log=print) -> dict[str, list]:
    """Remove everything the lab made; idempotent, works after a crash."""
    if running():
        try:
            call("shutdown", {}, timeout=60)
        except OSError:
            pass
    pid = _pidfile()
    if pid and llab._alive(pid):
        os.kill(pid, signal.SIGKILL)
    for ns in podlib.all_netns():
        podlib.down(LAB_DIR, int(ns[len(podlib.NETNS_PREFIX):]))
    llab.end_processes_with_home(str(home()))  # SkyPilot's API server, executors, ssh masters
    for veth in leftovers()["veth"]:
        llab.node.sh(f"ip link del {veth}", check=False)
    podlib.bridge_down()
    shutil.rmtree(LAB_DIR, ignore_errors=True)
    left = leftovers()
    log(f"runpod lab stopped; left: {left}")
    return left

"""Start, drive and stop the Vast lab (see ``__main__`` for the CLI).

``start``: checks root and namespaces (one line why not), builds the shared runtime cache
(:mod:`tests.e2e.clouds.lambdalab.runtime`) when missing and, beside it, ``vast/wheelhouse``
(``vastai`` and its dependencies: SkyPilot installs its wheel on the node as ``[vast, remote]``),
makes the bridge ``dtvs0`` (10.79.0.1/24), writes the lab HOME (``~/.config/vastai/vast_api_key``,
the file ``sky check vast`` looks for, and the SkyPilot Vast catalog) and starts the REST
emulator on 127.0.0.1. No plugin: the vastai SDK reads ``VAST_URL`` at import, so every process
that imports it (SkyPilot's API server above all) must be started with :func:`env`. ``stop``
removes what this lab made, also after a crash: every ``dtvs-*`` netns and its processes, its
veths, the bridge, the emulator, every process whose ``HOME`` is this lab's HOME — never another
lab's (Lambda ``dtlab-*``, RunPod ``dtrp-*``).

Not emulated here: a SkyPilot config (``~/.sky/config.yaml``) — what a test or dtrun puts in
SkyPilot's config is theirs; the market's offers come from the catalog (see :mod:`api`).
"""

from __future__ import annotations

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
from tests.e2e.clouds.runpodlab import lab as rlab
from tests.e2e.clouds.vastlab import machine

LAB_DIR = Path(os.environ.get("DTRUN_VAST_LAB_DIR", "/var/lib/dtrun-lab/vast"))
PORT = int(os.environ.get("DTRUN_VAST_LAB_PORT", "8789"))
API_SERVER_PORT = 46600  # the Lambda lab's SkyPilot API server is on 46580, the RunPod lab's on 46590
REPO = Path(__file__).resolve().parents[4]
REAL_CATALOG = REPO / "tests" / "fakes" / "data" / "skypilot_catalogs" / "v8"
VAST_REQS = ([r.replace(runtime.SKY, "skypilot[vast,remote]==0.14.1") for r in runtime.RUNTIME_REQS]
             + ["vastai-sdk==1.9.1", "vastai==1.9.1"])
VAST_WHEELS = runtime.CACHE / "vast" / "wheelhouse"


def home() -> Path:
    return LAB_DIR / "home"


def endpoint() -> str:
    return f"http://127.0.0.1:{PORT}"


def env() -> dict[str, str]:
    """What a process that drives SkyPilot against the lab needs in its environment."""
    return {"HOME": str(home()), "VAST_URL": endpoint(), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
            "SKYPILOT_API_SERVER_LOCAL_PORT": str(API_SERVER_PORT), "DTRUN_LAB_HOST_IP": machine.NET.host_ip}


def preflight() -> str | None:
    why = llab.preflight()
    return why.replace("the Lambda lab", "the Vast lab") if why else None


def write_home() -> None:
    h = home()
    keyfile = h / ".config" / "vastai" / "vast_api_key"
    keyfile.parent.mkdir(parents=True, exist_ok=True)
    if not keyfile.exists():
        keyfile.write_text(f"lab{secrets.token_hex(16)}\n")
        keyfile.chmod(0o600)
    cat = h / ".sky" / "catalogs" / "v8"
    (cat / "vast").mkdir(parents=True, exist_ok=True)
    (cat / "common").mkdir(parents=True, exist_ok=True)
    shutil.copy(REAL_CATALOG / "common" / "accelerators.csv", cat / "common" / "accelerators.csv")
    shutil.copy(REAL_CATALOG / "vast" / "vms.csv", cat / "vast" / "vms.csv")


def api_key() -> str:
    return (home() / ".config" / "vastai" / "vast_api_key").read_text().strip()


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
    rlab.wheels(VAST_REQS, VAST_WHEELS, "vast", log=log)
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    write_home()
    machine.bridge_up()
    if not running():
        with open(LAB_DIR / "api.out", "ab") as out:
            p = subprocess.Popen([sys.executable, "-m", "tests.e2e.clouds.vastlab", "serve"], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        (LAB_DIR / "api.pid").write_text(str(p.pid))
        for _ in range(200):
            if running():
                break
            if p.poll() is not None:
                raise SystemExit(f"vast lab: the API emulator exited ({p.returncode}); see {LAB_DIR / 'api.out'}")
            time.sleep(0.1)
    log(f"vast lab up in {time.monotonic() - t0:.1f} s (runtime cache: {info})")
    return env()


def serve() -> None:
    from tests.e2e.clouds.vastlab import api

    cloud = api.Cloud(LAB_DIR, home() / ".sky" / "catalogs" / "v8" / "vast" / "vms.csv", api_key())
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
    net = machine.NET
    return {"netns": machine.all_netns(),
            "bridge": [net.bridge] if llab.node.sh(f"ip link show {net.bridge}", check=False).returncode == 0 else [],
            "veth": [l.split(":")[1].strip().split("@")[0] for l in links
                     if l.split(":")[1].strip().startswith(net.veth_prefix)],
            "processes": llab._procs_with_home(str(home())) + ([pid] if pid and llab._alive(pid) else []),
            "mounts": [l.split()[1] for l in Path("/proc/self/mounts").read_text().splitlines()
                       if "dtvs" in l or str(LAB_DIR) in l]}


def stop(log=print) -> dict[str, list]:
    """Remove everything this lab made (its own prefixes only); idempotent, works after a crash."""
    if running():
        try:
            call("shutdown", {}, timeout=60)
        except OSError:
            pass
    pid = _pidfile()
    if pid and llab._alive(pid):
        os.kill(pid, signal.SIGKILL)
    for ns in machine.all_netns():
        machine.down(LAB_DIR, int(ns[len(machine.NET.netns_prefix):]))
    llab.end_processes_with_home(str(home()))  # SkyPilot's API server, executors, ssh masters
    for veth in leftovers()["veth"]:
        llab.node.sh(f"ip link del {veth}", check=False)
    machine.bridge_down()
    shutil.rmtree(LAB_DIR, ignore_errors=True)
    left = leftovers()
    log(f"vast lab stopped; left: {left}")
    return left

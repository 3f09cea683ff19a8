"""Start, drive and stop the lab (see ``__main__`` for the CLI).

``start``: checks root and namespaces (one line why not, exit 3), builds the runtime cache when
missing, makes the bridge ``dtlab0`` (10.77.0.1/24), writes the lab HOME (Lambda credentials,
the SkyPilot catalog, the plugin that points ``lambda_utils.API_ENDPOINT`` at the emulator) and
starts the emulated API on 127.0.0.1. ``stop`` removes everything, also what a crashed lab left:
every ``dtlab-*`` netns and its processes, the bridge, the API server, and every process whose
``HOME`` is the lab HOME (SkyPilot's API server and its executors, ssh control masters).
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
import urllib.request
from pathlib import Path

from tests.e2e.clouds.lambdalab import node, runtime

LAB_DIR = Path(os.environ.get("DTRUN_LAB_DIR", "/var/lib/dtrun-lab/lab"))
PORT = int(os.environ.get("DTRUN_LAB_PORT", "8787"))
REPO = Path(__file__).resolve().parents[4]
REAL_CATALOG = REPO / "tests" / "fakes" / "data" / "skypilot_catalogs" / "v8"
REGIONS = ("us-east-1", "us-west-1", "us-south-1")
"""The lab's regions (the real catalog's rows for these; cheapest first is SkyPilot's business)."""
EXIT_CANNOT = 3

PLUGIN = '''"""dtrun lab: SkyPilot server plugin that points Lambda's API at the lab's emulator."""
from sky.server import plugins


class LabLambdaEndpoint(plugins.BasePlugin):
    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def install(self, extension_context):
        from sky.provision.lambda_cloud import lambda_utils
        lambda_utils.API_ENDPOINT = self.endpoint
'''


def home() -> Path:
    return LAB_DIR / "home"


def endpoint() -> str:
    return f"http://127.0.0.1:{PORT}/api/v1"


def env() -> dict[str, str]:
    """What a process that drives SkyPilot against the lab needs in its environment."""
    plug = str(home() / ".dtrun-lab-plugin")
    pp = os.environ.get("PYTHONPATH", "")
    return {"HOME": str(home()), "PYTHONPATH": f"{plug}:{pp}" if pp else plug,
            "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "DTRUN_LAB_HOST_IP": node.HOST_IP,
            "DTRUN_LAB_ENDPOINT": endpoint()}


def preflight() -> str | None:
    """Why the lab cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the Lambda lab needs root (network, mount and PID namespaces, a bridge)"
    for tool in ("ip", "unshare", "tini", "sshd", "rsync", "sudo", "ssh"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return (f"the Lambda lab needs `{tool}` (apt-get install -y openssh-server rsync sudo tini; "
                    f"`make e2e` runs tests/e2e/clouds/lambdalab/setup-host.sh)")
    probe = subprocess.run(["unshare", "--mount", "--net", "--pid", "--uts", "--fork", "--mount-proc", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else probe.returncode}"
    return None


def write_home() -> None:
    h = home()
    (h / ".lambda_cloud").mkdir(parents=True, exist_ok=True)
    keyfile = h / ".lambda_cloud" / "lambda_keys"
    if not keyfile.exists():
        keyfile.write_text(f"api_key = lab-{secrets.token_hex(12)}\n")
        keyfile.chmod(0o600)
    cat = h / ".sky" / "catalogs" / "v8"
    (cat / "lambda").mkdir(parents=True, exist_ok=True)
    (cat / "common").mkdir(parents=True, exist_ok=True)
    shutil.copy(REAL_CATALOG / "common" / "accelerators.csv", cat / "common" / "accelerators.csv")
    with open(REAL_CATALOG / "lambda" / "vms.csv", newline="") as src, open(cat / "lambda" / "vms.csv", "w", newline="") as dst:
        reader = csv.DictReader(src)
        writer = csv.DictWriter(dst, fieldnames=reader.fieldnames)
        writer.writeheader()
        for row in reader:
            if row["Region"] in REGIONS:
                writer.writerow(row)
    plug = h / ".dtrun-lab-plugin"
    plug.mkdir(exist_ok=True)
    (plug / "dtrun_lab_plugin.py").write_text(PLUGIN)
    (h / ".sky" / "plugins.yaml").write_text(
        "plugins:\n  - class: dtrun_lab_plugin.LabLambdaEndpoint\n"
        f"    parameters:\n      endpoint: {endpoint()}\n")


def api_key() -> str:
    for line in (home() / ".lambda_cloud" / "lambda_keys").read_text().splitlines():
        if " = " in line and line.split(" = ")[0] == "api_key":
            return line.split(" = ")[1].strip()
    raise RuntimeError("lab: no api_key in the lab's lambda_keys")


def call(what: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/_lab/{what}", data=data,
                                 method="POST" if body is not None else "GET")
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
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    write_home()
    node.bridge_up()
    if not running():
        with open(LAB_DIR / "api.out", "ab") as out:
            p = subprocess.Popen([sys.executable, "-m", "tests.e2e.clouds.lambdalab", "serve"], cwd=REPO,
                                 env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        (LAB_DIR / "api.pid").write_text(str(p.pid))
        for _ in range(100):
            if running():
                break
            if p.poll() is not None:
                raise SystemExit(f"lab: the API emulator exited ({p.returncode}); see {LAB_DIR / 'api.out'}")
            time.sleep(0.1)
    log(f"lab up in {time.monotonic() - t0:.1f} s (runtime cache: {info})")
    return env()


def serve() -> None:
    from tests.e2e.clouds.lambdalab import api

    cloud = api.Cloud(LAB_DIR, home() / ".sky" / "catalogs" / "v8" / "lambda" / "vms.csv", api_key())
    signal.signal(signal.SIGTERM, lambda *_: (cloud.shutdown(), os._exit(0)))
    api.serve(cloud, "127.0.0.1", PORT)


def end_processes_with_home(h: str) -> list[int]:
    """SIGKILL every process whose HOME is ``h`` (its process group when it leads one), again until
    none is left (5 s at most); returns those still there."""
    for _ in range(50):
        procs = _procs_with_home(h)
        if not procs:
            return []
        for p in procs:
            try:
                os.killpg(p, signal.SIGKILL) if os.getpgid(p) == p else os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)
    return _procs_with_home(h)


def _procs_with_home(h: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            envb = (d / "environ").read_bytes()
        except OSError:
            continue
        if f"HOME={h}".encode() in envb.split(b"\0"):
            out.append(int(d.name))
    return out


def leftovers() -> dict[str, list]:
    """What the lab (or a run against it) left on the machine."""
    return {"netns": node.all_netns(),
            "bridge": [node.BRIDGE] if node.sh(f"ip link show {node.BRIDGE}", check=False).returncode == 0 else [],
            "veth": [l.split(":")[1].strip().split("@")[0] for l in node.sh("ip -o link show", check=False).stdout.splitlines()
                     if l.split(":")[1].strip().startswith(node.VETH_PREFIX)],
            "processes": _procs_with_home(str(home())) + ([int(p) for p in [_pidfile()] if p and _alive(int(p))]),
            "mounts": [l.split()[1] for l in Path("/proc/self/mounts").read_text().splitlines()
                       if "dtlab" in l or "/run/netns/dtlab" in l]}


def _pidfile() -> str | None:
    try:
        return (LAB_DIR / "api.pid").read_text().strip()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def stop(log=print) -> dict[str, list]:
    """Remove everything the lab made; idempotent, works after a crash."""
    if running():
        try:
            call("shutdown", {}, timeout=60)
        except OSError:
            pass
    pid = _pidfile()
    if pid and _alive(int(pid)):
        os.kill(int(pid), signal.SIGKILL)
    for ns in node.all_netns():
        node.down(int(ns[len(node.NETNS_PREFIX):]))
    end_processes_with_home(str(home()))  # SkyPilot's API server, executors, ssh masters
    for veth in leftovers()["veth"]:
        node.sh(f"ip link del {veth}", check=False)
    node.bridge_down()
    shutil.rmtree(LAB_DIR, ignore_errors=True)
    left = leftovers()
    log(f"lab stopped; left: {left}")
    return left

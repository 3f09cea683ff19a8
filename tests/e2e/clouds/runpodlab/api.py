"""RunPod's GraphQL API, emulated at ``POST /graphql`` (``RUNPOD_API_BASE_URL`` points the runpod
SDK here): every document SkyPilot 0.14.1 sends, parsed, validated and executed by graphql-core
against :mod:`schema`, backed by :mod:`pod` machines. Plus ``/_lab/*`` admin routes for the CLI.

Emulated:
* ``myself { pubKey networkVolumes pods {...} podTemplates {...} }`` and ``updateUserSettings``
  (the account key; RunPod puts it in a pod's ``PUBLIC_KEY``);
* ``gpuTypes(input:{id})`` with ``memoryInGb`` and ``lowestPrice{minimumBidPrice
  uninterruptablePrice}`` from the lab's SkyPilot catalog (the ``vms.csv`` dtrun reads);
* ``podFindAndDeployOnDemand`` and ``podRentInterruptable``: placed in the first zone of
  ``dataCenterId`` (a comma list, as SkyPilot sends every zone of the region) that sells the
  instance type and has capacity, else RunPod's "no longer any instances available" error; a
  ``bidPerGpu`` below the GPU's current ``minimumBidPrice`` is refused; the pod is ``RUNNING`` at
  once with ``runtime: null`` until its main process runs (then ``runtime.ports``: the public SSH
  port ``10.78.0.1:20000+n`` with ``isIpPublic: true``, and the pod's private address);
* ``podTerminate``: the pod stops and is gone from ``myself.pods`` when the call returns;
* preemption (lab route): an interruptible pod is taken back: killed, ``desiredStatus:
  EXITED``, ``runtime: null``, then gone from the list after ``gone_after`` seconds;
* the bill, per second (RunPod bills compute and storage by the second): ``costPerHr`` (on-demand:
  the catalog price; interruptible: the bid × GPUs) while running, and the container disk at
  $0.10/GB-month while running (an exited pod's container disk is gone; no volume is ever made).

Not emulated: ``podStop``/``podResume`` (SkyPilot's RunPod ``stop_instances`` raises
NotImplementedError), network volumes and the REST API, registry auth and templates
(``podTemplates`` is always empty), CPU pods (``deployCpuPod`` refused), rate limits, RunPod's
real messages beyond the no-capacity one (the low-bid text is the lab's), multi-node.
"""

from __future__ import annotations

import csv
import json
import secrets
import string
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import graphql

from tests.e2e.clouds.runpodlab import pod as podlib
from tests.e2e.clouds.runpodlab.schema import SDL

NO_CAPACITY = ("There are no longer any instances available with the requested specifications. "
               "Please refresh and try again.")
STORAGE_USD_PER_GB_MONTH = 0.10
HOURS_PER_MONTH = 730
MIN_BID_FRACTION = 0.5
"""The lab's minimum bid per GPU-hour: this fraction of the on-demand price (its spot price is 0.6)."""


def read_catalog(path: Path) -> dict[str, dict]:
    """vms.csv → {instance type: {gpu, gpus, vcpus, memory, price, spot, zones}}."""
    out: dict[str, dict] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            t = out.setdefault(row["InstanceType"], {
                "gpu": row["AcceleratorName"], "gpus": int(float(row["AcceleratorCount"])),
                "vcpus": int(float(row["vCPUs"])), "memory": int(float(row["MemoryGiB"])),
                "price": float(row["Price"]), "spot": float(row["SpotPrice"]), "zones": {}})
            t["zones"][row["AvailabilityZone"]] = row["Region"]
    return out


def _gpu_ids() -> dict[str, str]:
    from sky.provision.runpod.utils import GPU_NAME_MAP  # SkyPilot's names → RunPod's gpuTypeId

    return GPU_NAME_MAP


class Cloud:
    def __init__(self, lab_dir: Path, catalog: Path, api_key: str, gone_after: float = 120.0):
        self.lab_dir = lab_dir
        self.catalog = read_catalog(catalog)
        self.gpu_id = _gpu_ids()
        self.api_key = api_key
        self.gone_after = gone_after
        self.lock = threading.RLock()
        self.pods: dict[str, dict] = {}
        self.pub_key: str | None = None
        self.no_capacity: set[str] = set()
        self.bill: list[dict] = []
        self.next_n = 10
        self.schema = graphql.build_schema(SDL)
        (lab_dir / "nodes").mkdir(parents=True, exist_ok=True)

    # ---- GraphQL resolvers (root fields) ----------------------------------------------------------
    def myself(self, info) -> dict:
        with self.lock:
            pods = [self._public(p) for p in self.pods.values()]
        return {"id": "lab-user", "pubKey": self.pub_key, "networkVolumes": [], "pods": pods, "podTemplates": []}

    def updateUserSettings(self, info, input=None) -> dict:  # noqa: N802 - GraphQL's name
        if input and "pubKey" in input:
            self.pub_key = input["pubKey"]
        return self.myself(info)

    def _gpu_rows(self, gpu_type_id: str) -> list[tuple[str, dict]]:
        return [(it, t) for it, t in self.catalog.items() if self.gpu_id.get(t["gpu"]) == gpu_type_id]

    def gpuTypes(self, info, input=None) -> list[dict]:  # noqa: N802
        ids = {r for r in (self.gpu_id.get(t["gpu"]) for t in self.catalog.values()) if r}
        if input and input.get("id"):
            ids &= {input["id"]}
        return [self._gpu_type(i) for i in sorted(ids)]

    def _gpu_type(self, gid: str) -> dict:
        rows = self._gpu_rows(gid)
        per = [(t["price"] / t["gpus"], t["spot"] / t["gpus"], t) for _, t in rows]
        price, spot, t = min(per, key=lambda x: x[0])
        mem = next((t["memory"] // t["gpus"] for _, t in rows), 0)
        bid = round(price * MIN_BID_FRACTION, 3)
        return {"id": gid, "displayName": t["gpu"], "maxGpuCount": max(x["gpus"] for _, x in rows),
                "manufacturer": "Nvidia", "memoryInGb": _gpu_memory(t["gpu"], mem), "cudaCores": 0,
                "secureCloud": True, "communityCloud": False, "securePrice": price, "communityPrice": None,
                "oneMonthPrice": None, "threeMonthPrice": None, "oneWeekPrice": None,
                "communitySpotPrice": None, "secureSpotPrice": spot,
                "lowestPrice": lambda info, input=None: {"minimumBidPrice": bid, "uninterruptablePrice": price,
                                                         "stockStatus": "High"}}

    def min_bid(self, gid: str) -> float:
        return self._gpu_type(gid)["lowestPrice"](None)["minimumBidPrice"]

    def podFindAndDeployOnDemand(self, info, input=None) -> dict:  # noqa: N802
        return self._deploy(input or {}, spot=False)

    def podRentInterruptable(self, info, input) -> dict:  # noqa: N802
        return self._deploy(input, spot=True)

    def deployCpuPod(self, info, input) -> dict:  # noqa: N802
        raise graphql.GraphQLError("the RunPod lab sells no CPU pods")

    def podTerminate(self, info, input) -> None:  # noqa: N802
        pid = input["podId"]
        with self.lock:
            p = self.pods.get(pid)
            if p is None:
                raise graphql.GraphQLError(f"Pod not found: {pid}")
        self._kill(p, "terminated")
        with self.lock:
            self.pods.pop(pid, None)
        return None

    def podStop(self, info, input) -> dict:  # noqa: N802
        raise graphql.GraphQLError("podStop is not emulated by the RunPod lab")

    def pod(self, info, input=None) -> dict | None:
        with self.lock:
            p = self.pods.get((input or {}).get("podId", ""))
            return self._public(p) if p else None

    def deleteTemplate(self, info, templateName=None) -> None:  # noqa: N802, N803
        raise graphql.GraphQLError(f"Template not found: {templateName}")

    # ---- pods -------------------------------------------------------------------------------------
    def _deploy(self, inp: dict, spot: bool) -> dict:
        gid, count = inp.get("gpuTypeId"), int(inp.get("gpuCount") or 1)
        cloud_type = inp.get("cloudType") or "ALL"
        types = [(it, t) for it, t in self._gpu_rows(gid or "") if t["gpus"] == count
                 and (cloud_type == "ALL" or it.endswith(f"_{cloud_type}"))]
        if not types:
            raise graphql.GraphQLError(NO_CAPACITY)
        itype, t = types[0]
        wanted = [z.strip() for z in (inp.get("dataCenterId") or "").split(",") if z.strip()] or list(t["zones"])
        zones = [z for z in wanted if z in t["zones"] and z not in self.no_capacity
                 and (not inp.get("countryCode") or t["zones"][z] == inp["countryCode"])]
        if not zones:
            raise graphql.GraphQLError(NO_CAPACITY)
        if spot:
            bid, floor = float(inp["bidPerGpu"]), self.min_bid(gid)
            if bid + 1e-9 < floor:
                raise graphql.GraphQLError(f"Your bid of ${bid:.3f}/GPU/hr is below the current minimum bid of "
                                           f"${floor:.3f}/GPU/hr for {gid}.")
            cost = round(bid * count, 4)
        else:
            cost = t["price"]
        with self.lock:
            n = self.next_n
            self.next_n += 1
            pid = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(14))
            env = {e["key"]: e.get("value") or "" for e in (inp.get("env") or [])}
            p = {"id": pid, "name": inp.get("name"), "desiredStatus": "RUNNING", "costPerHr": cost,
                 "containerDiskInGb": int(inp.get("containerDiskInGb") or 10), "containerRegistryAuthId": None,
                 "dockerArgs": inp.get("dockerArgs") or "", "dockerId": None, "gpuCount": count,
                 "imageName": inp.get("imageName"), "lastStatusChange": f"Rented by User: {time.ctime()}",
                 "machineId": f"lab-{zones[0].lower()}-{n}", "memoryInGb": t["memory"], "podType":
                 "INTERRUPTABLE" if spot else "RESERVED", "port": None, "ports": inp.get("ports"),
                 "uptimeSeconds": 0, "vcpuCount": t["vcpus"], "volumeInGb": int(inp.get("volumeInGb") or 0),
                 "volumeMountPath": inp.get("volumeMountPath"), "runtime": None,
                 "machine": {"podHostId": f"{pid}-{n}", "gpuDisplayName": t["gpu"]},
                 "env": [f"{k}={v}" for k, v in env.items()],
                 "_n": n, "_zone": zones[0], "_itype": itype, "_spot": spot, "_env": env, "_pid": None,
                 "_fwd": None, "_started": time.time()}
            self.pods[pid] = p
            self.bill.append({"id": pid, "name": p["name"], "instance_type": itype, "zone": zones[0],
                              "spot": spot, "price_per_hour": cost, "disk_gb": p["containerDiskInGb"],
                              "start": time.time(), "end": None, "how": None})
        threading.Thread(target=self._boot, args=(pid,), daemon=True).start()
        return self._public(p)

    def _boot(self, pid: str) -> None:
        p = self.pods[pid]
        n = p["_n"]
        env = {"RUNPOD_POD_ID": pid, "RUNPOD_PUBLIC_IP": podlib.HOST_IP, "RUNPOD_TCP_PORT_22": str(podlib.ssh_port(n)),
               "RUNPOD_GPU_COUNT": str(p["gpuCount"]), "RUNPOD_CPU_COUNT": str(p["vcpuCount"]),
               "RUNPOD_DC_ID": p["_zone"], "PUBLIC_KEY": self.pub_key or "", **p["_env"]}
        log = self.lab_dir / "nodes" / f"{n}.log"
        try:
            fwd = podlib.Forwarder(podlib.ssh_port(n), podlib.pod_ip(n))
            with self.lock:
                if p["desiredStatus"] != "RUNNING":
                    fwd.close()
                    return
                p["_fwd"] = fwd
                p["_pid"] = podlib.up(self.lab_dir, n, pid, p["dockerArgs"], env, log)
                p["runtime"] = {"uptimeInSeconds": 0, "ports": [
                    {"ip": podlib.HOST_IP, "isIpPublic": True, "privatePort": 22,
                     "publicPort": podlib.ssh_port(n), "type": "tcp"},
                    *[{"ip": podlib.pod_ip(n), "isIpPublic": False, "privatePort": port,
                       "publicPort": port, "type": "http"} for port in _http_ports(p["ports"])]]}
        except Exception as e:  # noqa: BLE001 - the pod never ran: EXITED, as RunPod shows a failed start
            log.open("a").write(f"pod up failed: {e}\n")
            with self.lock:
                p["desiredStatus"], p["runtime"] = "EXITED", None
            self._end_bill(pid, "failed")

    def _kill(self, p: dict, how: str) -> None:
        with self.lock:
            p["desiredStatus"], p["runtime"] = "EXITED", None
            fwd, p["_fwd"] = p["_fwd"], None
        if fwd:
            fwd.close()
        podlib.down(self.lab_dir, p["_n"], p.get("_pid"))
        self._end_bill(p["id"], how)

    def _end_bill(self, pid: str, how: str) -> None:
        with self.lock:
            for b in self.bill:
                if b["id"] == pid and b["end"] is None:
                    b["end"], b["how"] = time.time(), how

    def _public(self, p: dict) -> dict:
        out = {k: v for k, v in p.items() if not k.startswith("_")}
        if p["runtime"] is not None:
            out["runtime"] = {**p["runtime"], "uptimeInSeconds": int(time.time() - p["_started"])}
            out["uptimeSeconds"] = int(time.time() - p["_started"])
        return out

    # ---- the lab's own routes ---------------------------------------------------------------------
    def preempt(self, name: str, gone_after: float | None = None) -> tuple[int, dict]:
        """RunPod takes an interruptible pod back: killed, EXITED, then gone from the list."""
        with self.lock:
            hits = [p for p in self.pods.values() if (p["name"] == name or p["id"] == name)
                    and p["desiredStatus"] == "RUNNING"]
        if not hits:
            return 404, {"error": f"no running pod named {name!r}"}
        if not all(p["_spot"] for p in hits):
            return 400, {"error": f"{name!r} is an on-demand pod: RunPod does not take those back"}
        wait = self.gone_after if gone_after is None else gone_after
        for p in hits:
            self._kill(p, "preempted")
            threading.Timer(wait, self._forget, args=(p["id"],)).start()
        return 200, {"preempted": [p["name"] for p in hits], "gone_after": wait}

    def _forget(self, pid: str) -> None:
        with self.lock:
            p = self.pods.get(pid)
            if p is not None and p["desiredStatus"] == "EXITED":
                self.pods.pop(pid, None)

    def status(self) -> dict:
        with self.lock:
            pods = [{**self._public(p), "zone": p["_zone"], "instance_type": p["_itype"],
                     "ssh": f"{podlib.HOST_IP}:{podlib.ssh_port(p['_n'])}" if p["runtime"] else None}
                    for p in self.pods.values()]
        return {"pods": pods, "no_capacity": sorted(self.no_capacity)}

    def billing(self) -> dict:
        now = time.time()
        with self.lock:
            rows = []
            for b in self.bill:
                secs = (b["end"] or now) - b["start"]
                compute = secs / 3600 * b["price_per_hour"]
                storage = secs / 3600 * b["disk_gb"] * STORAGE_USD_PER_GB_MONTH / HOURS_PER_MONTH
                rows.append({**b, "seconds": round(secs, 3), "compute_usd": round(compute, 6),
                             "storage_usd": round(storage, 6), "usd": round(compute + storage, 6),
                             "running": b["end"] is None})
        return {"pods": rows, "total_usd": round(sum(r["usd"] for r in rows), 6),
                "running": sum(r["running"] for r in rows)}

    def shutdown(self) -> None:
        with self.lock:
            pods = list(self.pods.values())
        for p in pods:
            self._kill(p, "lab-stopped")
            with self.lock:
                self.pods.pop(p["id"], None)

    def execute(self, body: dict) -> dict:
        query = body.get("query")
        if not isinstance(query, str):
            return {"errors": [{"message": "Must provide query string."}]}
        res = graphql.graphql_sync(self.schema, query, root_value=self, variable_values=body.get("variables"))
        out: dict = {"data": res.data}
        if res.errors:
            out["errors"] = [e.formatted for e in res.errors]
        return out


def _gpu_memory(gpu: str, fallback: int) -> int:
    for token in gpu.replace("-", " ").split():
        if token.upper().endswith("GB") and token[:-2].isdigit():
            return int(token[:-2])
    return 80 if gpu.startswith(("A100", "H100")) else max(fallback, 1)


def _http_ports(ports: str | None) -> list[int]:
    out = []
    for item in (ports or "").split(","):
        num, _, kind = item.partition("/")
        if num.strip().isdigit() and kind == "http":
            out.append(int(num))
    return out or [8266]


def serve(cloud: Cloud, host: str, port: int) -> None:
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            with open(cloud.lab_dir / "api.log", "a") as f:
                f.write("%s %s\n" % (time.strftime("%H:%M:%S"), fmt % args))

        def _send(self, code: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            try:
                v = json.loads(self.rfile.read(n) if n else b"{}")
                return v if isinstance(v, dict) else {}
            except ValueError:
                return {}

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def _route(self, method: str) -> None:
            path = self.path.split("?")[0].rstrip("/")
            body = self._body() if method == "POST" else {}
            if path.startswith("/_lab/"):
                if self.client_address[0] != "127.0.0.1":
                    return self._send(403, {"error": "lab routes are local only"})
                return self._lab(method, path[len("/_lab/"):], body)
            if path != "/graphql" or method != "POST":
                return self._send(404, {"errors": [{"message": f"{method} {path}: not found"}]})
            if self.headers.get("Authorization") != f"Bearer {cloud.api_key}":
                return self._send(401, {"errors": [{"message": "Unauthorized"}]})
            with open(cloud.lab_dir / "graphql.log", "a") as f:  # what the clients sent (no key in it)
                f.write(json.dumps({"t": time.time(), "query": body.get("query")}) + "\n")
            return self._send(200, cloud.execute(body))

        def _lab(self, method: str, what: str, body: dict) -> None:
            if what == "status":
                return self._send(200, cloud.status())
            if what == "bill":
                return self._send(200, cloud.billing())
            if what == "preempt" and method == "POST":
                return self._send(*cloud.preempt(str(body.get("name")), body.get("gone_after")))
            if what == "capacity" and method == "POST":
                zone, on = str(body.get("zone")), bool(body.get("on"))
                with cloud.lock:
                    (cloud.no_capacity.discard if on else cloud.no_capacity.add)(zone)
                return self._send(200, cloud.status())
            if what == "shutdown" and method == "POST":
                cloud.shutdown()
                self._send(200, {"ok": True})
                stop.set()
                return None
            return self._send(404, {"error": what})

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        stop.wait()
    finally:
        httpd.shutdown()
        cloud.shutdown()

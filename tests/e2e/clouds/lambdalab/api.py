"""The Lambda Cloud API, emulated: the routes SkyPilot 0.14.1's ``lambda_utils.py`` calls, with
the wire format it reads, backed by :mod:`node` machines. Plus ``/_lab/*`` admin routes for the
lab CLI (status, preempt, capacity, bill, shutdown).

Emulated: ``GET /instance-types`` (prices in cents and ``regions_with_capacity_available``, from
the lab's SkyPilot catalog — the same ``vms.csv`` dtrun reads), ``POST /instance-operations/launch``
(insufficient-capacity error when the region has none), ``POST /instance-operations/terminate``,
``GET /instances`` (``booting`` until sshd answers, then ``active``; ``terminating`` until the
node is gone), ``GET/POST /ssh-keys``, ``GET/PUT /firewall-rules`` (stored, not enforced);
``Authorization: Bearer`` checked; errors as ``{"error": {"code", "message"}}``; bodies parsed
whatever the Content-Type.

Not emulated: rate limits (429), Lambda's real boot and teardown times, filesystems, reserved
instances, restart, the ``/instances/{id}`` route, API pagination.
"""

from __future__ import annotations

import csv
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.e2e.clouds.lambdalab import node

REGION_DESC = {"us-east-1": "Virginia, USA", "us-west-1": "California, USA", "us-south-1": "Texas, USA"}
MAX_NODES = 200


def read_catalog(path: Path) -> dict[str, dict]:
    """vms.csv → {instance type: {price, gpu, gpus, vcpus, memory, regions}}."""
    out: dict[str, dict] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            t = out.setdefault(row["InstanceType"], {
                "price": float(row["Price"]), "gpu": row["AcceleratorName"],
                "gpus": int(float(row["AcceleratorCount"] or 0)), "vcpus": int(float(row["vCPUs"])),
                "memory": int(float(row["MemoryGiB"])), "regions": []})
            t["regions"].append(row["Region"])
    return out


class Cloud:
    def __init__(self, lab_dir: Path, catalog: Path, api_key: str):
        self.lab_dir = lab_dir
        self.catalog = read_catalog(catalog)
        self.api_key = api_key
        self.lock = threading.RLock()
        self.instances: dict[str, dict] = {}
        self.keys: list[dict] = []
        self.firewall: list[dict] = []
        self.no_capacity: set[str] = set()
        self.bill: list[dict] = []  # one entry per instance ever launched
        self.next_n = 10
        (lab_dir / "nodes").mkdir(parents=True, exist_ok=True)

    # ---- Lambda's API ---------------------------------------------------------------------------
    def instance_types(self) -> dict:
        data = {}
        for name, t in self.catalog.items():
            desc = f"{t['gpus']}x {t['gpu']}" if t["gpu"] else f"{t['vcpus']} vCPU"
            data[name] = {
                "instance_type": {"name": name, "description": desc, "gpu_description": t["gpu"],
                                  "price_cents_per_hour": int(round(t["price"] * 100)),
                                  "specs": {"vcpus": t["vcpus"], "memory_gib": t["memory"], "storage_gib": 512,
                                            "gpus": t["gpus"]}},
                "regions_with_capacity_available": [{"name": r, "description": REGION_DESC.get(r, r)}
                                                    for r in t["regions"] if r not in self.no_capacity]}
        return data

    def launch(self, body: dict) -> tuple[int, dict]:
        itype, region = body.get("instance_type_name"), body.get("region_name")
        keys = body.get("ssh_key_names") or []
        qty = int(body.get("quantity", 1))
        if itype not in self.catalog:
            return 400, _err("global/invalid-parameters", f"Invalid instance type {itype!r}")
        if region not in self.catalog[itype]["regions"] or region in self.no_capacity:
            return 400, _err("instance-operations/launch/insufficient-capacity",
                             "Not enough capacity to fulfill launch request.")
        with self.lock:
            known = {k["name"]: k for k in self.keys}
            if len(keys) != 1 or keys[0] not in known:
                return 400, _err("global/invalid-parameters", f"Invalid ssh_key_names {keys!r}")
            ids = []
            for _ in range(qty):
                n = self.next_n
                self.next_n += 1
                iid = uuid.uuid4().hex
                inst = {"id": iid, "name": body.get("name") or None, "ip": node.node_ip(n),
                        "private_ip": node.node_ip(n), "status": "booting", "ssh_key_names": keys,
                        "file_system_names": [], "hostname": f"lambda-{n}",
                        "region": {"name": region, "description": REGION_DESC.get(region, region)},
                        "instance_type": self.instance_types()[itype]["instance_type"],
                        "is_reserved": False, "_n": n, "_pid": None}
                self.instances[iid] = inst
                self.bill.append({"id": iid, "name": inst["name"], "instance_type": itype, "region": region,
                                  "price_per_hour": self.catalog[itype]["price"], "start": time.time(),
                                  "end": None, "how": None})
                ids.append(iid)
                threading.Thread(target=self._boot, args=(iid, known[keys[0]]["public_key"]), daemon=True).start()
        return 200, {"data": {"instance_ids": ids}}

    def _boot(self, iid: str, pubkey: str) -> None:
        inst = self.instances[iid]
        n = inst["_n"]
        try:
            inst["_pid"] = node.up(self.lab_dir, n, pubkey, self.lab_dir / "nodes" / f"{n}.log")
        except Exception as e:  # the machine never came: unhealthy, as Lambda would show it
            (self.lab_dir / "nodes" / f"{n}.log").open("a").write(f"node up failed: {e}\n")
            inst["status"] = "unhealthy"
            return
        deadline = time.time() + 120
        while time.time() < deadline and inst["status"] == "booting":
            if node.ssh_banner(inst["ip"]):
                with self.lock:
                    if inst["status"] == "booting":
                        inst["status"] = "active"
                return
            time.sleep(0.2)
        if inst["status"] == "booting":
            inst["status"] = "unhealthy"

    def terminate(self, body: dict) -> tuple[int, dict]:
        ids = body.get("instance_ids") or []
        with self.lock:
            unknown = [i for i in ids if i not in self.instances]
            if unknown:
                return 400, _err("global/object-does-not-exist", f"Instances not found: {unknown}")
            out = []
            for iid in ids:
                inst = self.instances[iid]
                if inst["status"] != "terminating":
                    inst["status"] = "terminating"
                    threading.Thread(target=self._remove, args=(iid, "terminated"), daemon=True).start()
                out.append(_public(inst))
        return 200, {"data": {"terminated_instances": out}}

    def _remove(self, iid: str, how: str) -> None:
        inst = self.instances.get(iid)
        if inst is None:
            return
        node.down(inst["_n"], inst.get("_pid"))
        self._end_bill(iid, how)
        with self.lock:
            self.instances.pop(iid, None)

    def _end_bill(self, iid: str, how: str) -> None:
        with self.lock:
            for b in self.bill:
                if b["id"] == iid and b["end"] is None:
                    b["end"], b["how"] = time.time(), how

    # ---- the lab's own routes -------------------------------------------------------------------
    def preempt(self, name: str) -> tuple[int, dict]:
        """The cloud takes the instance back: killed, gone from the list, billing ends now."""
        with self.lock:
            hits = [i for i in self.instances.values() if i["name"] == name or i["id"] == name]
            if not hits:
                return 404, _err("global/object-does-not-exist", f"no instance named {name!r}")
            for inst in hits:
                self._end_bill(inst["id"], "preempted")
        for inst in hits:
            node.down(inst["_n"], inst.get("_pid"))
            with self.lock:
                self.instances.pop(inst["id"], None)
        return 200, {"preempted": [i["name"] for i in hits]}

    def status(self) -> dict:
        with self.lock:
            return {"instances": [_public(i) for i in self.instances.values()],
                    "no_capacity": sorted(self.no_capacity)}

    def billing(self) -> dict:
        now = time.time()
        with self.lock:
            rows = []
            for b in self.bill:
                secs = (b["end"] or now) - b["start"]
                rows.append({**b, "seconds": round(secs, 3), "usd": round(secs / 3600 * b["price_per_hour"], 6),
                             "running": b["end"] is None})
        return {"instances": rows, "total_usd": round(sum(r["usd"] for r in rows), 6),
                "running": sum(r["running"] for r in rows)}

    def shutdown(self) -> None:
        with self.lock:
            insts = list(self.instances.values())
        for inst in insts:
            node.down(inst["_n"], inst.get("_pid"))
            self._end_bill(inst["id"], "lab-stopped")
            self.instances.pop(inst["id"], None)


def _err(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def _public(inst: dict) -> dict:
    return {k: v for k, v in inst.items() if not k.startswith("_")}


def serve(cloud: Cloud, host: str, port: int) -> None:
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # noqa: D401 (one line per request in the lab log)
            with open(cloud.lab_dir / "api.log", "a") as f:
                f.write("%s %s\n" % (time.strftime("%H:%M:%S"), fmt % args))

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> dict:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                return json.loads(raw or b"{}")
            except ValueError:
                return {}

        def _route(self, method: str) -> None:
            path = self.path.split("?")[0].rstrip("/")
            body = self._body() if method in ("POST", "PUT") else {}
            if path.startswith("/_lab/"):
                if self.client_address[0] != "127.0.0.1":
                    return self._send(403, _err("global/forbidden", "lab routes are local only"))
                return self._lab(method, path[len("/_lab/"):], body)
            if self.headers.get("Authorization") != f"Bearer {cloud.api_key}":
                return self._send(401, _err("global/invalid-api-key", "API key was invalid, expired, or deleted."))
            p = path.removeprefix("/api/v1")
            if method == "GET" and p == "/instance-types":
                return self._send(200, {"data": cloud.instance_types()})
            if method == "GET" and p == "/instances":
                with cloud.lock:
                    return self._send(200, {"data": [_public(i) for i in cloud.instances.values()]})
            if method == "POST" and p == "/instance-operations/launch":
                return self._send(*cloud.launch(body))
            if method == "POST" and p == "/instance-operations/terminate":
                return self._send(*cloud.terminate(body))
            if method == "GET" and p == "/ssh-keys":
                with cloud.lock:
                    return self._send(200, {"data": [{"id": k["id"], "name": k["name"], "public_key": k["public_key"]}
                                                     for k in cloud.keys]})
            if method == "POST" and p == "/ssh-keys":
                name, pub = body.get("name"), body.get("public_key")
                if not name or not pub:
                    return self._send(400, _err("global/invalid-parameters", "name and public_key are required"))
                with cloud.lock:
                    if any(k["name"] == name for k in cloud.keys):
                        return self._send(400, _err("global/invalid-parameters", f"SSH key {name!r} exists"))
                    key = {"id": uuid.uuid4().hex, "name": name, "public_key": pub.strip()}
                    cloud.keys.append(key)
                return self._send(200, {"data": key})
            if p == "/firewall-rules":
                if method == "PUT":
                    cloud.firewall = list(body.get("data") or [])
                return self._send(200, {"data": cloud.firewall})
            return self._send(404, _err("global/not-found", f"{method} {path}"))

        def _lab(self, method: str, what: str, body: dict) -> None:
            if what == "status":
                return self._send(200, cloud.status())
            if what == "bill":
                return self._send(200, cloud.billing())
            if what == "preempt" and method == "POST":
                return self._send(*cloud.preempt(str(body.get("name"))))
            if what == "capacity" and method == "POST":
                region, on = str(body.get("region")), bool(body.get("on"))
                with cloud.lock:
                    (cloud.no_capacity.discard if on else cloud.no_capacity.add)(region)
                return self._send(200, cloud.status())
            if what == "shutdown" and method == "POST":
                cloud.shutdown()
                self._send(200, {"ok": True})
                stop.set()
                return None
            return self._send(404, _err("global/not-found", what))

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def do_PUT(self):
            self._route("PUT")

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        stop.wait()
    finally:
        httpd.shutdown()
        cloud.shutdown()

"""Vast's REST API, emulated at ``VAST_URL`` (the vastai SDK reads it once, at import of
``vastai.api.client``: the process that imports vastai must be started with it): every call
SkyPilot 0.14.1 makes, as the SDK (vastai 1.9.1) sends it, backed by namespaced machines
(:mod:`tests.e2e.clouds.vastlab.machine`). Plus ``/_lab/*`` admin routes for the CLI.

Emulated (``Authorization: Bearer <key>`` checked on every route; a wrong key is 401):

* ``GET/POST /api/v0/ssh/``: the account's keys (a list of ``{id, public_key, ...}``); Vast puts
  them in every new instance's ``/root/.ssh/authorized_keys``.
* ``POST /api/v0/bundles/``: the market. Every filter the body carries is applied (``eq neq gt
  gte lt lte in notin``; values the SDK sends as strings compared as the field's type; a field an
  offer lacks fails the filter; ``geolocation`` compared as its two-letter country code, as Vast's
  search documents it), ``order`` honoured, ``limit``,
  ``type`` ``bid`` prices offers at their ``min_bid``. The market is the lab's SkyPilot Vast
  catalog (two machines per row, ``dph_base`` = its price, ``min_bid`` = :data:`MIN_BID_FRACTION` ×)
  plus offers the SDK's chunking drops (under 32 cores); the highest ``score`` is deliberately
  not an H100, so renting "the top offer" of an unfiltered search is visibly the wrong GPU.
  ``dph_total`` includes ``allocated_storage`` × ``storage_cost``, as Vast's does.
* ``PUT /api/v0/asks/<offer>/``: ``price`` non-null → an interruptible bid (refused below the
  offer's current ``min_bid``, 400 ``invalid_price``), null → on-demand at ``dph_base``. An offer
  already rented (by an instance of ours, or by the higher bidder that outbid us) is 404
  ``no_such_ask``. Answers ``{"success": true, "new_contract": id}``; the row is listed at once
  (``actual_status`` ``loading``, then ``running`` once the machine's main process runs).
* ``GET /api/v1/instances/`` (``limit``, ``after_token`` → ``next_token``), ``GET
  /api/v0/instances/<id>/?owner=me`` (``{"instances": row}``, ``null`` when gone), ``PUT
  /api/v0/instances/<id>/ {"state": running|stopped}``, ``DELETE /api/v0/instances/<id>/`` (gone
  from the list when the call returns).
* a row as SkyPilot reads it: ``actual_status`` lower-case (``loading``/``running``/``exited``),
  float ``start_date``, ``extra_env`` as ``[k, v]`` pairs, ``local_ipaddrs`` a string, ``ssh_host``
  = ``public_ipaddr`` = the bridge's host address, and the SSH port in both ``ssh_port`` and
  ``ports['22/tcp'][0].HostPort`` (the same, never 22; both null until running).
* outbid (lab route): the machine is killed without notice, ``actual_status`` ``exited``
  (``intended_status`` stays ``running``, ``status_msg`` says outbid), the offer taken by the
  higher bidder (``PUT state running`` leaves it exited), storage still billing until DELETE;
  ``release`` (lab route) gives every taken offer back (a test leaves the market as it found it).
* the bill, per second (Vast's billing docs): compute at the bid (interruptible) or ``dph_base``
  (on-demand) while running; storage ``disk`` GB × ``storage_cost`` $/GB-month for as long as
  the instance exists, stopped included.

Not emulated: Vast's real error texts (``no_such_ask``/``invalid_price`` bodies are the lab's),
``runtype`` (every instance gets sshd, whatever is sent), bandwidth charges, templates, volumes,
``/asks/bulk/``, team keys, rate limits, the SSH proxy hosts (``ssh*.vast.ai``: the lab's "proxy"
is a port forwarder on the host), a bid winning back its machine, host ``reliability``.
"""

from __future__ import annotations

import ast
import csv
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tests.e2e.clouds.vastlab import machine

MIN_BID_FRACTION = 0.4
"""An offer's minimum bid ($/h per instance): this fraction of its on-demand ``dph_base``."""
STORAGE_USD_PER_GB_MONTH = 0.15
HOURS_PER_MONTH = 730
TOP_GPU = "RTX 4090"
"""The GPU of the market's highest-scored offer that passes the SDK's chunking."""
_SPECIAL = ("order", "type", "limit", "allocated_storage", "disable_bundling", "select_cols")
_OPS = {"eq": lambda a, b: a == b, "neq": lambda a, b: a != b, "gt": lambda a, b: a > b,
        "gte": lambda a, b: a >= b, "lt": lambda a, b: a < b, "lte": lambda a, b: a <= b,
        "in": lambda a, b: a in b, "notin": lambda a, b: a not in b}


def market(catalog: Path) -> list[dict]:
    """The offers: one per catalog row, plus two the SDK's chunked search drops."""
    rows = list(csv.DictReader(open(catalog, newline="")))
    offers = []
    for i, r in enumerate(rows):
        n, gpu = int(float(r["AcceleratorCount"])), r["InstanceType"].split("-")[1].replace("_", " ")
        info = ast.literal_eval(r["GpuInfo"]) if r.get("GpuInfo") else {}
        mib = int(info.get("Gpus", [{}])[0].get("MemoryInfo", {}).get("SizeInMiB", 24576))
        geo = ", ".join(p.strip() for p in r["Region"].split(",")[:2] if p.strip())
        for m in (0, 1):  # two machines per row, adjacent in score (another one after an outbid)
            offers.append(_offer(100 + 2 * i + m, gpu, n, mib, 32 * n if n > 1 else 48, 65536 * n + 1024,
                                 float(r["Price"]), geo, score=400.0 - i - 0.5 * m))
    # the top of the whole market: an RTX 4090 (what an unfiltered search rents), above them a
    # 16-core RTX 3090 box (dropped by the SDK's chunking: fewer than 32 cores)
    offers.append(_offer(90, TOP_GPU, 1, 24564, 64, 129024, 0.45, "Nevada, US", score=800.0))
    offers.append(_offer(91, "RTX 3090", 1, 24576, 16, 32768, 0.22, "Ohio, US", score=900.0))
    return offers


def _like(val, have):
    """A query value as the server reads it: the SDK sends numbers and booleans as strings
    (``inet_down >= 100`` → ``{"gte": "100"}``); compared as the field's type."""
    if isinstance(val, str) and not isinstance(have, str):
        if isinstance(have, bool):
            return val.lower() == "true"
        try:
            return float(val)
        except ValueError:
            return val
    return val


def _offer(oid: int, gpu: str, n: int, gpu_mib: int, cores: int, ram_mb: int, price: float, geo: str,
           score: float) -> dict:
    return {"id": oid, "ask_contract_id": oid, "machine_id": 5000 + oid, "host_id": 900 + oid % 7,
            "gpu_name": gpu, "num_gpus": n, "gpu_ram": gpu_mib, "gpu_total_ram": gpu_mib * n,
            "cpu_cores": cores, "cpu_cores_effective": float(cores), "cpu_ram": ram_mb, "cpu_name": "AMD EPYC 7B13",
            "disk_space": 1500.0, "disk_name": "nvme", "dph_base": price, "min_bid": round(price * MIN_BID_FRACTION, 4),
            "storage_cost": STORAGE_USD_PER_GB_MONTH, "inet_up": 900.0, "inet_down": 900.0, "inet_up_cost": 0.0,
            "inet_down_cost": 0.0, "geolocation": geo, "hosting_type": 1, "datacenter": True, "rentable": True,
            "rented": False, "verified": True, "external": False, "score": score, "reliability2": 0.99,
            "cuda_max_good": 12.8, "direct_port_count": 100, "static_ip": True, "is_bid": False}


class Cloud:
    def __init__(self, lab_dir: Path, catalog: Path, api_key: str):
        self.lab_dir = lab_dir
        self.api_key = api_key
        self.lock = threading.RLock()
        self.offers = {o["id"]: o for o in market(catalog)}
        self.instances: dict[int, dict] = {}
        self.ssh_keys: list[dict] = []
        self.no_capacity: set[str] = set()
        self.taken: set[int] = set()  # offers held by the higher bidder that outbid us
        self.bill: list[dict] = []
        self.queries: list[dict] = []  # the bundles bodies and ask bodies (onstart redacted), as sent
        self.next_n, self.next_id = 10, 31000010
        (lab_dir / "nodes").mkdir(parents=True, exist_ok=True)

    # ---- the market -------------------------------------------------------------------------------
    def _available(self, o: dict) -> bool:
        held = any(i["_offer"] == o["id"] for i in self.instances.values())
        return not held and o["id"] not in self.taken and o["gpu_name"] not in self.no_capacity

    def bundles(self, q: dict) -> tuple[int, dict]:
        with self.lock:
            self.queries.append({"t": time.time(), "route": "bundles", "body": q})
            storage = float(q.get("allocated_storage") or 0)
            out = []
            for o in self.offers.values():
                row = {**o, "rentable": self._available(o), "rented": not self._available(o)}
                per_hour_storage = storage * o["storage_cost"] / HOURS_PER_MONTH
                base = o["min_bid"] if q.get("type") == "bid" else o["dph_base"]
                row["dph_total"] = round(base + per_hour_storage, 6)
                row["storage_total_cost"] = round(per_hour_storage, 6)
                row["search"] = {"totalHour": row["dph_total"], "gpuCostPerHour": base,
                                 "diskHour": round(per_hour_storage, 6)}  # what SkyPilot's fetch_vast reads
                if all(self._match(row, k, v) for k, v in q.items() if k not in _SPECIAL):
                    out.append(row)
        for field, direction in reversed(q.get("order") or []):
            out.sort(key=lambda r, f=field: (r.get(f) is None, r.get(f)), reverse=direction == "desc")
        if q.get("limit"):
            out = out[: int(q["limit"])]
        return 200, {"offers": out}

    @staticmethod
    def _match(row: dict, field: str, cond) -> bool:
        if not isinstance(cond, dict):
            cond = {"eq": cond}
        if field not in row:
            return False
        have = row[field]
        if field == "geolocation" and isinstance(have, str):
            have = have.rsplit(",", 1)[-1].strip()  # Vast's search: "two letter country code" ("Texas, US" → US)
        for op, val in cond.items():
            f = _OPS.get(op)
            val = [_like(v, have) for v in val] if isinstance(val, list) else _like(val, have)
            try:
                if f is None or not f(have, val):
                    return False
            except TypeError:
                return False
        return True

    # ---- instances --------------------------------------------------------------------------------
    def create(self, offer_id: int, body: dict) -> tuple[int, dict]:
        with self.lock:
            logged = {k: (f"<{len(v)} chars>" if k == "onstart" and isinstance(v, str) else v) for k, v in body.items()}
            self.queries.append({"t": time.time(), "route": "asks", "offer": offer_id, "body": logged})
            o = self.offers.get(offer_id)
            if o is None or not self._available(o):
                return 404, {"success": False, "error": "no_such_ask",
                             "msg": f"Instance type by id {offer_id} is not available."}
            price = body.get("price")
            if price is not None:
                try:
                    price = float(price)
                except (TypeError, ValueError):
                    return 400, {"success": False, "error": "invalid_args", "msg": "price must be a number"}
                if price + 1e-9 < o["min_bid"]:
                    return 400, {"success": False, "error": "invalid_price",
                                 "msg": f"Your bid of ${price:.4f}/hr is below the current minimum bid of "
                                        f"${o['min_bid']:.4f}/hr for offer {offer_id}."}
            n, iid = self.next_n, self.next_id
            self.next_n += 1
            self.next_id += 1
            env = body.get("env") if isinstance(body.get("env"), dict) else {}
            disk = float(body.get("disk") or 10)
            rate = price if price is not None else o["dph_base"]
            inst = {"id": iid, "label": body.get("label"), "actual_status": "loading", "intended_status": "running",
                    "cur_state": "running", "next_state": "running", "status_msg": "Creating container",
                    "start_date": time.time(), "extra_env": [[k, str(v)] for k, v in env.items()],
                    "image_uuid": body.get("image"), "image_runtype": body.get("runtype") or "ssh",
                    "onstart": None, "ssh_host": None, "ssh_port": None, "ssh_idx": "lab",
                    "public_ipaddr": machine.NET.host_ip, "local_ipaddrs": machine.NET.ip(n), "ports": None,
                    "machine_id": o["machine_id"], "host_id": o["host_id"], "gpu_name": o["gpu_name"],
                    "num_gpus": o["num_gpus"], "gpu_ram": o["gpu_ram"], "cpu_cores": o["cpu_cores"],
                    "cpu_ram": o["cpu_ram"], "disk_space": disk, "geolocation": o["geolocation"],
                    "is_bid": price is not None, "min_bid": o["min_bid"], "dph_base": o["dph_base"],
                    "dph_total": round(rate + disk * o["storage_cost"] / HOURS_PER_MONTH, 6),
                    "storage_cost": o["storage_cost"], "duration": 0.0,
                    "_n": n, "_offer": offer_id, "_onstart": body.get("onstart") or "", "_env": env,
                    "_machine": None}
            self.instances[iid] = inst
            self.bill.append({"id": iid, "label": inst["label"], "gpu_name": o["gpu_name"], "num_gpus": o["num_gpus"],
                              "offer": offer_id, "interruptible": price is not None, "price_per_hour": rate,
                              "disk_gb": disk, "storage_cost": o["storage_cost"], "created": time.time(),
                              "destroyed": None, "running": [], "how": None})
        threading.Thread(target=self._boot, args=(iid,), daemon=True).start()
        return 200, {"success": True, "new_contract": iid}

    def _boot(self, iid: int) -> None:
        with self.lock:
            inst = self.instances.get(iid)
            if inst is None or inst["_machine"] is not None:
                return
            keys = [k["public_key"] for k in self.ssh_keys]
        try:
            m = machine.Machine(self.lab_dir, inst["_n"], iid, inst["_onstart"], inst["_env"], keys)
        except Exception as e:  # noqa: BLE001 - never ran: exited, with Vast's kind of message
            with self.lock:
                inst.update(actual_status="exited", status_msg=f"Error: container failed to start: {e}")
            return
        with self.lock:
            if iid not in self.instances or inst["intended_status"] != "running":
                m.down()
                return
            port = m.ssh_port
            inst.update(_machine=m, actual_status="running", status_msg="success, running vastai/base",
                        ssh_host=machine.NET.host_ip, ssh_port=port,
                        ports={"22/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(port)}],
                               "8080/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(port + 1)}]})
            self._bill_row(iid)["running"].append([time.time(), None])

    def _bill_row(self, iid: int) -> dict:
        return next(b for b in reversed(self.bill) if b["id"] == iid)

    def _halt(self, inst: dict, status_msg: str) -> None:
        """Kill the machine (no notice), keep the row: exited, storage billing on."""
        with self.lock:
            m, inst["_machine"] = inst["_machine"], None
            inst.update(actual_status="exited", cur_state="stopped", ssh_host=None, ssh_port=None, ports=None,
                        status_msg=status_msg)
            for seg in self._bill_row(inst["id"])["running"]:
                if seg[1] is None:
                    seg[1] = time.time()
        if m is not None:
            m.down()

    def get(self, iid: int) -> dict | None:
        with self.lock:
            inst = self.instances.get(iid)
            return self._public(inst) if inst else None

    def page(self, limit: int, after: str | None) -> dict:
        with self.lock:
            rows = [self._public(i) for _, i in sorted(self.instances.items())]
        if after:
            rows = [r for r in rows if r["id"] > int(after)]
        limit = max(1, min(int(limit or 25), 25))
        page, rest = rows[:limit], rows[limit:]
        return {"instances": page, "total_instances": len(rows),
                "next_token": str(page[-1]["id"]) if rest else None}

    def set_state(self, iid: int, state: str) -> tuple[int, dict]:
        with self.lock:
            inst = self.instances.get(iid)
            if inst is None:
                return 404, {"success": False, "error": "no_such_instance", "msg": f"Instance {iid} not found."}
            if state not in ("running", "stopped"):
                return 400, {"success": False, "error": "invalid_args", "msg": f"state {state!r}"}
            inst["intended_status"] = state
        if state == "stopped":
            self._halt(inst, "stopped by user")
            return 200, {"success": True}
        with self.lock:
            if inst["_offer"] in self.taken:  # outbid: waits for its bid to win again (never, here)
                return 200, {"success": True}
            if inst["_machine"] is None and inst["actual_status"] != "loading":
                inst.update(actual_status="loading", cur_state="running", status_msg="Starting container")
                threading.Thread(target=self._boot, args=(iid,), daemon=True).start()
        return 200, {"success": True}

    def destroy(self, iid: int) -> tuple[int, dict]:
        with self.lock:
            inst = self.instances.get(iid)
            if inst is None:
                return 404, {"success": False, "error": "no_such_instance", "msg": f"Instance {iid} not found."}
            inst["intended_status"] = "destroyed"
        self._halt(inst, "destroyed")
        with self.lock:
            self.instances.pop(iid, None)
            b = self._bill_row(iid)
            b["destroyed"], b["how"] = time.time(), b["how"] or "destroyed"
        return 200, {"success": True}

    def _public(self, inst: dict) -> dict:
        out = {k: v for k, v in inst.items() if not k.startswith("_")}
        out["duration"] = time.time() - inst["start_date"]
        return out

    # ---- the lab's own routes ---------------------------------------------------------------------
    def outbid(self, name: str) -> tuple[int, dict]:
        with self.lock:
            hits = [i for i in self.instances.values() if (i["label"] == name or str(i["id"]) == name)
                    and i["actual_status"] == "running"]
        if not hits:
            return 404, {"error": f"no running instance labelled {name!r}"}
        if not all(i["is_bid"] for i in hits):
            return 400, {"error": f"{name!r} is on-demand: an on-demand instance cannot be outbid"}
        for i in hits:
            with self.lock:
                self.taken.add(i["_offer"])
                self._bill_row(i["id"])["how"] = "outbid"
            self._halt(i, "Instance stopped: outbid by a higher bidder")
        return 200, {"outbid": [i["label"] for i in hits]}

    def status(self) -> dict:
        with self.lock:
            rows = [{**self._public(i), "offer": i["_offer"],
                     "ssh": f"{i['ssh_host']}:{i['ssh_port']}" if i["ssh_port"] else None}
                    for i in self.instances.values()]
        return {"instances": rows, "no_capacity": sorted(self.no_capacity), "taken_offers": sorted(self.taken)}

    def billing(self) -> dict:
        now = time.time()
        with self.lock:
            rows = []
            for b in self.bill:
                run = sum((e or now) - s for s, e in b["running"])
                exists = (b["destroyed"] or now) - b["created"]
                compute = run / 3600 * b["price_per_hour"]
                storage = exists / 3600 * b["disk_gb"] * b["storage_cost"] / HOURS_PER_MONTH
                rows.append({k: v for k, v in b.items() if k != "running"} | {
                    "running_seconds": round(run, 3), "exists_seconds": round(exists, 3),
                    "compute_usd": round(compute, 6), "storage_usd": round(storage, 8),
                    "usd": round(compute + storage, 6), "billing": b["destroyed"] is None})
        return {"instances": rows, "total_usd": round(sum(r["usd"] for r in rows), 6),
                "billing": sum(r["billing"] for r in rows)}

    def shutdown(self) -> None:
        with self.lock:
            ids = list(self.instances)
        for iid in ids:
            with self.lock:
                if iid in self.instances:
                    self._bill_row(iid)["how"] = self._bill_row(iid)["how"] or "lab-stopped"
            self.destroy(iid)


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

        def do_PUT(self):
            self._route("PUT")

        def do_DELETE(self):
            self._route("DELETE")

        def _route(self, method: str) -> None:
            from urllib.parse import parse_qs, urlsplit

            u = urlsplit(self.path)
            path, qs = u.path.rstrip("/"), {k: v[-1] for k, v in parse_qs(u.query).items()}
            body = self._body()
            if path.startswith("/_lab/"):
                if self.client_address[0] != "127.0.0.1":
                    return self._send(403, {"error": "lab routes are local only"})
                return self._lab(method, path[len("/_lab/"):], body)
            if self.headers.get("Authorization") != f"Bearer {cloud.api_key}":
                return self._send(401, {"success": False, "error": "invalid_api_key", "msg": "Invalid API key"})
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "v0"] and parts[2:] == ["ssh"]:
                if method == "GET":
                    return self._send(200, cloud.ssh_keys)
                if method == "POST" and isinstance(body.get("ssh_key"), str):
                    with cloud.lock:
                        key = {"id": 700 + len(cloud.ssh_keys), "user_id": 1, "public_key": body["ssh_key"].strip(),
                               "created_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
                        cloud.ssh_keys.append(key)
                    return self._send(200, {"success": True, "key": key})
            if parts == ["api", "v0", "bundles"] and method == "POST":
                return self._send(*cloud.bundles(body))
            if parts[:3] == ["api", "v0", "asks"] and len(parts) == 4 and method == "PUT" and parts[3].isdigit():
                return self._send(*cloud.create(int(parts[3]), body))
            if parts == ["api", "v1", "instances"] and method == "GET":
                return self._send(200, cloud.page(int(qs.get("limit") or 25), qs.get("after_token")))
            if parts[:3] == ["api", "v0", "instances"] and len(parts) == 4 and parts[3].isdigit():
                iid = int(parts[3])
                if method == "GET":
                    return self._send(200, {"instances": cloud.get(iid)})
                if method == "PUT":
                    return self._send(*cloud.set_state(iid, str(body.get("state"))))
                if method == "DELETE":
                    return self._send(*cloud.destroy(iid))
            return self._send(404, {"success": False, "error": "not_found", "msg": f"{method} {u.path}"})

        def _lab(self, method: str, what: str, body: dict) -> None:
            if what == "status":
                return self._send(200, cloud.status())
            if what == "bill":
                return self._send(200, cloud.billing())
            if what == "queries":
                with cloud.lock:
                    return self._send(200, {"queries": list(cloud.queries)})
            if what == "outbid" and method == "POST":
                return self._send(*cloud.outbid(str(body.get("name"))))
            if what == "capacity" and method == "POST":
                gpu, on = str(body.get("gpu")), bool(body.get("on"))
                with cloud.lock:
                    (cloud.no_capacity.discard if on else cloud.no_capacity.add)(gpu)
                return self._send(200, cloud.status())
            if what == "release" and method == "POST":  # the higher bidders leave: every taken offer back
                with cloud.lock:
                    cloud.taken.clear()
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


def new_key() -> str:
    return secrets.token_hex(32)

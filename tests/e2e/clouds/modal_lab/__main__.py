"""The Modal lab's CLI: serve a local Modal control plane, and drive it from another process.

    python -m tests.e2e.clouds.modal_lab serve --execute [--root DIR] [--grace S] [--refuse-capacity N]
        prints ``MODAL_SERVER_URL=http://127.0.0.1:P`` (for the real ``modal`` client) and
        ``MODAL_LAB_CONTROL=http://127.0.0.1:Q`` (for the commands below), then serves until
        SIGTERM/SIGINT; every sandbox's processes are killed when it stops. Without ``--execute``
        sandboxes are created but never run (the scripted control plane).
    python -m tests.e2e.clouds.modal_lab evict NAME | oom NAME | expire NAME | terminate NAME
        a fault on the running sandbox called NAME (its name, or its id)
    python -m tests.e2e.clouds.modal_lab capacity N     the next N creates are refused (never scheduled)
    python -m tests.e2e.clouds.modal_lab status [--json]
    python -m tests.e2e.clouds.modal_lab bill [--json]  sandbox-seconds × dtrun's catalog price

The commands find the server through ``--control URL`` or ``MODAL_LAB_CONTROL``. Exit codes:
0 done, 1 no such sandbox / refused, 2 bad usage or no server.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAULTS = ("evict", "oom", "expire", "terminate")


def _handler(lab: Any) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:  # quiet
            pass

        def _send(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/status":
                return self._send(200, lab.status() if hasattr(lab, "bill") else [])
            if self.path == "/bill":
                return self._send(200, lab.bill() if hasattr(lab, "bill") else {})
            self._send(404, {"error": f"no {self.path}"})

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            try:
                if self.path == "/fault":
                    return self._send(200, {"id": lab.fault(body["name"], body["kind"])})
                if self.path == "/capacity":
                    lab.refuse_capacity(int(body["n"]))
                    return self._send(200, {"refuse": int(body["n"])})
            except (KeyError, AttributeError) as e:
                return self._send(409, {"error": e.args[0] if e.args else str(e)})
            self._send(404, {"error": f"no {self.path}"})
    return H


def serve(args: argparse.Namespace) -> int:
    if args.execute:
        from tests.e2e.clouds.modal_lab.control import ExecutingModal

        root = args.root or tempfile.mkdtemp(prefix="modal-lab-")
        lab = ExecutingModal(root, terminate_grace=args.grace)
    else:
        from tests.fakes.fake_modal_server import FakeModal

        lab = FakeModal()
    lab.port = args.port
    lab.start()
    if args.refuse_capacity and args.execute:
        lab.refuse_capacity(args.refuse_capacity)
    http = ThreadingHTTPServer(("127.0.0.1", args.control_port), _handler(lab))
    threading.Thread(target=http.serve_forever, daemon=True, name="modal-lab-control").start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"MODAL_SERVER_URL={lab.url}", flush=True)
    print(f"MODAL_LAB_CONTROL=http://127.0.0.1:{http.server_address[1]}", flush=True)
    try:
        stop.wait()
    finally:
        http.shutdown()
        lab.stop()  # kills every sandbox first
    return 0


def _call(control: str, path: str, body: dict | None = None) -> Any:
    req = urllib.request.Request(control.rstrip("/") + path, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        msg = json.loads(e.read() or b"{}").get("error", str(e))
        print(f"modal lab: {msg}", file=sys.stderr)
        raise SystemExit(1) from None
    except OSError as e:
        print(f"modal lab: cannot reach the control at {control}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.e2e.clouds.modal_lab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--control", default=os.environ.get("MODAL_LAB_CONTROL", ""),
                    help="the control URL `serve` printed (default: $MODAL_LAB_CONTROL)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the control plane")
    s.add_argument("--execute", action="store_true", help="run sandboxes as real local processes")
    s.add_argument("--root", help="where sandbox folders go (default: a new temp folder)")
    s.add_argument("--grace", type=float, default=30.0, help="SIGTERM→SIGKILL grace of a terminate (s)")
    s.add_argument("--refuse-capacity", type=int, default=0, help="refuse the first N creates")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--control-port", type=int, default=0)
    for f in FAULTS:
        sub.add_parser(f, help=f"{f} the running sandbox NAME").add_argument("name")
    sub.add_parser("capacity", help="refuse the next N creates").add_argument("n", type=int)
    for name in ("status", "bill"):
        sub.add_parser(name).add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        return serve(args)
    if not args.control:
        print("modal lab: no control URL (--control, or MODAL_LAB_CONTROL from `serve`)", file=sys.stderr)
        return 2
    if args.cmd in FAULTS:
        print(_call(args.control, "/fault", {"name": args.name, "kind": args.cmd})["id"])
    elif args.cmd == "capacity":
        _call(args.control, "/capacity", {"n": args.n})
    elif args.cmd == "status":
        rows = _call(args.control, "/status")
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            for r in rows:
                print(f"{r['id']}  {r['name']:<32} {r['state']:<12} exit {r['exitcode']}  gpu {r['gpu']}")
    elif args.cmd == "bill":
        b = _call(args.control, "/bill")
        if args.json:
            print(json.dumps(b, indent=1))
        else:
            for r in b["sandboxes"]:
                print(f"{r['name']:<32} {r['seconds']:>10.1f} s × ${r['usd_per_hour']:.4f}/h = ${r['usd']:.6f}")
            print(f"total ${b['usd']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

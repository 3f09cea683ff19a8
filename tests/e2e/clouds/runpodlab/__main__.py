"""The RunPod lab's CLI (root): ``python -m tests.e2e.clouds.runpodlab COMMAND``.

    start                 runtime cache (shared with the Lambda lab) + RunPod wheels if missing,
                          bridge, lab HOME, GraphQL emulator; prints the environment to export
    status [--json]       pods (id, name, desiredStatus, public SSH, zone), zones without capacity
    preempt NAME [SECS]   RunPod takes an interruptible pod back: killed, EXITED, gone after SECS
                          (default 120)
    capacity ZONE on|off  e.g. ``capacity US-NC-1 off``
    bill [--json]         per pod: seconds × costPerHr (spot: the bid) + container disk storage
    stop                  remove every namespace, veth, bridge, process (idempotent)
    env                   print the environment to export
"""

from __future__ import annotations

import json
import shlex
import sys

from tests.e2e.clouds.runpodlab import lab


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    if cmd in ("start", "env"):
        e = lab.start(log=lambda m: print(m, file=sys.stderr)) if cmd == "start" else lab.env()
        for k, v in e.items():
            print(f"export {k}={shlex.quote(v)}")
        return 0
    if cmd == "serve":
        lab.serve()
        return 0
    if cmd == "stop":
        left = lab.stop(log=lambda m: print(m, file=sys.stderr))
        return 1 if any(left.values()) else 0
    if not lab.running():
        print("runpod lab: not running (python -m tests.e2e.clouds.runpodlab start)", file=sys.stderr)
        return 1
    if cmd == "status":
        st = lab.call("status")
        if as_json:
            print(json.dumps(st, indent=1))
        else:
            for p in st["pods"]:
                print(f"{p['id']:16} {p['name'] or '-':40} {p['desiredStatus']:9} {p['ssh'] or '-':18} {p['zone']}")
            print(f"zones without capacity: {', '.join(st['no_capacity']) or 'none'}")
        return 0
    if cmd == "preempt" and len(args) in (1, 2):
        body = {"name": args[0]} | ({"gone_after": float(args[1])} if len(args) == 2 else {})
        r = lab.call("preempt", body)
        print(json.dumps(r))
        return 0 if "preempted" in r else 1
    if cmd == "capacity" and len(args) == 2 and args[1] in ("on", "off"):
        print(json.dumps(lab.call("capacity", {"zone": args[0], "on": args[1] == "on"})["no_capacity"]))
        return 0
    if cmd == "bill":
        b = lab.call("bill")
        if as_json:
            print(json.dumps(b, indent=1))
        else:
            for r in b["pods"]:
                print(f"{r['name'] or '-':40} {r['seconds']:9.1f} s  ${r['usd']:.6f}  {r['how'] or 'running'}")
            print(f"total ${b['total_usd']:.6f}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The Lambda lab's CLI (root): ``python -m tests.e2e.clouds.lambdalab COMMAND``.

    start                 build the runtime cache if missing, bridge, lab HOME, API emulator;
                          prints the environment to export (shell syntax)
    status [--json]       instances (id, name, status, ip, region), regions without capacity
    preempt NAME          the cloud takes the instance back (killed, gone from the list)
    capacity REGION on|off
    bill [--json]         instance-seconds × catalog price, per instance and total
    stop                  remove every namespace, veth, bridge, process and mount (idempotent)
    runtime               build the runtime cache only
    env                   print the environment to export
"""

from __future__ import annotations

import json
import shlex
import sys

from tests.e2e.clouds.lambdalab import lab, runtime


def _print_env(env: dict[str, str]) -> None:
    for k, v in env.items():
        print(f"export {k}={shlex.quote(v)}")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[0], argv[1:]
    as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    if cmd == "start":
        _print_env(lab.start(log=lambda m: print(m, file=sys.stderr)))
        return 0
    if cmd == "env":
        _print_env(lab.env())
        return 0
    if cmd == "serve":
        lab.serve()
        return 0
    if cmd == "runtime":
        print(json.dumps(runtime.build()))
        return 0
    if cmd == "stop":
        left = lab.stop(log=lambda m: print(m, file=sys.stderr))
        return 1 if any(left.values()) else 0
    if not lab.running():
        print("lab: not running (python -m tests.e2e.clouds.lambdalab start)", file=sys.stderr)
        return 1
    if cmd == "status":
        st = lab.call("status")
        if as_json:
            print(json.dumps(st, indent=1))
        else:
            for i in st["instances"]:
                print(f"{i['name'] or '-':40} {i['status']:12} {i['ip']:12} {i['region']['name']}")
            print(f"regions without capacity: {', '.join(st['no_capacity']) or 'none'}")
        return 0
    if cmd == "preempt" and len(args) == 1:
        r = lab.call("preempt", {"name": args[0]})
        print(json.dumps(r))
        return 0 if "preempted" in r else 1
    if cmd == "capacity" and len(args) == 2 and args[1] in ("on", "off"):
        print(json.dumps(lab.call("capacity", {"region": args[0], "on": args[1] == "on"})["no_capacity"]))
        return 0
    if cmd == "bill":
        b = lab.call("bill")
        if as_json:
            print(json.dumps(b, indent=1))
        else:
            for r in b["instances"]:
                print(f"{r['name'] or '-':40} {r['seconds']:9.1f} s  ${r['usd']:.6f}  {r['how'] or 'running'}")
            print(f"total ${b['total_usd']:.6f}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The Vast lab's CLI (root): ``python -m tests.e2e.clouds.vastlab COMMAND``.

    start                 runtime cache (shared with the other labs) + Vast wheels if missing,
                          bridge, lab HOME, REST emulator; prints the environment to export
    status [--json]       instances (id, label, actual_status, SSH, GPU, bid or on-demand)
    outbid NAME           a higher bid takes an interruptible instance's machine: stopped without
                          notice (actual_status exited), storage still billing
    capacity GPU on|off   e.g. ``capacity "H100 SXM" off`` (Vast's gpu_name): its offers leave the market
    bill [--json]         per instance: running seconds × the bid (or dph_base) + storage while it exists
    stop                  remove every namespace, veth, bridge, process of this lab (idempotent)
    env                   print the environment to export
"""

from __future__ import annotations

import json
import shlex
import sys

from tests.e2e.clouds.vastlab import lab


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
        print("vast lab: not running (python -m tests.e2e.clouds.vastlab start)", file=sys.stderr)
        return 1
    if cmd == "status":
        st = lab.call("status")
        if as_json:
            print(json.dumps(st, indent=1))
        else:
            for i in st["instances"]:
                kind = f"bid ${i['dph_total']:.4f}/h" if i["is_bid"] else "on-demand"
                print(f"{i['id']:10} {i['label'] or '-':40} {i['actual_status']:8} {i['ssh'] or '-':18} "
                      f"{i['num_gpus']}x {i['gpu_name']:10} {kind}")
            print(f"GPUs without capacity: {', '.join(st['no_capacity']) or 'none'}")
        return 0
    if cmd == "outbid" and len(args) == 1:
        r = lab.call("outbid", {"name": args[0]})
        print(json.dumps(r))
        return 0 if "outbid" in r else 1
    if cmd == "capacity" and len(args) == 2 and args[1] in ("on", "off"):
        print(json.dumps(lab.call("capacity", {"gpu": args[0], "on": args[1] == "on"})["no_capacity"]))
        return 0
    if cmd == "bill":
        b = lab.call("bill")
        if as_json:
            print(json.dumps(b, indent=1))
        else:
            for r in b["instances"]:
                print(f"{r['label'] or '-':40} {r['running_seconds']:9.1f} s run {r['exists_seconds']:9.1f} s "
                      f"exists  ${r['usd']:.6f}  {r['how'] or 'billing'}")
            print(f"total ${b['total_usd']:.6f}")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``python -m tests.e2e.clouds.pricelab [--mode CLOUD=slow|garbage ...] HOOK_DIR``: serve the three price
APIs on 127.0.0.1 until interrupted, printing the environment a fetcher process needs."""
import argparse
import signal
from pathlib import Path

from tests.e2e.clouds.pricelab.servers import PriceServers

ap = argparse.ArgumentParser()
ap.add_argument("hook_dir", type=Path)
ap.add_argument("--mode", action="append", default=[])
a = ap.parse_args()
srv = PriceServers(dict(m.split("=", 1) for m in a.mode)).start()
for k, v in srv.env(a.hook_dir).items():
    print(f"export {k}={v}")
print(f"export PYTHONPATH={a.hook_dir}:$PYTHONPATH")
try:
    signal.pause()
finally:
    srv.stop()

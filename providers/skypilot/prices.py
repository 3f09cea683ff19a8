"""Live prices: SkyPilot's own catalog fetchers, run for the clouds whose credentials are usable,
installed as SkyPilot's own catalog files (so SkyPilot's optimizer and launch see the prices dtrun
quotes), with a record of when.

``dtrun prices --refresh`` calls :func:`refresh`; the dry run calls :func:`refresh_stale`, which
refreshes only clouds dtrun has refreshed before and whose record is older than
:data:`MAX_AGE_HOURS` (a user who never asked for live prices gets no network calls from a dry
run). Each fetcher runs in its own process (``python -m providers.skypilot.fetch``) under a timeout;
nothing here imports ``sky``. A refresh that fails, times out or returns something that is not a
price list leaves the installed catalog as it was and says so in one line.

The record, ``$DTRUN_HOME/prices/<cloud>.json`` (read by ``providers.skypilot.catalog``): when the catalog was fetched, the fetcher's size
and mtime of the file it installed (a catalog replaced since — SkyPilot's own pull, a user's copy —
is no longer labelled live), the live spot figures (``spot.json`` of the fetch), and the last error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from providers.skypilot import credentials
from providers.skypilot.catalog import age_text, live_record, read_record, record_path, sky_catalog_path

CLOUDS = ("runpod", "vast", "lambda")
MAX_AGE_HOURS = 24.0
"""The dry run refreshes a cloud's live prices (once fetched by ``dtrun prices --refresh``) when
they are older than this; ``DTRUN_PRICES_MAX_AGE_HOURS`` overrides it (0: never automatically)."""
TIMEOUT_S = 180.0
"""All clouds together, run in parallel (the RunPod fetcher asks once per GPU type and count:
~250 queries); ``DTRUN_PRICES_TIMEOUT_S`` overrides it. The dry run's automatic refresh waits 60 s."""
SOURCES = {
    "runpod": "runpod api (SkyPilot fetch_runpod)",
    "vast": "vast api (SkyPilot fetch_vast + bid search)",
    "lambda": "lambda api (SkyPilot fetch_lambda_cloud)",
}


@dataclass
class RefreshResult:
    cloud: str
    ok: bool
    message: str
    rows: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"cloud": self.cloud, "ok": self.ok, "message": self.message, "rows": self.rows,
                "seconds": round(self.seconds, 3)}


def _write_record(cloud: str, **fields: Any) -> None:
    p = record_path(cloud)
    p.parent.mkdir(parents=True, exist_ok=True)
    rec = read_record(cloud) or {}
    rec.update(fields)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, sort_keys=True))
    tmp.replace(p)


def usable_clouds() -> dict[str, str | None]:
    """cloud → None when its credentials are usable, else why not (SkyPilot's offline check)."""
    return {c: credentials.problem(c) for c in CLOUDS}


def _validate(cloud: str, csv_path: Path) -> int:
    """GPU rows with a usable on-demand price in the fetched CSV (0: not a price list)."""
    import csv

    n = 0
    try:
        with csv_path.open(newline="") as f:
            for r in csv.DictReader(f):
                try:
                    if (r.get("AcceleratorName") or "").strip() and float(r.get("Price") or "nan") > 0:
                        n += 1
                except ValueError:
                    continue
    except (OSError, csv.Error, UnicodeDecodeError):
        return 0
    return n


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


def refresh(clouds: list[str] | None = None, timeout_s: float | None = None) -> list[RefreshResult]:
    """Run the fetchers (in parallel, one process each) for ``clouds`` (default: every cloud whose
    credentials are usable) and install what each returns. Never raises for a cloud's failure."""
    timeout_s = timeout_s if timeout_s is not None else _env_float("DTRUN_PRICES_TIMEOUT_S", TIMEOUT_S)

    usable = usable_clouds()
    wanted = clouds or [c for c in CLOUDS if usable[c] is None]
    results: list[RefreshResult] = []
    procs: dict[str, tuple[subprocess.Popen, Path, float]] = {}
    for c in wanted:
        if usable.get(c) is not None:
            results.append(RefreshResult(c, False, f"{c}: not refreshed: {usable[c]}"))
            continue
        work = Path(tempfile.mkdtemp(prefix=f"dtrun-prices-{c}-"))
        cmd = [sys.executable, "-m", "providers.skypilot.fetch", c, str(work / "out"), str(sky_catalog_path(c))]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, cwd=str(work))
        procs[c] = (p, work, time.monotonic())
    deadline = time.monotonic() + timeout_s
    for c, (p, work, t0) in procs.items():
        try:
            _out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            _out, err = p.communicate()
            timed_out = True
        secs = time.monotonic() - t0
        try:
            results.append(_install(c, p.returncode, err or "", work / "out", timed_out, timeout_s, secs))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return results


def _install(cloud: str, rc: int | None, err: str, out: Path, timed_out: bool, timeout_s: float,
             secs: float) -> RefreshResult:
    now = time.time()
    if timed_out:
        why = f"timed out after {timeout_s:g} s"
    elif rc != 0:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else f"the fetcher exited with {rc}"
    elif (n := _validate(cloud, out / "vms.csv")) == 0:
        why = "the fetcher's output holds no GPU price (not a price list)"
    else:
        dest = sky_catalog_path(cloud)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.dtrun-tmp")
        shutil.copyfile(out / "vms.csv", tmp)
        tmp.replace(dest)
        st = dest.stat()
        try:
            spot = json.loads((out / "spot.json").read_text())
        except (OSError, ValueError):
            spot = {}
        _write_record(cloud, fetched_at=now, size=st.st_size, mtime_ns=st.st_mtime_ns,
                      source=SOURCES[cloud], spot=spot, last_error=None, last_attempt_at=now)
        return RefreshResult(cloud, True, f"{cloud}: {n} GPU price rows from the {SOURCES[cloud]} → {dest}",
                             rows=n, seconds=secs)
    _write_record(cloud, last_error=why[:300], last_attempt_at=now)
    return RefreshResult(cloud, False, f"{cloud}: refresh failed ({why[:300]}); prices stay {fallback_text(cloud)}",
                         seconds=secs)


def fallback_text(cloud: str) -> str:
    """Where a cloud's prices come from when no fresh fetch is installed (for the one line)."""
    path = sky_catalog_path(cloud)
    rec = live_record(cloud, path)
    if rec:
        return f"those fetched {age_text(time.time() - rec['fetched_at'])}"
    if path.exists():
        return f"SkyPilot's cached catalog {path}"
    return "the bundled snapshot (providers/data/prices.yaml)"


def max_age_hours() -> float:
    return _env_float("DTRUN_PRICES_MAX_AGE_HOURS", MAX_AGE_HOURS)


def stale_clouds(clouds: list[str] | tuple[str, ...] = CLOUDS) -> list[str]:
    """Clouds dtrun has fetched live prices for before whose newest attempt is older than the
    maximum age (a failed attempt counts: a broken API is not retried on every dry run)."""
    limit = max_age_hours() * 3600.0
    if limit <= 0:
        return []
    now = time.time()
    out = []
    for c in clouds:
        rec = read_record(c)
        if not rec or not rec.get("fetched_at"):
            continue
        last = max(float(rec.get("fetched_at") or 0), float(rec.get("last_attempt_at") or 0))
        if now - last > limit:
            out.append(c)
    return out


def refresh_stale(clouds: list[str] | tuple[str, ...] = CLOUDS) -> list[RefreshResult]:
    stale = stale_clouds(clouds)
    return refresh(stale, timeout_s=min(60.0, _env_float("DTRUN_PRICES_TIMEOUT_S", 60.0))) if stale else []

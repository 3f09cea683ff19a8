"""What the dashboard pages read: the ``DataSource`` interface and ``EmbeddedSource``.

A data source answers three questions, each with plain JSON-ready dicts (the JSON endpoints
return them as they are, the HTML pages render them, so the two never disagree):

``runs() -> list[dict]``          one row per run (see ``run_row``)
``run(name) -> dict | None``      one run in full (see ``EmbeddedSource.run``); None: not visible
``stop(name) -> str``             do what ``dtrun down NAME`` does; returns a one-line message
``team() -> dict``                this month's spend against the team's ``monthly_usd``, per run and
                                  per member (see ``team_view``)

``EmbeddedSource`` reads this machine's state store (``$DTRUN_HOME/state.db``) and each run's run
URI (``progress.json``, ``metrics.jsonl``, through ``orchestrator.run.report.collect``, the same
reader as ``dtrun report``). On this machine there is no team: the team page is this store's runs
of the month, every one the local user's, with no monthly budget. ``dtrun server`` provides its own
source, scoped to one team (``orchestrator.server.dashboard_source.ServerSource``).
Nothing secret leaves a source: no spec text, no node handles beyond ids and regions.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Protocol

from orchestrator.run.state import TERMINAL_STATES, StateStore

LOG_TAIL_BYTES = 16_384
CURVE_POINTS = 400


class DataSource(Protocol):
    def runs(self) -> list[dict]: ...

    def run(self, name: str) -> dict | None: ...

    def stop(self, name: str) -> str: ...

    def team(self) -> dict: ...


def _offer_text(offer: dict) -> str:
    if not offer:
        return ""
    n = offer.get("nodes") or 1
    g = offer.get("gpus_per_node") or 1
    where = offer.get("region") or ""
    return f"{n}x{g} {offer.get('gpu', '?')} {where}".strip()


def _quote_per_hour(offer: dict) -> float | None:
    p = offer.get("spot_bid") if offer.get("spot") and offer.get("spot_bid") else offer.get("price_per_gpu_hour")
    if p is None:
        return None
    return float(p) * (offer.get("gpus_per_node") or 1) * (offer.get("nodes") or 1)


def run_row(job: dict, attempts: list[dict], spent: float, last_event: dict | None,
            member: str | None = None) -> dict:
    """The runs-table row of one job (the same dict for the HTML table and ``/api/runs``)."""
    last = attempts[-1] if attempts else None
    offer = (last or {}).get("offer") or {}
    budget = job.get("budget_usd")
    return {
        "name": job["name"], "state": job["state"], "reason": job.get("reason"),
        "provider": (last or {}).get("provider") or "", "offer": _offer_text(offer),
        "spot": bool(offer.get("spot")) if offer else None,
        "step": job.get("step") or 0, "steps": job.get("steps"),
        "tokens_per_s": job.get("tokens_per_s"), "loss": job.get("loss"),
        "spent_usd": round(spent, 4), "budget_usd": budget,
        "budget_frac": (min(1.0, spent / budget) if budget else None),
        "attempts": len(attempts), "steps_lost": job.get("steps_lost") or 0,
        "last_event": (f"{last_event['type']}: {last_event['message']}" if last_event else ""),
        "last_event_time": last_event["time"] if last_event else None,
        "updated": job.get("updated"), "created": job.get("created"), "member": member,
    }


def _thin(rows: list[dict], n: int = CURVE_POINTS) -> list[dict]:
    if len(rows) <= n:
        return rows
    k = len(rows) / n
    out = [rows[int(i * k)] for i in range(n)]
    if out[-1] is not rows[-1]:
        out.append(rows[-1])
    return out


def timeline(attempts: list[dict]) -> list[dict]:
    """Each attempt with its outcome, reason and the steps it lost (what it reached past the
    step the next attempt resumed from)."""
    out = []
    for i, a in enumerate(attempts):
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        lost = None
        if nxt is not None and a.get("end_step") is not None and nxt.get("start_step") is not None:
            lost = max(0, int(a["end_step"]) - int(nxt["start_step"]))
        out.append({"n": a["n"], "provider": a["provider"], "offer": _offer_text(a.get("offer") or {}),
                    "spot": bool((a.get("offer") or {}).get("spot")), "state": a["state"],
                    "outcome": a.get("outcome"), "reason": a.get("reason"),
                    "launched_at": a.get("launched_at") or a.get("created"), "running_at": a.get("running_at"),
                    "ended_at": a.get("ended_at"), "start_step": a.get("start_step"),
                    "end_step": a.get("end_step"), "steps_lost": lost})
    return out


def _log_tail(path: str | None) -> str:
    if not path or not os.path.isfile(path):
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - LOG_TAIL_BYTES))
        return f.read().decode("utf-8", "replace")


def month_start(now: float | None = None) -> float:
    """The start of this UTC month (the team month of ``orchestrator.server.budget``)."""
    t = dt.datetime.fromtimestamp(now, dt.timezone.utc) if now else dt.datetime.now(dt.timezone.utc)
    return dt.datetime(t.year, t.month, 1, tzinfo=dt.timezone.utc).timestamp()


def _local_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no name for this uid (a container): say so rather than fail the page
        return f"uid {os.getuid()}"


def team_view(team: str, monthly_usd: float | None, start: float, runs: list[dict]) -> dict:
    """The team page's dict: ``runs`` (name, state, member, spent_usd, estimate_usd, active) summed
    per member and in all, against ``monthly_usd``. Committed: what active runs are still expected to
    spend (estimate less spent, never below 0), as the server's budget check counts it."""
    spent = sum(r["spent_usd"] for r in runs)
    committed = sum(max(0.0, r["estimate_usd"] - r["spent_usd"]) for r in runs if r["active"])
    members: dict[str, dict] = {}
    for r in runs:
        m = members.setdefault(r["member"], {"member": r["member"], "runs": 0, "spent_usd": 0.0})
        m["runs"] += 1
        m["spent_usd"] = round(m["spent_usd"] + r["spent_usd"], 6)
    left = None if monthly_usd is None else monthly_usd - spent - committed
    return {"team": team, "month": dt.datetime.fromtimestamp(start, dt.timezone.utc).strftime("%Y-%m"),
            "month_start": start, "monthly_usd": monthly_usd, "spent_usd": round(spent, 6),
            "committed_usd": round(committed, 6), "left_usd": None if left is None else round(left, 6),
            "budget_frac": (min(1.0, spent / monthly_usd) if monthly_usd else None),
            "runs": sorted(runs, key=lambda r: -r["spent_usd"]),
            "members": sorted(members.values(), key=lambda m: -m["spent_usd"])}


def detail(store: StateStore, name: str) -> dict:
    """One run in full from a state store and its run URI (the job must exist in ``store``)."""
    from orchestrator.run.report import _spend_curve, collect

    d = collect(store, name)
    job, atts, spend = d["job"], d["attempts"], d["spend"]
    events = d["events"]
    row = run_row(job, atts, d["spent"], events[-1] if events else None, _local_user())
    t0 = min([s["billed_from"] for s in spend] or [job["created"]])
    t1 = max([s["billed_until"] for s in spend] or [t0])
    hours, usd = _spend_curve(spend, t0, t1, n=100)
    last = atts[-1] if atts else None
    quote = _quote_per_hour((last or {}).get("offer") or {})
    booked = spend[-1]["price_per_hour"] if spend else None
    est = d["estimate"] or {}
    train = [{"step": r.get("step"), "loss": r.get("loss"), "tokens_per_s": r.get("tokens_per_s"),
              "mfu": r.get("mfu")} for r in _thin(d["train"])]
    val = [{"step": r.get("step"), "val_loss": r.get("val_loss")} for r in _thin(d["val"])]
    nodes = [{"attempt": n["attempt"], "provider": n["provider"], "name": n["name"],
              "instance_id": n["instance_id"], "region": n.get("region"), "state": n["state"],
              "created": n["created"], "terminated_at": n.get("terminated_at")}
             for n in store.nodes(name)]
    return {
        **row, "val_loss": job.get("val_loss"), "last_committed_step": job.get("last_committed_step"),
        "train": train, "val": val, "spend_curve": {"hours": hours, "usd": usd},
        "timeline": timeline(atts), "nodes": nodes,
        "events": [{"id": e["id"], "time": e["time"], "type": e["type"], "message": e["message"]}
                   for e in events[-50:]],
        "log_tail": _log_tail((last or {}).get("log_path")),
        "quote_usd_per_hour": quote, "booked_usd_per_hour": booked,
        "estimate_usd": est.get("cost_usd") or est.get("usd") or est.get("cost"),
        "stoppable": job["state"] not in TERMINAL_STATES or bool(store.nodes(name, live_only=True)),
    }


class EmbeddedSource:
    """The dashboard's data over this machine's state store (``path``: the state.db file; ``now``:
    the clock the team page's month is taken from, the store's own where it is virtual)."""

    def __init__(self, path: str | Path | None = None, now: Callable[[], float] = time.time) -> None:
        self.store = StateStore(path)
        self.now = now

    def runs(self) -> list[dict]:
        s, member = self.store, _local_user()
        rows = []
        for job in s.list_jobs():
            ev = s.events(job["name"], limit=1)
            rows.append(run_row(job, s.attempts(job["name"]), s.spend_total(job["name"]), ev[-1] if ev else None,
                                member))
        return rows

    def run(self, name: str) -> dict | None:
        if self.store.get_job(name) is None:
            return None
        return detail(self.store, name)

    def team(self) -> dict:
        """The month's runs of this store (the rule of the server's team month: created or updated
        since the month began, or still active), each the local user's; no monthly budget here."""
        start = month_start(self.now())
        member = _local_user()
        runs = []
        for job in self.store.list_jobs():
            if job["created"] < start and (job.get("updated") or 0) < start and job["state"] in TERMINAL_STATES:
                continue
            est = json.loads(job["estimate_json"]) if job.get("estimate_json") else {}
            runs.append({"name": job["name"], "state": job["state"], "member": member,
                         "spent_usd": round(self.store.spend_total(job["name"]), 6),
                         "estimate_usd": float(est.get("cost_usd") or 0.0), "active": job["state"] not in TERMINAL_STATES})
        return team_view("this machine", None, start, runs)

    def stop(self, name: str) -> str:
        """What ``dtrun down NAME`` does: ask the job's controller to checkpoint and stop; with no
        controller alive, run ``dtrun down NAME --yes`` detached (it runs the teardown itself)."""
        row = self.store.get_job(name)
        if row is None:
            raise KeyError(name)
        if row["state"] in TERMINAL_STATES and not self.store.nodes(name, live_only=True):
            return f"{name} is already {row['state']}; nothing is running"
        self.store.request_action(name, "stop")
        if StateStore.controller_alive(row):
            return f"{name}: asking the trainer to checkpoint and stop (controller pid {row['controller_pid']})"
        env = dict(os.environ, DTRUN_HOME=str(Path(self.store.path).parent))
        subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "down", name, "--yes"], env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        return f"{name}: no controller is running; `dtrun down {name}` started to stop it"

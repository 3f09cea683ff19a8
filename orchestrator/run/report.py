"""``dtrun report``: one self-contained HTML file (PNGs embedded, and written beside it).

Reads what a job leaves, while it runs or after it ended: the state store (attempts with their
outcome, spend rows, the estimate, events) and the run URI (``metrics.jsonl`` training rows and
``val_loss`` rows, ``progress.json``, ``DONE``). Plots (matplotlib, Agg backend, imported here only):

* ``loss.png``: training loss and validation loss against tokens, each attempt's start marked;
* ``throughput.png``: tokens/s against tokens, MFU on a second axis when the GPU reported it;
* ``spend.png``: cumulative spend against wall time with the budget and the estimate as lines,
  attempt starts marked, preemptions in red.

Beside the plots: estimate vs actual (cost, wall hours, tokens/s) and the attempts table.
"""

from __future__ import annotations

import base64
import html
import json
import os
import time
from pathlib import Path
from typing import Any

from orchestrator.contract import runuri
from orchestrator.run.state import StateStore, dtrun_home

PLOTS = ("loss", "throughput", "spend")


def _metrics(run_uri: str) -> tuple[list[dict], list[dict]]:
    text = runuri.read_text(runuri.join(run_uri, runuri.METRICS)) or ""
    train, val = [], []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line while the trainer appends
        (val if "val_loss" in row else train).append(row)
    return train, val


def _spend_curve(spend: list[dict], t0: float, t1: float, n: int = 200) -> tuple[list[float], list[float]]:
    ts = [t0 + (t1 - t0) * i / (n - 1) for i in range(n)] if t1 > t0 else [t0]
    ys = []
    for t in ts:
        usd = 0.0
        for s in spend:
            secs = max(0.0, min(t, s["billed_until"]) - s["billed_from"])
            usd += s["price_per_hour"] * secs / 3600.0
        ys.append(usd)
    return [(t - t0) / 3600.0 for t in ts], ys


def collect(store: StateStore, name: str) -> dict[str, Any]:
    job = store.get_job(name)
    if job is None:
        from orchestrator.contract.errors import NotFoundError

        raise NotFoundError(f"no job named {name!r} (see `dtrun ls`)")
    run_uri = job["run_uri"]
    train, val = _metrics(run_uri)
    done = runuri.read_json(runuri.join(run_uri, runuri.DONE))
    progress = runuri.read_json(runuri.join(run_uri, runuri.PROGRESS))
    return {"job": job, "attempts": store.attempts(name), "spend": store.spend_by_attempt(name),
            "events": store.events(name), "train": train, "val": val, "done": done, "progress": progress,
            "estimate": json.loads(job["estimate_json"]) if job.get("estimate_json") else None,
            "spent": store.spend_total(name), "now": time.time()}


def _plots(d: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    job, train, val, atts = d["job"], d["train"], d["val"], d["attempts"]
    paths: dict[str, Path] = {}
    tok_per_step = None
    if train and train[-1].get("tokens") and train[-1].get("step"):
        tok_per_step = train[-1]["tokens"] / train[-1]["step"]

    def tokens(row: dict) -> float:
        if row.get("tokens") is not None:
            return row["tokens"]
        return row["step"] * (tok_per_step or 1)

    xlabel = "tokens" if tok_per_step or any(r.get("tokens") for r in val) else "steps"

    # attempt starts on the token axis: the first row of each attempt number
    starts: list[tuple[float, int, str]] = []
    outcome = {a["n"]: a.get("outcome") for a in atts}
    seen: set = set()
    for r in train:
        a = r.get("attempt")
        if a is not None and a not in seen:
            seen.add(a)
            if seen != {a}:
                starts.append((tokens(r), a, outcome.get(a - 1) or ""))

    fig, ax = plt.subplots(figsize=(8, 4.2))
    if train:
        ax.plot([tokens(r) for r in train], [r["loss"] for r in train], label="train loss", lw=1.2)
    if val:
        ax.plot([tokens(r) for r in val], [r["val_loss"] for r in val], "o-", label="validation loss", lw=1.5, ms=4)
    for x, a, prev in starts:
        ax.axvline(x, color="red" if prev == "preempted" else "grey", ls="--", lw=0.8)
        ax.text(x, ax.get_ylim()[1] if train or val else 1, f" attempt {a}" + (" (after preemption)" if prev == "preempted" else ""),
                fontsize=7, va="top", rotation=90, color="red" if prev == "preempted" else "grey")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{job['name']}: loss")
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no metrics yet", ha="center", transform=ax.transAxes)
    paths["loss"] = out_dir / "loss.png"
    fig.tight_layout()
    fig.savefig(paths["loss"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    rows = [r for r in train if r.get("tokens_per_s")]
    ax.plot([tokens(r) for r in rows], [r["tokens_per_s"] for r in rows], color="tab:green", label="tokens/s")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    mrows = [r for r in train if r.get("mfu") is not None]
    if mrows:
        ax2 = ax.twinx()
        ax2.plot([tokens(r) for r in mrows], [100 * r["mfu"] for r in mrows], color="tab:purple", label="MFU %")
        ax2.set_ylabel("MFU (%)")
    else:
        ax.text(0.99, 0.02, "MFU: not reported (CPU or unknown GPU)", ha="right", fontsize=7, transform=ax.transAxes)
    for x, a, prev in starts:
        ax.axvline(x, color="red" if prev == "preempted" else "grey", ls="--", lw=0.8)
    ax.set_title(f"{job['name']}: throughput")
    paths["throughput"] = out_dir / "throughput.png"
    fig.tight_layout()
    fig.savefig(paths["throughput"], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    t0 = job.get("started_at") or (atts[0]["created"] if atts else d["now"])
    t1 = job.get("finished_at") or d["now"]
    if d["spend"]:
        t1 = max(t1, max(s["billed_until"] for s in d["spend"]))
    hx, usd = _spend_curve(d["spend"], t0, t1)
    scale, unit = (1.0, "hours") if t1 - t0 >= 7200 else (60.0, "minutes")
    hx = [h * scale for h in hx]
    ax.plot(hx, usd, color="tab:orange", label="spend")
    if job.get("budget_usd"):
        ax.axhline(job["budget_usd"], color="black", lw=1, label=f"budget ${job['budget_usd']:.2f}")
    est = d["estimate"] or {}
    if est.get("cost_usd") is not None:
        ax.axhline(est["cost_usd"], color="tab:blue", ls=":", lw=1.2, label=f"estimate ${est['cost_usd']:.4f}")
    for a in atts:
        x = ((a.get("launched_at") or a["created"]) - t0) / 3600.0 * scale
        pre = a.get("outcome") == "preempted"
        ax.axvline(x, color="grey", ls="--", lw=0.8)
        if pre and a.get("ended_at"):
            ax.axvline((a["ended_at"] - t0) / 3600.0 * scale, color="red", lw=1.2)
            ax.text((a["ended_at"] - t0) / 3600.0 * scale, 0, f" preempted (attempt {a['n']})", color="red", fontsize=7,
                    rotation=90, va="bottom")
    ax.set_xlabel(f"wall {unit} since start")
    ax.set_ylabel("USD")
    ax.set_title(f"{job['name']}: spend")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    paths["spend"] = out_dir / "spend.png"
    fig.tight_layout()
    fig.savefig(paths["spend"], dpi=110)
    plt.close(fig)
    return paths


def _fmt(x: Any, spec: str = "", none: str = "—") -> str:
    if x is None:
        return none
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def render(store: StateStore, name: str, out: str | Path | None = None) -> Path:
    """Write the report; returns the HTML path (PNGs beside it)."""
    d = collect(store, name)
    out_path = Path(out) if out else dtrun_home() / "reports" / name / "report.html"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    paths = _plots(d, out_path.parent)
    job, est = d["job"], d["estimate"] or {}
    start = job.get("started_at")
    end = job.get("finished_at") or d["now"]
    wall_h = (end - start) / 3600.0 if start else None
    rates = [r["tokens_per_s"] for r in d["train"] if r.get("tokens_per_s")]
    bd = est.get("breakdown") or {}
    est_rate = (bd["tokens"] / bd["steps"] / bd["step_seconds"]
                if bd.get("tokens") and bd.get("steps") and bd.get("step_seconds") else None)
    e = html.escape
    imgs = "\n".join(
        f'<h2>{e(k)}</h2><img alt="{e(k)}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">'
        for k, p in paths.items())
    rows = "".join(
        f"<tr><td>{a['n']}</td><td>{e(a['provider'])}</td><td>{e(a['state'])}</td>"
        f"<td class='{'pre' if a.get('outcome') == 'preempted' else ''}'>{e(a.get('outcome') or '')}</td>"
        f"<td>{_fmt(a.get('start_step'))}</td><td>{_fmt(a.get('end_step'))}</td>"
        f"<td>{e(time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(a['created'])))}</td>"
        f"<td>{e((a.get('reason') or '').splitlines()[0] if a.get('reason') else '')}</td></tr>"
        for a in d["attempts"])
    last_val = d["val"][-1]["val_loss"] if d["val"] else (d["done"] or {}).get("val_loss")
    running = job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED", "OVER_BUDGET", "DEADLINE")
    doc = f"""<!doctype html><html><head><meta charset="utf-8"><title>dtrun report: {e(name)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:900px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}
.pre{{color:#c00;font-weight:bold}} img{{max-width:100%}}</style></head><body>
<h1>dtrun report: {e(name)}</h1>
<p>state <b>{e(job['state'])}</b>{' (still running: rerun dtrun report for fresh plots)' if running else ''} ·
step {_fmt(job.get('step'))}/{_fmt(job.get('steps'))} · train loss {_fmt(job.get('loss'), '.4f')} ·
validation loss {_fmt(last_val, '.4f')} · run URI <code>{e(job['run_uri'])}</code> ·
generated {e(time.strftime('%Y-%m-%d %H:%M:%S'))}</p>
<h2>estimate vs actual</h2>
<table><tr><th></th><th>estimate</th><th>actual</th></tr>
<tr><td>cost (USD)</td><td>{_fmt(est.get('cost_usd'), '.4f')} (expected {_fmt(est.get('expected_usd'), '.4f')})</td>
<td>{d['spent']:.4f}</td></tr>
<tr><td>wall hours</td><td>{_fmt(est.get('hours'), '.3f')}</td><td>{_fmt(wall_h, '.3f')}</td></tr>
<tr><td>tokens/s</td><td>{_fmt(est_rate, ',.0f')}</td><td>{_fmt(sum(rates) / len(rates) if rates else None, ',.0f')} (mean of logged rows)</td></tr>
<tr><td>MFU</td><td>{_fmt(bd.get('mfu'), '.0%')} (assumed)</td><td>{_fmt(next((r['mfu'] for r in reversed(d['train']) if r.get('mfu') is not None), None), '.1%', 'not reported (CPU)')}</td></tr>
<tr><td>budget (USD)</td><td colspan="2">{_fmt(job.get('budget_usd'), '.2f', 'no cap')}</td></tr>
<tr><td>attempts</td><td colspan="2">{len(d['attempts'])} ({sum(1 for a in d['attempts'] if a.get('outcome') == 'preempted')} preempted), steps lost {job.get('steps_lost') or 0}</td></tr>
</table>
{imgs}
<h2>attempts</h2>
<table><tr><th>#</th><th>provider</th><th>state</th><th>outcome</th><th>start step</th><th>end step</th><th>created</th><th>reason</th></tr>
{rows}</table>
</body></html>
"""
    tmp = out_path.with_suffix(".html.tmp")
    tmp.write_text(doc)
    os.replace(tmp, out_path)
    return out_path

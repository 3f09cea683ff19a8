"""HTML for the dashboard's pages, rendered on the server from a data source's dicts (no template
engine, no build step). Every number a page shows sits in an element with ``data-k="<key>"`` so
``static/dash.js`` can refresh it from the JSON endpoint, and a browser test can compare the two.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any
from urllib.parse import quote

POLL_MS = 2000
COLS = (("name", "run"), ("state", "state"), ("provider", "provider"), ("offer", "offer"), ("spot", "spot"),
        ("step", "step / total"), ("tokens_per_s", "tokens/s"), ("spent_usd", "spend / budget"),
        ("attempts", "attempts"), ("member", "member"), ("last_event", "last event"))


def fmt(key: str, v: Any) -> str:
    """How a page prints one value (dash.js mirrors it: ``fmt`` there)."""
    if v is None or v == "":
        return "—"
    if key == "spot":
        return "spot" if v else "on-demand"
    if key in ("spent_usd", "budget_usd", "estimate_usd", "quote_usd_per_hour", "booked_usd_per_hour",
               "monthly_usd", "committed_usd", "left_usd"):
        return f"${float(v):.2f}"
    if key in ("tokens_per_s",):
        return f"{float(v):,.0f}"
    if key in ("loss", "val_loss"):
        return f"{float(v):.4f}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def q(token: str) -> str:
    """The query string a link carries: ``?token=…`` for ``dtrun dashboard``'s URL token, nothing
    where the token travels in a header or a cookie (``dtrun server``)."""
    return f"?token={quote(token, safe='')}" if token else ""


def run_href(base: str, name: str, token: str) -> str:
    """The link to one run (the name URL-quoted: a name may hold any character the job file allows)."""
    return f"{base}runs/{quote(name, safe='')}{q(token)}"


def _page(title: str, body: str, token: str, data: dict, base: str) -> str:
    boot = json.dumps({"token": token, "poll_ms": POLL_MS, "base": base, **data}).replace("</", "<\\/")
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)} · dtrun</title>
<link rel="stylesheet" href="{escape(base)}static/uPlot.min.css{escape(q(token))}">
<style>
body{{font:14px system-ui,sans-serif;margin:16px;color:#222}} table{{border-collapse:collapse}}
td,th{{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;white-space:nowrap}}
th{{cursor:pointer;background:#f4f4f4}} .bar{{display:inline-block;width:90px;height:10px;background:#eee;
vertical-align:middle;margin-right:6px}} .bar i{{display:block;height:100%;background:#2a7}}
.bar i.hot{{background:#d33}} .st{{font-weight:600}} .RUNNING{{color:#2a7}} .RECOVERING{{color:#d80}}
.FAILED,.OVER_BUDGET{{color:#d33}} .SUCCEEDED{{color:#36c}} .charts{{display:flex;flex-wrap:wrap;gap:12px}}
pre{{background:#111;color:#ddd;padding:8px;max-height:260px;overflow:auto;font-size:12px}}
.preempted{{color:#d80}} .failed{{color:#d33}} .kv td:first-child{{color:#666}}
button.stop{{background:#d33;color:#fff;border:0;padding:6px 14px;border-radius:4px;cursor:pointer}}
</style></head><body>{body}
<script src="{escape(base)}static/uPlot.iife.min.js{escape(q(token))}"></script>
<script>window.DASH={boot};</script>
<script src="{escape(base)}static/dash.js{escape(q(token))}"></script></body></html>"""


def _bar(r: dict) -> str:
    frac = r.get("budget_frac")
    w = 0 if frac is None else round(frac * 100)
    hot = " class=hot" if frac is not None and frac >= 0.9 else ""
    return (f'<span class=bar><i{hot} style="width:{w}%"></i></span><span data-k="spent_usd">'
            f'{fmt("spent_usd", r["spent_usd"])}</span> / <span data-k="budget_usd">{fmt("budget_usd", r["budget_usd"])}</span>')


def _cell(r: dict, key: str, token: str, base: str) -> str:
    if key == "name":
        return f'<a href="{escape(run_href(base, r["name"], token))}">{escape(r["name"])}</a>'
    if key == "step":
        return f'<span data-k="step">{fmt("step", r["step"])}</span> / <span data-k="steps">{fmt("steps", r["steps"])}</span>'
    if key == "spent_usd":
        return _bar(r)
    cls = f' class="st {escape(str(r["state"]))}"' if key == "state" else ""
    return f'<span data-k="{key}"{cls}>{escape(fmt(key, r.get(key)))}</span>'


def runs_page(rows: list[dict], token: str, base: str = "/") -> str:
    head = "".join(f'<th data-sort="{k}">{escape(label)}</th>' for k, label in COLS)
    body = "".join(
        f'<tr data-run="{escape(r["name"])}" data-state="{escape(str(r["state"]))}">'
        + "".join(f"<td>{_cell(r, k, token, base)}</td>" for k, _ in COLS) + "</tr>"
        for r in rows)
    html = (f'<h1>dtrun · runs</h1><p><a id=team-link href="{escape(base)}team{escape(q(token))}">team: this month\'s spend</a></p>'
            f'<p><input id=filter placeholder="filter: name, state, provider…" size=40> '
            f'<span id=count>{len(rows)}</span> runs · <span id=updated></span></p>'
            f'<table id=runs><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>')
    return _page("runs", html, token, {"page": "runs"}, base)


def _kv(d: dict, keys: tuple[tuple[str, str], ...]) -> str:
    return "".join(f'<tr><td>{escape(label)}</td><td><span data-k="{k}">{escape(fmt(k, d.get(k)))}</span></td></tr>'
                   for k, label in keys)


def timeline_rows(tl: list[dict]) -> str:
    return "".join(
        f'<tr class="{escape(str(a.get("outcome") or ""))}" data-attempt="{a["n"]}"><td>{a["n"]}</td>'
        f'<td>{escape(a["provider"])} {escape(a["offer"])}{" (spot)" if a["spot"] else ""}</td>'
        f'<td>{escape(a["state"])}</td><td>{escape(str(a.get("outcome") or "—"))}</td>'
        f'<td>{escape(str(a.get("reason") or ""))}</td><td>{fmt("s", a.get("start_step"))} → {fmt("s", a.get("end_step"))}</td>'
        f'<td data-k="steps_lost">{fmt("s", a.get("steps_lost"))}</td></tr>' for a in tl)


def node_rows(nodes: list[dict]) -> str:
    return "".join(
        f'<tr><td>{n["attempt"]}</td><td>{escape(n["provider"])}</td><td>{escape(n["name"])}</td>'
        f'<td>{escape(n["instance_id"])}</td><td>{escape(str(n.get("region") or ""))}</td><td>{escape(n["state"])}</td>'
        f'<td>{"terminated" if n.get("terminated_at") else "live"}</td></tr>' for n in nodes)


def run_page(d: dict, token: str, base: str = "/") -> str:
    name = escape(d["name"])
    facts = _kv(d, (("state", "state"), ("reason", "reason"), ("provider", "provider"), ("offer", "offer"),
                    ("spot", "spot"), ("step", "step"), ("steps", "total steps"), ("loss", "loss"),
                    ("val_loss", "validation loss"), ("tokens_per_s", "tokens/s"), ("spent_usd", "spent"),
                    ("budget_usd", "budget"), ("estimate_usd", "estimate"), ("attempts", "attempts"),
                    ("steps_lost", "steps lost"), ("last_event", "last event")))
    money = _kv(d, (("quote_usd_per_hour", "quoted $/h"), ("booked_usd_per_hour", "booked $/h")))
    stop = ('<button class=stop id=stop>Stop…</button> <span id=stopmsg></span>' if d.get("stoppable")
            else '<span id=stopmsg></span>')
    html = f"""<p><a href="{escape(base)}{escape(q(token))}">← runs</a></p><h1>{name}</h1>{stop}
<div style="display:flex;gap:32px;flex-wrap:wrap"><table class=kv id=facts>{facts}</table>
<div><h3>quote vs booked</h3><table class=kv id=money>{money}</table></div></div>
<div class=charts><div id=loss><h3>loss</h3></div><div id=tps><h3>tokens/s</h3></div><div id=spend><h3>spend</h3></div></div>
<h3>attempts</h3><table id=timeline><thead><tr><th>#</th><th>offer</th><th>state</th><th>outcome</th><th>reason</th>
<th>steps</th><th>steps lost</th></tr></thead><tbody>{timeline_rows(d["timeline"])}</tbody></table>
<h3>nodes</h3><table id=nodes><thead><tr><th>attempt</th><th>provider</th><th>name</th><th>instance</th><th>region</th>
<th>state</th><th></th></tr></thead><tbody>{node_rows(d["nodes"])}</tbody></table>
<h3>log (following)</h3><pre id=log>{escape(d.get("log_tail") or "")}</pre>"""
    return _page(d["name"], html, token, {"page": "run", "run": d["name"], "data": d}, base)


def _money_bar(frac: float | None) -> str:
    w = 0 if frac is None else round(frac * 100)
    hot = " class=hot" if frac is not None and frac >= 0.9 else ""
    return f'<span class=bar style="width:240px"><i{hot} style="width:{w}%"></i></span>'


def team_page(t: dict, token: str, base: str = "/") -> str:
    """The month's spend against ``monthly_usd``, per run and per member (``DataSource.team``)."""
    head = _kv(t, (("team", "team"), ("month", "month (UTC)"), ("spent_usd", "spent"),
                   ("committed_usd", "running runs still expected to spend"), ("monthly_usd", "monthly budget"),
                   ("left_usd", "left")))
    members = "".join(
        f'<tr data-member="{escape(m["member"])}"><td>{escape(m["member"])}</td><td data-k="runs">{m["runs"]}</td>'
        f'<td data-k="spent_usd">{fmt("spent_usd", m["spent_usd"])}</td></tr>' for m in t["members"])
    runs = "".join(
        f'<tr data-run="{escape(r["name"])}"><td><a href="{escape(run_href(base, r["name"], token))}">{escape(r["name"])}</a></td>'
        f'<td data-k="state">{escape(str(r["state"]))}</td><td data-k="member">{escape(r["member"])}</td>'
        f'<td data-k="spent_usd">{fmt("spent_usd", r["spent_usd"])}</td>'
        f'<td data-k="estimate_usd">{fmt("estimate_usd", r["estimate_usd"])}</td></tr>' for r in t["runs"])
    html = f"""<p><a href="{escape(base)}{escape(q(token))}">← runs</a></p><h1>team · {escape(t["team"])}</h1>
<p id=month-bar>{_money_bar(t.get("budget_frac"))} <span data-k="spent_usd">{fmt("spent_usd", t["spent_usd"])}</span>
of <span data-k="monthly_usd">{fmt("monthly_usd", t["monthly_usd"])}</span> this month</p>
<table class=kv id=summary>{head}</table>
<h3>per member</h3><table id=members><thead><tr><th>member</th><th>runs</th><th>spent</th></tr></thead><tbody>{members}</tbody></table>
<h3>per run</h3><table id=teamruns><thead><tr><th>run</th><th>state</th><th>member</th><th>spent</th><th>estimate</th></tr></thead>
<tbody>{runs}</tbody></table>"""
    return _page("team", html, token, {"page": "team"}, base)


def login_page(message: str, action: str) -> str:
    """``dtrun server``'s sign-in form: the API token is posted once and kept in an HttpOnly cookie,
    so it never sits in a URL (access logs, history, Referer). No script on this page."""
    msg = f'<p style="color:#d33" id=loginmsg>{escape(message)}</p>' if message else ""
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>sign in · dtrun</title>
<style>body{{font:14px system-ui,sans-serif;margin:16px}}</style></head><body><h1>dtrun · sign in</h1>{msg}
<form method=post action="{escape(action)}"><label>API token <input type=password name=token id=token size=60
autocomplete=off></label> <button type=submit id=signin>sign in</button></form>
<p>A token from <code>dtrun server admin token</code>; the dashboard shows only your team's runs.</p></body></html>"""

"""The CLI's client seam to a ``dtrun server``: where the server is (``DTRUN_SERVER`` and
``DTRUN_TOKEN``, else what ``dtrun login`` saved in ``$DTRUN_HOME/server.json``, mode 0600), one
HTTP call (stdlib ``urllib``: the CLI stays light), and ``status``/``cost``/``down``/``up`` through
it. The dry run is computed by the server (``POST /v1/up``) and shown here by the same plan view
and exit codes as the embedded dry run; the team's budget refusal is exit 3. ``prices``,
``simulate`` and ``gc`` ask the server too and print with the embedded printers. Without a server
the commands run embedded, as before: :func:`target` is None.

A job file's relative paths are resolved here before it is sent, as the embedded CLI resolves them
(``orchestrator.plan.spec.anchor_paths``: against the job file's folder); a job to run on the
server that reads a local path (``trainer.data``/``val_data`` not a URI, ``command.code``) is
refused here (exit 2, naming the field): the server runs elsewhere and cannot read the laptop.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from orchestrator.contract.errors import (EXIT_INVALID, EXIT_NOT_FOUND, EXIT_OK, EXIT_PROVIDER, DtrunError)

LOGIN_FILE = "server.json"


class ServerError(DtrunError):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def login_path() -> Path:
    from orchestrator.run.statedb import dtrun_home

    return dtrun_home() / LOGIN_FILE


def target() -> tuple[str, str] | None:
    """(server URL, token), or None: the CLI runs embedded."""
    url = os.environ.get("DTRUN_SERVER")
    if url:
        token = os.environ.get("DTRUN_TOKEN", "")
        if not token:
            raise ServerError("DTRUN_TOKEN: DTRUN_SERVER is set but no token (set DTRUN_TOKEN or run "
                              "`dtrun login URL`)", EXIT_PROVIDER)
        return url.rstrip("/"), token
    p = login_path()
    if p.is_file():
        try:
            d = json.loads(p.read_text())
            return str(d["url"]).rstrip("/"), str(d["token"])
        except (ValueError, KeyError, TypeError):
            raise ServerError(f"{p}: unreadable login (run `dtrun login URL` again)", EXIT_INVALID) from None
    return None


def save_login(url: str, token: str) -> Path:
    p = login_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url.rstrip("/"), "token": token}, f)
    os.chmod(p, 0o600)
    return p


_CODES = {401: EXIT_PROVIDER, 403: EXIT_PROVIDER, 429: EXIT_PROVIDER, 404: EXIT_NOT_FOUND, 422: EXIT_INVALID}


def call(method: str, path: str, body: Any = None, where: tuple[str, str] | None = None,
         timeout: float = 60.0) -> dict[str, Any]:
    url, token = where or target()  # type: ignore[misc]
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            d = json.loads(e.read() or b"{}")
        except ValueError:
            d = {}
        code = d.get("exit_code") if isinstance(d.get("exit_code"), int) else _CODES.get(e.code, 1)
        err = ServerError(f"server: {d.get('error') or e.reason} (HTTP {e.code})", code)
        err.body = d  # type: ignore[attr-defined]
        raise err from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ServerError(f"server: cannot reach {url}: {getattr(e, 'reason', e)}", EXIT_PROVIDER) from None


def _out(d: Any) -> None:
    sys.stdout.write(json.dumps(d, indent=None, default=str) + "\n")


def status(job: str | None, json_out: bool) -> int:
    from urllib.parse import quote

    d = call("GET", f"/v1/jobs/{quote(job, safe='')}") if job else call("GET", "/v1/jobs")
    if json_out:
        _out(d)
        return EXIT_OK
    for j in d["jobs"] if not job else [d]:
        reason = f"  ({j['reason']})" if j.get("reason") else ""
        print(f"{j['name']:<24} {j['state']:<9} spent ${j['spend_usd'] or 0:,.2f} of est. "
              f"${j['estimate_usd']:,.2f}{reason}")
    return EXIT_OK


def cost(job: str | None, team: bool, json_out: bool) -> int:
    from urllib.parse import quote

    if team or not job:
        d = call("GET", "/v1/cost/team")
        if json_out:
            _out(d)
            return EXIT_OK
        cap = "no monthly budget" if d["monthly_usd"] is None else f"${d['monthly_usd']:,.2f} a month"
        print(f"team {d['team']}: {cap}; spent ${d['spent_usd']:,.2f}, running jobs still expected to spend "
              f"${d['committed_usd']:,.2f}" + ("" if d["left_usd"] is None else f", left ${d['left_usd']:,.2f}"))
        for j in d["jobs"]:
            print(f"  {j['name']:<24} {j['state']:<9} ${j['spend_usd'] or 0:,.2f} (est. ${j['estimate_usd']:,.2f})")
        return EXIT_OK
    d = call("GET", f"/v1/jobs/{quote(job, safe='')}/cost")
    if json_out:
        _out(d)
    else:
        print(f"{d['name']}: spent ${d['spend_usd'] or 0:,.2f} of est. ${d['estimate_usd']:,.2f} ({d['state']})")
    return EXIT_OK


def logs(job: str, follow: bool, poll_s: float = 2.0) -> int:
    """The job's events on the server; ``follow``: poll for new ones until the job has ended."""
    import time
    from datetime import datetime
    from urllib.parse import quote

    after = 0
    while True:
        d = call("GET", f"/v1/jobs/{quote(job, safe='')}/logs?after={after}")
        for e in d["events"]:
            stamp = datetime.fromtimestamp(e["time"]).strftime("%Y-%m-%d %H:%M:%S")
            print(f"{stamp} {e['kind']}: {e['text']}", flush=True)
            after = max(after, e["id"])
        if not follow or (d["state"] in ("finished", "failed", "stopped") and not d["events"]):
            return EXIT_OK
        time.sleep(poll_s)


def down(job: str, now: bool) -> int:
    from urllib.parse import quote

    d = call("POST", f"/v1/jobs/{quote(job, safe='')}/down", {"now": now})
    print(f"{d['name']}: {d['requested_action'] or d['state']} requested; the server's controller stops it")
    return EXIT_OK


def up(job: Path, *, dry_run: bool, yes: bool, json_out: bool, strict: bool, force: bool) -> int:
    """The server's dry run shown by the CLI's own plan view; then (not ``dry_run``) submit."""
    from orchestrator.cli.planview import json_default, plan_report, print_plan, print_refusals, verdict_exit_code
    from orchestrator.run.prepare import Prepared

    body = job_body(job, runs_there=True)
    try:
        d = call("POST", "/v1/up", {"spec": body})
    except ServerError as e:
        if json_out:
            _out({"error": str(e), "exit_code": e.exit_code, **getattr(e, "body", {})})
            return e.exit_code
        raise
    p = Prepared.from_dict(d["prepared"], source="server plan")
    report = plan_report(p.written, p.plan)
    report["team_month"] = d.get("team_month")
    code = verdict_exit_code(p.written, p.plan, report, strict, force)
    if json_out:
        report["exit_code"] = code
        sys.stdout.write(json.dumps(report, default=json_default) + "\n")
    else:
        print_plan(p.written, p.plan, report)
        print_refusals(p.plan, report, code, strict, force, str(job))
    if dry_run or code != EXIT_OK:
        return code
    if not yes:
        import typer

        if not typer.confirm("Submit this job to the server?", default=False):
            return EXIT_INVALID
    s = call("POST", "/v1/up", {"spec": body, "confirm": True})
    print(f"{s['job']['name']}: submitted to the server ({s['job']['state']}); `dtrun status {s['job']['name']}`")
    return EXIT_OK


def _local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def job_body(job: Path, *, runs_there: bool) -> dict[str, Any]:
    """The job file's mapping to send: validated here first (errors with line numbers), its
    relative paths resolved as the embedded CLI resolves them. ``runs_there`` (``up``): refuse
    (SpecError, exit 2) what reads a path on this machine — the server cannot."""
    import yaml

    from orchestrator.contract.errors import SpecError
    from orchestrator.plan.spec import load_spec

    spec = load_spec(job)
    body = yaml.safe_load(Path(job).read_text())
    if runs_there:
        where = target()
        url = where[0] if where else "the server"
        fix = (f"the server at {url} runs the job elsewhere and cannot read this machine's files: give a URI "
               "it can read (s3://…), or run embedded (unset DTRUN_SERVER, remove $DTRUN_HOME/server.json)")
        t = spec.trainer
        for field, value in (("data", t.data if t else "synthetic"), ("val_data", t.val_data if t else None)):
            if value not in (None, "synthetic") and _local(value):
                raise SpecError(f"{job}: trainer.{field}: {value} is a local path; {fix}")
        if spec.command is not None:
            raise SpecError(f"{job}: command.code: {spec.command.code} is a folder on this machine (user code is "
                            f"copied from a local folder); {fix}")
    ck = body.get("checkpoint")
    body["checkpoint"] = {**(ck if isinstance(ck, dict) else {}), "uri": spec.checkpoint.uri}
    if isinstance(body.get("trainer"), dict) and spec.trainer is not None:
        for field in ("data", "val_data"):
            if field in body["trainer"]:
                body["trainer"][field] = getattr(spec.trainer, field)
    if isinstance(body.get("command"), dict) and spec.command is not None:
        body["command"]["code"] = spec.command.code
    return body


def prices(gpu: str | None, spot: bool | None, refresh: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The server's price view (``GET /v1/prices``): (rows, capabilities), printed by the caller
    (``orchestrator.cli.prices``) as the embedded ones are."""
    from urllib.parse import urlencode

    from orchestrator.contract.errors import UsageError

    if refresh:
        raise UsageError("--refresh: the server keeps its own price catalogs; refresh them where it runs "
                         "(`dtrun prices --refresh` there, without DTRUN_SERVER)")
    q = {k: v for k, v in (("gpu", gpu), ("spot", None if spot is None else str(spot).lower())) if v is not None}
    d = call("GET", "/v1/prices" + (f"?{urlencode(q)}" if q else ""))
    return d["prices"], d["capabilities"]


def simulate(job: Path, preemptions_per_hour: float | None, runs: int, seed: int,
             **opts: Any) -> tuple[str, dict[str, Any]]:
    """``POST /v1/simulate``: (job name, the embedded report), printed by the caller
    (``orchestrator.cli.simulate``). The server caps the runs (422 naming ``runs``)."""
    body = {"spec": job_body(job, runs_there=False), "preemptions_per_hour": preemptions_per_hour,
            "runs": runs, "seed": seed, **opts}
    d = call("POST", "/v1/simulate", body, timeout=900.0)
    return d["name"], d["report"]


def _sweep_report(d: dict[str, Any]) -> Any:
    """A ``SweepReport`` rebuilt from its ``to_dict`` (the server's answer)."""
    from orchestrator.run.sweep import Orphan, SweepReport
    from providers.base import NodeState, OwnedInstance

    def state(v: Any) -> Any:
        try:
            return NodeState(v)
        except ValueError:
            return v

    return SweepReport(orphans=[Orphan(o["provider"], OwnedInstance(o["name"], o["instance_id"], state(o["state"]),
                                                                    o.get("region") or "", o.get("created_at"),
                                                                    o.get("owner")),
                                       o.get("job"), o["why"], o["outcome"], o.get("error") or "", bool(o["ours"]))
                                for o in d["orphans"]],
                       owned=int(d["owned"]), errors=dict(d["errors"]))


def gc(names: list[str], all_: bool) -> tuple[list[str], Any, Any]:
    """``dtrun gc`` on the server (``POST /v1/gc``: the caller's team's orphans): (providers,
    ``find()``, ``terminate(which)``) for the embedded ``orchestrator.cli.money._gc``, which lists,
    confirms and reports as embedded; the server terminates what it picks (as ``which`` does:
    names, ``all``, ours)."""
    ask = {"names": names, "all": all_}
    first = call("POST", "/v1/gc", {**ask, "terminate": False})

    def terminate(which: Any) -> Any:
        return _sweep_report(call("POST", "/v1/gc", {**ask, "terminate": True}, timeout=1800.0)["report"])

    return first["providers"], (lambda: _sweep_report(first["report"])), terminate

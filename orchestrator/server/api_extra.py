"""The server's ``prices``, ``simulate`` and ``gc`` routes (joined to the API by
``orchestrator.server.api.create_app``; the same token, error and no-traceback rules).

``GET /v1/prices[?gpu=&spot=]``
    The server's price view: the rows and capabilities of the embedded ``dtrun prices``
    (``orchestrator.cli.prices.price_view``), from the server's catalogs; nothing secret is in them.

``POST /v1/simulate``
    ``{"spec": <the job file's mapping>, "runs", "seed", "preemptions_per_hour", "no_capacity",
    "notice_seconds", "soft_fraction"}``: the spec validated by ``JobSpec`` (422 naming the field),
    then the embedded simulation (``orchestrator.run.simulate.simulate_job``), at most
    :data:`MAX_SIM_RUNS` runs (422 naming ``runs`` above it). The runs' cost grows with the job's
    hours times its preemption rate (a 3,000-hour job at 1/h: ~35 s for one run), so the simulation
    runs in a child process (``python -m orchestrator.server.simworker``) killed after
    :data:`SIM_TIMEOUT_S` (422 naming ``runs``: ask for fewer), at most :data:`SIM_CONCURRENT` at a
    time (429 beyond): a request never holds the API or a replica. The report is the embedded one,
    as JSON (non-finite numbers kept, as the CLI prints them).

``POST /v1/gc``
    ``{"names": [...], "all": false, "terminate": false}``: the orphan sweep of the server's
    controllers' state store (``orchestrator.run.sweep``), **scoped to the caller's team**. An
    orphan is the team's when this server launched it (its owner id is the server store's) for a
    job name that the team has and no other team has; the team's orphans are listed as "ours" and
    terminated (``terminate: true``) by any member. An orphan of another team's job (or of a name
    two teams share) is never listed nor touched, whoever asks. An orphan that no team's job owns
    (another dtrun home's or server's, an older dtrun's without an owner id, a job unknown here) is
    listed as "not ours" only to the team's admins, who may terminate it by name or with ``all``;
    a member asking ``all`` is refused (403, saying so). "owned" counts the team's live nodes only.
    A recorded live node of a server job not ended is never an orphan here, even when the process
    that recorded it is gone (embedded ``dtrun gc`` would say "controller gone"): after a replica is
    SIGKILLed another adopts the job and re-attaches to that node within one lease period.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any, Callable

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from sqlalchemy.engine import Engine

from orchestrator.contract.errors import DtrunError, SpecError
from orchestrator.server.db import session_scope
from orchestrator.server.models import TERMINAL, Job, User

MAX_SIM_RUNS = 1000
"""The most simulated runs one ``POST /v1/simulate`` computes (the CLI's default is 200)."""

SIM_TIMEOUT_S = 120.0
"""Wall seconds one simulation request may take on the server (its child process is killed after)."""

SIM_CONCURRENT = 2
"""Simulations running at once on one server (each a child process on one core)."""

MAX_GC_NAMES = 100

_sim_slots = threading.BoundedSemaphore(SIM_CONCURRENT)


class SimulateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    spec: dict[str, Any] = Field(description="the job, as the job file's mapping (validated by JobSpec)")
    preemptions_per_hour: float | None = None
    runs: int = Field(200, ge=1, le=MAX_SIM_RUNS)
    seed: int = 0
    no_capacity: float = 0.0
    notice_seconds: float | None = None
    soft_fraction: float | None = None


class GcBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    names: list[str] = Field(default_factory=list, max_length=MAX_GC_NAMES)
    all: bool = False
    terminate: bool = False


def add_extra_routes(app: FastAPI, engine: Engine, caller: Callable[..., tuple[int, int]],
                     get: Callable[[str], Any] | None, ApiError: type, store: Any = None) -> None:  # noqa: N803
    """The routes on ``app``; ``caller``: the API's token check; ``ApiError``: its error
    (status, one line, extra fields), passed in so this module never imports the API back."""
    @app.get("/v1/prices")
    def prices(gpu: str | None = None, spot: bool | None = None, who=Depends(caller)):
        from orchestrator.run.priceview import checked_gpu, price_view

        try:
            g = checked_gpu(gpu)
        except DtrunError as e:
            raise ApiError(422, f"gpu: {e}", exit_code=e.exit_code) from None
        rows, caps = price_view(g, spot)
        return {"gpu": g, "prices": rows, "capabilities": caps}

    @app.post("/v1/simulate")
    def simulate(body: SimulateBody, who=Depends(caller)):
        from orchestrator.plan.spec import parse_spec

        try:
            parse_spec(body.spec, source="spec")  # the field named here, before a process starts
        except SpecError as e:
            raise ApiError(422, str(e), exit_code=e.exit_code) from None
        if not _sim_slots.acquire(blocking=False):
            raise ApiError(429, f"the server is running {SIM_CONCURRENT} simulations; try again shortly")
        try:
            p = subprocess.run([sys.executable, "-m", "orchestrator.server.simworker"], input=body.model_dump_json(),
                               capture_output=True, text=True, timeout=SIM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ApiError(422, f"runs: {body.runs} simulated runs of this job take longer than the server's "
                                f"{SIM_TIMEOUT_S:.0f} s; ask for fewer runs (--runs)", exit_code=2) from None
        finally:
            _sim_slots.release()
        try:
            d = json.loads(p.stdout)
        except ValueError:
            d = None
        if not isinstance(d, dict) or p.returncode not in (0, 2):  # not a report nor a refusal: a bug
            raise RuntimeError(f"simulation worker exited {p.returncode}")
        if "error" in d:
            raise ApiError(422, d["error"], exit_code=d["exit_code"])
        # the worker's JSON as it is (not re-encoded): the embedded report's floats, NaN included
        return Response(p.stdout, media_type="application/json")

    @app.post("/v1/gc")
    def gc(body: GcBody | None = None, who=Depends(caller)):
        body = body or GcBody()
        with session_scope(engine) as s:
            admin = s.get(User, who[0]).role == "admin"
            rows = s.execute(select(Job.name, Job.team_id, Job.state)).all()
        if body.all and not admin:
            raise ApiError(403, "all: terminating instances that no job of the team owns is for the team's admins; "
                                "a member's gc lists and terminates the team's orphans (or names them)")
        mine = {n for n, t, _ in rows if t == who[1]}
        others = {n for n, t, _ in rows if t != who[1]}
        live = {n for n, _, st in rows if st not in TERMINAL}
        return team_sweep(mine, others, admin, body, get, live=live, store=store)


def _providers(names: list[str], get: Callable[[str], Any] | None) -> tuple[list[Any], dict[str, str]]:
    """The provider objects to list (one per provider name), and the names that could not load."""
    from providers import errors as perr
    from providers import registry

    out, seen, errors = [], set(), {}
    for n in names:
        try:
            p = (get or registry.get)(n)
        except (KeyError, ImportError, AttributeError, perr.ProviderError) as e:
            errors[n] = f"{type(e).__name__}: {e}"
            continue
        if p.name not in seen:
            seen.add(p.name)
            out.append(p)
    return out, errors


def team_sweep(mine: set[str], others: set[str], admin: bool, body: GcBody,
               get: Callable[[str], Any] | None, live: set[str] = frozenset(),  # type: ignore[assignment]
               store: Any = None) -> dict[str, Any]:
    """The sweep of the server's state store as the caller's team may see it (see the module
    docstring); with ``body.terminate``, what it picks terminated (confirmed) first. ``live``: the
    server's jobs not ended: a recorded live node of one of them is never an orphan here, even when
    the controller process that recorded it is gone (a replica SIGKILLed: another adopts the job
    and re-attaches to that node within one lease period)."""
    from orchestrator.run.state import ACTIVE_STATES, StateStore
    from orchestrator.run.sweep import find_orphans, gc_providers, terminate_orphans

    store = store if store is not None else StateStore()  # the server's CtlStore, else $DTRUN_HOME's file
    provs = gc_providers(store)
    entries, errors = _providers(provs, get)
    rep = find_orphans(store, entries)
    rep.errors.update(errors)

    def teams(o: Any) -> bool:
        return o.ours and o.job in mine and o.job not in others

    def unowned(o: Any) -> bool:
        return not (o.ours and o.job in (mine | others))

    def adopted(o: Any) -> bool:  # a node a replica re-attaches to (its job lives on the server)
        return o.job in live and (store.get_job(o.job) or {}).get("state") in ACTIVE_STATES and any(
            nd["provider"] == o.provider and str(nd["instance_id"]) == str(o.instance.instance_id)
            for nd in store.nodes(o.job, live_only=True))

    rep.orphans = [o for o in rep.orphans if not adopted(o) and (teams(o) or (admin and unowned(o)))]
    for o in rep.orphans:
        o.ours = teams(o)
    rep.owned = sum(len(store.nodes(n, live_only=True)) for n in mine
                    if (store.get_job(n) or {}).get("state") in ACTIVE_STATES)
    named = set(body.names)

    def picked(o: Any) -> bool:
        if named:
            return o.instance.name in named or str(o.instance.instance_id) in named
        return (body.all and admin) or o.ours

    if body.terminate:
        terminate_orphans(store, rep, providers={p.name: p for p in entries}, which=picked)
    return {"report": rep.to_dict(), "providers": provs}


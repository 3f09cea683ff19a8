"""One plan per ``dtrun up``: the prepare step that makes it, and the file that carries it.

:func:`prepare` plans once, on the spec the nodes will run: ``trainer.parallel: auto`` resolved to
the planner's degrees, micro-batch and activation checkpointing (the smallest plan even when none
fits, so the estimate prices what ``--force`` would rent), then the offers ranked on that spec,
the chosen one and its estimate, then ``checkpoint.every_steps: auto`` filled with the plan's
Young/Daly interval and the run URI made absolute. The result, :class:`Prepared`, is what the dry
run shows and what ``dtrun up`` shows, asks about, and hands to the controller: in this process
(``Controller(prepared.spec, store, plan=prepared.plan)``), or through :func:`save` /
:func:`load` to the detached controller, which then does not plan again.

When the confirmed plan cannot be used (its file is gone or unreadable, the job was re-planned
since, the chosen offer is no longer sold) :func:`confirmed` plans once more and returns why, for
the caller to record as a ``plan`` event. Pure planning: no torch, no provider SDK beyond the
offers the planner already reads.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from orchestrator.contract.errors import SpecError
from orchestrator.plan.estimate import Estimate, Plan, make_plan, requirements
from orchestrator.plan.spec import JobSpec, parse_spec, spec_to_yaml
from providers.base import Offer

RECORD_VERSION = 1
PLAN_FILE = "plan.json"

_OFFER, _OFFERS = ("chosen",), ("offers", "locked")
_ESTIMATE, _ESTIMATES = ("estimate",), ("estimates", "locked_estimates")


def run_spec(spec: JobSpec) -> JobSpec:
    """The layout the nodes will run: ``trainer.parallel: auto`` resolved to the planner's choice
    (degrees, micro-batch, activation checkpointing) — the smallest plan even when none fits, so
    the estimate prices what ``--force`` would rent. Explicit degrees: the spec itself."""
    if spec.trainer is None or spec.trainer.parallel != "auto":
        return spec
    from orchestrator.plan.planner import resolve_parallel

    try:
        return resolve_parallel(spec, force=True)
    except SpecError:
        return spec  # no valid layout at all: the memory plan reports it


def _with_interval(spec: JobSpec, plan: Plan) -> JobSpec:
    """``checkpoint.every_steps: auto`` → the plan's interval (Young/Daly for the chosen offer),
    and the run URI absolute (a detached controller or a node runs elsewhere than the directory
    ``dtrun up`` was typed in)."""
    ck: dict[str, Any] = {"uri": spec.run_uri}
    every = plan.checkpoint_every_steps
    if spec.checkpoint.every_steps == "auto" and isinstance(every, int) and every > 0:
        ck["every_steps"] = every
    return spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update=ck)})


@dataclass
class Prepared:
    """The plan of one ``dtrun up``: what the user confirmed and the controller launches."""

    spec: JobSpec
    """What the nodes run (auto resolved, interval filled, run URI absolute)."""
    written: JobSpec
    """The spec as written (what the report judges: what auto was allowed to change)."""
    plan: Plan
    """The offers ranked on ``spec``, the chosen one and its estimate."""
    spec_path: str | None = None
    made_at: float = field(default_factory=time.time)

    @property
    def chosen(self) -> Offer | None:
        return self.plan.chosen

    @property
    def estimate(self) -> Estimate | None:
        return self.plan.estimate

    @property
    def checkpoint_every_steps(self) -> int:
        return self.plan.checkpoint_every_steps

    def to_dict(self) -> dict[str, Any]:
        return {"version": RECORD_VERSION, "job": self.spec.name, "made_at": self.made_at,
                "spec_path": self.spec_path, "spec_yaml": spec_to_yaml(self.spec),
                # only what the user set: auto may change what was left open (YAML would pin it all)
                "written": self.written.model_dump(mode="json", exclude_unset=True),
                "plan": plan_to_dict(self.plan)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "<plan>") -> "Prepared":
        import yaml

        if d.get("version") != RECORD_VERSION:
            raise ValueError(f"{source}: plan record version {d.get('version')!r}, expected {RECORD_VERSION}")
        return cls(spec=parse_spec(yaml.safe_load(d["spec_yaml"]), source=source),
                   written=parse_spec(d["written"], source=source),
                   plan=plan_from_dict(d["plan"]), spec_path=d.get("spec_path"), made_at=float(d["made_at"]))


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """Every field of the plan, offers and estimates as their dicts (JSON-safe, lossless)."""
    out: dict[str, Any] = {}
    for f in fields(plan):
        v = getattr(plan, f.name)
        if f.name in _OFFER:
            out[f.name] = v.to_dict() if v is not None else None
        elif f.name in _OFFERS:
            out[f.name] = [o.to_dict() for o in v]
        elif f.name in _ESTIMATE:
            out[f.name] = v.to_dict() if v is not None else None
        elif f.name in _ESTIMATES:
            out[f.name] = [e.to_dict() for e in v]
        else:
            out[f.name] = v
    return out


def plan_from_dict(d: dict[str, Any]) -> Plan:
    kw: dict[str, Any] = {}
    for f in fields(Plan):
        if f.name not in d:
            continue
        v = d[f.name]
        if f.name in _OFFER:
            kw[f.name] = Offer.from_dict(v) if v is not None else None
        elif f.name in _OFFERS:
            kw[f.name] = [Offer.from_dict(o) for o in v]
        elif f.name in _ESTIMATE:
            kw[f.name] = Estimate(**v) if v is not None else None
        elif f.name in _ESTIMATES:
            kw[f.name] = [Estimate(**e) for e in v]
        else:
            kw[f.name] = v
    return Plan(**kw)


def prepare(written: JobSpec, *, spec_path: str | None = None, get: Callable[[str], Any] | None = None) -> Prepared:
    """Plan once on the spec the nodes will run (see the module docstring). ``get``: the provider
    by name (default ``providers.registry.get``); only providers whose credentials are in place
    are rented from (the others' offers are shown as needing credentials)."""
    spec = run_spec(written)
    plan = make_plan(spec, usable_only=True, get=get)
    return Prepared(spec=_with_interval(spec, plan), written=written, plan=plan, spec_path=spec_path)


def plan_path(name: str) -> Path:
    """Where ``dtrun up`` leaves the confirmed plan for the job's controller:
    ``$DTRUN_HOME/jobs/<name>/plan.json``."""
    from orchestrator.run.state import dtrun_home

    return dtrun_home() / "jobs" / name / PLAN_FILE


def save(p: Prepared, path: str | Path | None = None) -> Path:
    """Write the record (mode 0600, atomically); returns its path."""
    path = Path(path) if path is not None else plan_path(p.spec.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(p.to_dict(), f)
    os.replace(tmp, path)
    return path


def load(path: str | Path) -> Prepared:
    """The record :func:`save` wrote (``OSError``/``ValueError`` when it cannot be read)."""
    return Prepared.from_dict(json.loads(Path(path).read_text()), source=str(path))


def summary(p: Prepared) -> str:
    """One line: the chosen offer, the estimate and the checkpoint interval."""
    o, e = p.plan.chosen, p.plan.estimate
    if o is None or e is None:
        return "no offer chosen"
    every = p.spec.checkpoint.every_steps
    ck = "" if p.spec.command is not None else f", checkpoint every {every} steps"
    return f"{o.key()} at ${o.price_per_gpu_hour:.2f}/GPU-h, estimate ${e.cost_usd:,.2f} over {e.hours:.2f} h{ck}"


def still_offered(p: Prepared, get: Callable[[str], Any]) -> str | None:
    """None while the chosen offer is still sold (or its provider cannot say right now: the
    launch's own failover handles that); else why not."""
    o = p.plan.chosen
    if o is None:
        return None
    from providers import errors as perr

    try:
        found = get(o.provider).offers(requirements(p.spec))
    except perr.ProviderError:
        return None
    if any(x.key() == o.key() for x in found):
        return None
    return f"the confirmed offer {o.key()} is no longer offered by {o.provider}"


def confirmed(path: str | Path, get: Callable[[str], Any], *, spec_yaml: str | None = None,
              fallback: JobSpec | None = None, spec_path: str | None = None) -> tuple[Prepared, str | None]:
    """The plan confirmed at ``dtrun up`` (the record at ``path``), and None; or, when it cannot be
    used, a new plan and why. ``spec_yaml``: the spec the job is recorded with (a re-attach):
    the record counts only if it is that spec's. ``fallback``: the spec to plan on without a
    usable record (default: the record's spec as written). A re-attach keeps its nodes: the
    chosen offer is checked only for a new run."""
    why: str | None = None
    p: Prepared | None = None
    try:
        p = load(path)
    except FileNotFoundError:
        why = f"no confirmed plan at {path}"
    except (OSError, ValueError, KeyError, TypeError, SpecError) as e:
        why = f"the confirmed plan {path} cannot be read ({type(e).__name__}: {e})"
    written = fallback
    if p is not None and spec_yaml is not None:  # a re-attach: the record must be the job's spec
        if spec_to_yaml(p.spec) == spec_yaml:
            return p, None
        why = "the confirmed plan is not for the spec the job is recorded with"
    elif p is not None:  # a new run: launch what was confirmed while it is still sold
        why = still_offered(p, get)
        if why is None:
            return p, None
        written = p.written
    if written is None:
        raise ValueError(f"{why}, and no spec to plan on")
    again = prepare(written, spec_path=spec_path or (p.spec_path if p else None), get=get)
    return again, f"{why}: planned again: {summary(again)}"

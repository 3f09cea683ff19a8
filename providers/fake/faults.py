"""Scripted and random API faults of the fake cloud.

``inject(op, error, count=1, match="*", create=False)`` queues a fault: the next ``count`` calls
of ``op`` whose instance name, id, region or offer key matches ``match`` (or whose name starts
with it) raise ``error``; ``count=None`` means until cleared. ``create=True`` lets a failing
launch still create (and bill) the instance. ``transient_rate`` (config) is a seeded probability
that any launch/poll/terminate call raises Transient.
"""

from __future__ import annotations

from typing import Any

from providers import errors as perr
from providers.fake.store import seeded

ERRORS: dict[str, type[perr.ProviderError]] = {
    "NoCapacity": perr.NoCapacity,
    "QuotaExceeded": perr.QuotaExceeded,
    "AuthError": perr.AuthError,
    "Transient": perr.Transient,
    "NotSupported": perr.NotSupported,
    "TerminateNotConfirmed": perr.TerminateNotConfirmed,
}
OPS = ("launch", "poll", "terminate", "list_owned", "offers")


def new_fault(op: str, error: str, count: int | None, match: str, create: bool) -> dict[str, Any]:
    """A fault record for the state's ``faults`` list (ValueError for an unknown op or error)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, not {op!r}")
    if error not in ERRORS:
        raise ValueError(f"error must be one of {sorted(ERRORS)}, not {error!r}")
    return {"op": op, "error": error, "remaining": count, "match": match, "create": bool(create)}


def next_fault(st: dict[str, Any], op: str, subject: dict[str, Any] | None,
               want_create: bool = False) -> Any:
    """The error this call of ``op`` on ``subject`` raises, or None (counting the fault used).
    With ``want_create``: ``(error or None, whether the launch still creates the instance)``."""
    subject = subject or {}
    for f in st["faults"]:
        if f["op"] != op or f["remaining"] == 0:
            continue
        if f["match"] != "*" and f["match"] not in {v for v in subject.values() if v} and not (
                subject.get("name", "").startswith(f["match"])):
            continue
        if f["remaining"] is not None:
            f["remaining"] -= 1
        what = subject.get("name") or subject.get("id") or op
        err = ERRORS[f["error"]](f"fake cloud: injected {f['error']} on {op} ({what})", provider="fake")
        return (err, f["create"]) if want_create else err
    st["faults"] = [f for f in st["faults"] if f["remaining"] != 0]
    rate = float(st["config"]["transient_rate"])
    if rate > 0 and op in ("launch", "poll", "terminate"):
        if seeded(st, "transient", st["calls"]).random() < rate:
            err = perr.Transient(f"fake cloud: random API fault on {op} (HTTP 503)", provider="fake")
            return (err, False) if want_create else err
    return (None, False) if want_create else None

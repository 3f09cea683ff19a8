"""SkyPilot's exceptions → dtrun's provider errors (``providers.errors``).

One table (:data:`ERROR_TABLE`) maps ``sky.exceptions`` classes by name; a resources-unavailable
error is read through its failover history (every region's own reason: quota, funds, capacity,
or a cloud that is not enabled); messages keep every region's reason with ANSI codes stripped.
``sky`` is imported only when an error is classified.
"""

from __future__ import annotations

import re
from typing import Any

from providers import errors as perr
from providers.skypilot import credentials

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
MAX_MESSAGE = 3000

# SkyPilot's exception classes (``sky.exceptions``, 0.14.1) → dtrun's error, checked in order
# (subclasses before their bases). A test asserts every name exists in SkyPilot, so a rename
# there fails here instead of silently falling through to a generic error.
ERROR_TABLE: tuple[tuple[str, type[perr.ProviderError]], ...] = (
    ("NoCloudAccessError", perr.AuthError),                 # no cloud enabled at all
    ("InvalidCloudCredentials", perr.AuthError),
    ("CloudUserIdentityError", perr.AuthError),
    ("ClusterOwnerIdentityMismatchError", perr.AuthError),
    ("InvalidCloudConfigs", perr.AuthError),
    ("ApiServerAuthenticationError", perr.AuthError),
    ("NoWorkspaceAccessError", perr.AuthError),
    ("PermissionDeniedError", perr.AuthError),
    ("ProvisionUnsupportedError", perr.NotSupported),       # this offer can never be served
    ("NotSupportedError", perr.NotSupported),
    ("ResourcesMismatchError", perr.NotSupported),
    ("InvalidClusterNameError", perr.NotSupported),
    ("UserRequestRejectedByPolicy", perr.NotSupported),
    ("APIVersionMismatchError", perr.NotSupported),
    ("APINotSupportedError", perr.NotSupported),
    ("ApiServerConnectionError", perr.Transient),            # the local API server: retry
    ("ServerTemporarilyUnavailableError", perr.Transient),
    ("RequestInterruptedError", perr.Transient),
    ("RequestCancelled", perr.Transient),
    ("ConcurrentWorkerExhaustedError", perr.Transient),
    ("ExecutionRetryableError", perr.Transient),
    ("CloudError", perr.Transient),                          # a cloud API / catalog fetch fault
    ("NetworkError", perr.Transient),
    ("ClusterStatusFetchingError", perr.Transient),
    ("FetchClusterInfoError", perr.Transient),
    ("SkyletUnavailableError", perr.Transient),
)
# ``requests``/``urllib3``/builtin network faults (by class name: they come through the SDK).
_TRANSIENT_NAMES = {"ConnectionError", "Timeout", "ReadTimeout", "ConnectTimeout", "TimeoutError",
                    "ConnectionResetError", "ConnectionRefusedError", "ChunkedEncodingError"}
_QUOTA_RE = re.compile(r"quota|limit exceeded|insufficient (funds|balance|credit)|spend(ing)? limit|"
                       r"balance|not enough (funds|credit)", re.I)
_AUTH_RE = re.compile(r"credential|unauthori[sz]ed|forbidden|api key|\b401\b|\b403\b", re.I)
_NOT_ENABLED_RE = re.compile(r"which (is|are) not enabled|sky check", re.I)
HALF_DEAD = ("SkyPilot's local API server did not answer or could not start (a half-dead server: "
             "a leftover process on its port or executors still running). Run `sky api stop` (then, "
             "if `sky api status` still shows one, end the leftover `sky.server` processes) and "
             "retry; its log: ~/.sky/api_server/server.log")


def clean(text: str) -> str:
    """ANSI colour codes and SkyPilot's payload markers stripped, whitespace trimmed."""
    text = _ANSI.sub("", text or "")
    text = re.sub(r"<sky-payload>.*?</sky-payload>", "", text, flags=re.S)
    return text.strip()


def _sky_exceptions() -> Any:
    try:
        from sky import exceptions
    except ImportError:  # pragma: no cover - the skypilot extra is part of the install
        return None
    return exceptions


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def is_named(e: BaseException, name: str) -> bool:
    """``e`` is (a subclass of) the class called ``name`` (SkyPilot is not imported to tell)."""
    return name in _names(e)


def _classify(e: BaseException) -> type[perr.ProviderError] | None:
    exc = _sky_exceptions()
    for name, target in ERROR_TABLE:
        cls = getattr(exc, name, None) if exc is not None else None
        if (cls is not None and isinstance(e, cls)) or (cls is None and is_named(e, name)):
            return target
    return None


def _unavailable(e: BaseException, provider: str, msg: str) -> perr.ProviderError:
    """``ResourcesUnavailableError``: what SkyPilot's failover over the allowed regions found."""
    text = clean(str(e))
    if _NOT_ENABLED_RE.search(text):
        # SkyPilot's check for this cloud failed (missing or rejected key): not capacity.
        why = credentials.problem(provider) if provider in credentials.FILES else None
        fix = credentials.message(provider, why or "SkyPilot reports the cloud as not enabled (its "
                                  "credential check failed: the key may be wrong or revoked)")
        return perr.AuthError(f"{fix} (SkyPilot: {text.splitlines()[0]})", provider=provider)
    history = list(getattr(e, "failover_history", None) or [])
    if history and all(is_named(h, "ProvisionUnsupportedError") for h in history):
        return perr.NotSupported(msg, provider=provider)
    reasons = [clean(str(h)) for h in history] or [text]
    if reasons and all(_QUOTA_RE.search(r) for r in reasons):
        return perr.QuotaExceeded(msg, provider=provider)
    return perr.NoCapacity(msg, provider=provider)


def map_sky_error(e: BaseException, provider: str) -> perr.ProviderError:
    """SkyPilot's exception → dtrun's provider error, keeping every region's reason (ANSI
    stripped, at most ``MAX_MESSAGE`` characters)."""
    if isinstance(e, perr.ProviderError):
        return e
    text = clean(str(e))
    if len(text) > MAX_MESSAGE:
        text = text[:MAX_MESSAGE] + " …"
    msg = f"{provider} (SkyPilot): {type(e).__name__}" + (f": {text}" if text else "")
    if is_named(e, "ResourcesUnavailableError"):
        return _unavailable(e, provider, msg)
    if is_named(e, "NoCloudAccessError") and provider in credentials.FILES:
        why = credentials.problem(provider) or "SkyPilot has no cloud enabled"
        return perr.AuthError(f"{credentials.message(provider, why)} (SkyPilot: {text})", provider=provider)
    if is_named(e, "ProvisionPrechecksError"):
        reasons = getattr(e, "reasons", []) or []
        if any(_classify(r) is perr.AuthError or _AUTH_RE.search(str(r)) for r in reasons):
            return perr.AuthError(msg + "".join(f"; {clean(str(r))}" for r in reasons), provider=provider)
        return perr.NotSupported(msg + "".join(f"; {clean(str(r))}" for r in reasons), provider=provider)
    target = _classify(e)
    if target is not None:
        return target(msg, provider=provider)
    if _names(e) & _TRANSIENT_NAMES:
        return perr.Transient(msg, provider=provider)
    if isinstance(e, RuntimeError) and "API server" in text:
        return perr.Transient(f"{provider} (SkyPilot): {HALF_DEAD} ({text.splitlines()[0]})", provider=provider)
    if isinstance(e, ValueError) and re.search(r"Invalid (region|zone|instance type)", text):
        return perr.NotSupported(msg, provider=provider)  # SkyPilot's optimizer rejected a name
    if _QUOTA_RE.search(text):
        return perr.QuotaExceeded(msg, provider=provider)
    return perr.ProviderError(msg, provider=provider)

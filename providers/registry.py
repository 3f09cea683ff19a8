"""Provider lookup. Imports each provider's module only when it is asked for, so importing
dtrun (and the CLI's fast paths) never imports sky, modal or torch."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from providers.base import Provider

# name -> (module, class, fixed kwargs)
_PROVIDERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "fake": ("providers.fake", "shared_cloud", {}),  # file-backed: CLI processes share it
    "local": ("providers.local", "LocalProvider", {}),
    "runpod": ("providers.skypilot", "SkyPilotProvider", {"cloud": "runpod"}),
    "lambda": ("providers.skypilot", "SkyPilotProvider", {"cloud": "lambda"}),
    "vast": ("providers.skypilot", "SkyPilotProvider", {"cloud": "vast"}),
    "modal": ("providers.modal", "ModalProvider", {}),
}

_overrides: dict[str, Provider] = {}


def names() -> list[str]:
    return list(_PROVIDERS)


def get(name: str, **kwargs: Any) -> Provider:
    """The provider called ``name`` (an instance registered with ``register`` wins)."""
    if name in _overrides:
        return _overrides[name]
    try:
        module, cls, fixed = _PROVIDERS[name]
    except KeyError:
        raise KeyError(f"unknown provider {name!r}; known: {', '.join(_PROVIDERS)}") from None
    mod = importlib.import_module(module)
    return getattr(mod, cls)(**fixed, **kwargs)


def register(name: str, provider: Provider) -> None:
    """Use this instance for ``name`` in this process (tests, ``dtrun simulate``)."""
    _overrides[name] = provider


def unregister(name: str) -> None:
    _overrides.pop(name, None)


def close_all() -> None:
    """A command that used providers is done: each provider whose module this process loaded
    releases what it started here (SkyPilot: the local API server dtrun started)."""
    for name, (module, _cls, _fixed) in _PROVIDERS.items():
        if module in sys.modules or name in _overrides:
            get(name).close()

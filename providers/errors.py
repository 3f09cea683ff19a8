"""Provider errors: one hierarchy the controller understands.

``Transient`` is the only one retried (with backoff); the others are decisions: try the next
offer (``NoCapacity``, ``QuotaExceeded``), stop and tell the user (``AuthError``,
``NotSupported``), or poll again (``TerminateNotConfirmed``).
"""

from __future__ import annotations


class ProviderError(Exception):
    """Base of every error a provider raises across the interface."""

    def __init__(self, message: str, *, provider: str = "") -> None:
        super().__init__(message)
        self.provider = provider


class NoCapacity(ProviderError):
    """The offer has no capacity now (try another region/offer, or later)."""


class QuotaExceeded(ProviderError):
    """The account's quota or spending limit blocks this launch."""


class AuthError(ProviderError):
    """Missing or rejected credentials. The message names what to set; never the secret."""


class Transient(ProviderError):
    """A passing API fault (429, 5xx, timeout): retry with backoff."""


class NotSupported(ProviderError):
    """The provider cannot do what was asked (e.g. multi-node on RunPod through SkyPilot)."""


class TerminateNotConfirmed(ProviderError):
    """terminate() was sent but the instance is not gone yet: poll terminate() again."""

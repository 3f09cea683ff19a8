"""Trainer errors: ``ConfigError`` means "do not retry" (one line, exit 2); ``CheckpointUnavailable`` is
retryable (one line, exit 1)."""

from __future__ import annotations


class ConfigError(Exception):
    """Invalid configuration, unusable run URI or a checkpoint of another shape (exit 2)."""


class CheckpointUnavailable(RuntimeError):
    """The storage kept failing while reading a COMMITTED checkpoint: end this attempt (exit 1,
    retried by the controller) with every checkpoint left in place."""


class SavesFailing(CheckpointUnavailable):
    """``checkpoint.MAX_FAILED_SAVES`` saves in a row failed: stop (exit 1) rather than train on
    for hours with nothing that a preemption would keep. Raised on the rank that saw it."""

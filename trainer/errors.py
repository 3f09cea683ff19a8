"""Trainer errors: ``ConfigError`` means "do not retry" (one line, exit 2); ``CheckpointUnavailable`` is
retryable (one line, exit 1).

``ConfigError`` itself lives in the dataset contract (``orchestrator.contract.dataset``), below the
trainer and the orchestrator, because the shard listing both sides share raises it; the trainer
raises it for every configuration problem (invalid configuration, unusable run URI, a checkpoint of
another shape) and names it from here.
"""

from __future__ import annotations

from orchestrator.contract.dataset import ConfigError

__all__ = ["CheckpointUnavailable", "ConfigError", "SavesFailing"]


class CheckpointUnavailable(RuntimeError):
    """The storage kept failing while reading a COMMITTED checkpoint: end this attempt (exit 1,
    retried by the controller) with every checkpoint left in place."""


class SavesFailing(CheckpointUnavailable):
    """``checkpoint.MAX_FAILED_SAVES`` saves in a row failed: stop (exit 1) rather than train on
    for hours with nothing that a preemption would keep. Raised on the rank that saw it."""

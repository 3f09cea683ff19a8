"""Trainer errors that mean "do not retry": the entry point prints one line and exits 2."""

from __future__ import annotations


class ConfigError(Exception):
    """Invalid configuration, unusable run URI or a checkpoint of another shape (exit 2)."""

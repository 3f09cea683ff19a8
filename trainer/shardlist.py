"""Which token shards a data URI holds: the listing rule the trainer's loader and the
orchestrator's before-renting check share. Standard library only (the dry run imports it)."""

from __future__ import annotations

import os
import re
from typing import Any

from trainer.errors import ConfigError

_VAL = re.compile(r"(^|[^a-z])val(id(ation)?)?([^a-z]|$)")


def is_validation(path: str) -> bool:
    """True for a validation shard's name (``fineweb_val_000000.bin``, ``val_000001.bin``)."""
    return bool(_VAL.search(os.path.basename(path).lower()))


def list_shards(fs: Any, path: str, uri: str, field: str, *, which: str) -> list[str]:
    """The shard files at ``path``: ``which`` = train (validation names left out), val (only those),
    val_or_all (the validation-named ones if any, else all)."""
    try:
        if any(ch in path for ch in "*?["):
            files = fs.glob(path)
        elif fs.isdir(path):
            files = [f for f in fs.ls(path, detail=False) if f.endswith((".bin", ".npy"))]
        else:
            return [path] if fs.exists(path) else []
    except Exception as e:  # noqa: BLE001 - any storage error here is a config problem
        raise ConfigError(f"{field}: cannot list {uri}: {e}") from None
    files = sorted(f for f in files if not f.endswith((".json", ".tmp")))  # data prepare's manifest, partials
    if which == "val":
        return [f for f in files if is_validation(f)]
    if which == "val_or_all":  # trainer.val_data: its validation-named shards if it has any
        return [f for f in files if is_validation(f)] or files
    if which == "train":
        val = [f for f in files if is_validation(f)]
        files = [f for f in files if not is_validation(f)]
        if val and not files:
            raise ConfigError(f"{field}: {uri} holds only validation shards ({os.path.basename(val[0])} …); "
                              "point trainer.data at the training shards and trainer.val_data at these")
    return files

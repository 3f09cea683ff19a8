"""The dataset contract: which token shards a data URI holds, and the manifest beside them.

Shared by the trainer (its loader lists ``trainer.data`` with :func:`list_shards`; ``dtrun data
prepare`` writes the manifest) and the orchestrator (``dtrun up`` and ``dtrun check`` list the same
shards and read the same manifest before anything is rented), so both sides agree on one rule.

Shards: ``.bin`` (llm.c's format, ``trainer/shards.py``) or ``.npy`` files — one file, a folder
(its shard files) or a glob. A name holding ``val`` (llm.c's ``fineweb_val_000000.bin``, ``data
prepare``'s ``val_000000.bin``) is a validation shard and never joins the training stream.

Manifest: ``manifest.json`` in the shards' folder, written last by ``dtrun data prepare`` (present
= the preparation is complete). JSON: ``format`` (:data:`MANIFEST_FORMAT`), ``vocab_size`` (the
tokenizer's vocabulary: a model with fewer embeddings is refused), ``tokenizer`` (``name``,
``sha256``, …), ``dtype``, ``shard_tokens``, ``val_tokens``, ``documents``, ``sources``, and
``train`` / ``val`` (``tokens``; ``shards``: name, tokens, sha256).

Standard library only; remote URIs are read through ``orchestrator.contract.runuri`` (fsspec,
imported lazily there), and :func:`list_shards` takes the caller's fsspec filesystem.
"""

from __future__ import annotations

import os
import re
from typing import Any

from orchestrator.contract import runuri

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "dtrun-shards/1"
"""The manifest's ``format``: the layout ``dtrun data prepare`` writes."""
SHARD_SUFFIXES = (".bin", ".npy")

_VAL = re.compile(r"(^|[^a-z])val(id(ation)?)?([^a-z]|$)")


class ConfigError(Exception):
    """A configuration the run cannot work with: do not retry. On a node the trainer prints it in
    one line and exits ``runuri.EXIT_BAD_CONFIG`` (2); before renting, ``dtrun up`` reports it.

    Defined here, below both sides, because the shard listing raises it (data that cannot be
    listed, or only validation shards where training shards are needed) and both sides catch it;
    the trainer raises it for its other configuration problems too (``trainer.errors``)."""


def is_validation(path: str) -> bool:
    """True for a validation shard's name (``fineweb_val_000000.bin``, ``val_000001.bin``)."""
    return bool(_VAL.search(os.path.basename(path).lower()))


def list_shards(fs: Any, path: str, uri: str, field: str, *, which: str) -> list[str]:
    """The shard files at ``path`` on ``fs`` (``uri`` and ``field`` name it in messages): ``which``
    = train (validation names left out), val (only those), val_or_all (the validation-named ones if
    any, else all). Raises :class:`ConfigError` when the storage cannot list it, or when training
    shards are asked for and there are only validation shards."""
    try:
        if any(ch in path for ch in "*?["):
            files = fs.glob(path)
        elif fs.isdir(path):
            files = [f for f in fs.ls(path, detail=False) if f.endswith(SHARD_SUFFIXES)]
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


def manifest_dir(data: str) -> str:
    """The folder whose manifest.json describes ``trainer.data`` (a folder, file or glob)."""
    d = data
    if any(ch in d for ch in "*?[") or d.endswith(SHARD_SUFFIXES):
        d = d.rsplit("/", 1)[0] if "/" in d else "."
    return d


def read_manifest(data: str) -> dict[str, Any] | None:
    """The ``data prepare`` manifest beside ``trainer.data``, or None (synthetic, other shards,
    unreadable: the loader reports a data problem itself)."""
    if data == "synthetic":
        return None
    d = manifest_dir(data if "://" in data else os.path.abspath(os.path.expanduser(data)))
    try:
        return runuri.read_json(runuri.join(d, MANIFEST))
    except Exception:  # noqa: BLE001 - unreadable: the loader reports the data problem itself
        return None

"""Tokenizers for ``dtrun data prepare`` and ``dtrun sample``, loaded offline only.

``load(name)`` accepts:

* a tiktoken encoding name (``gpt2``, ``r50k_base``, ``cl100k_base``, ``o200k_base``): tiktoken's
  own cache (``TIKTOKEN_CACHE_DIR``, else its default temp folder) must hold the vocabulary file;
* a path to a Hugging Face ``tokenizer.json`` (or a folder holding one);
* a Hugging Face repo id (``org/name``) whose ``tokenizer.json`` is already in the local HF cache.

Nothing is downloaded: a tokenizer that is not on this machine is one ``TokenizerError`` saying
what to download and where it must go. ``tokenizers``/``tiktoken`` are imported only here, when a
tokenizer is loaded (the ``data`` extra).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

TIKTOKEN_NAMES = ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base")
EOT_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded here (the message says what to download)."""


@dataclass
class Tokenizer:
    name: str
    kind: str  # "tiktoken" | "hf"
    vocab_size: int
    eot: int | None
    sha256: str
    json_bytes: bytes | None = None  # the tokenizer.json (hf kind): copied next to the shards
    _impl: Any = field(default=None, repr=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "tiktoken":
            return [self._impl.encode_ordinary(t) for t in texts]
        return [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: list[int]) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        if self.kind == "tiktoken":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        """The manifest's ``tokenizer`` entry."""
        return {"name": self.name, "kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size,
                "eot": self.eot, "file": "tokenizer.json" if self.json_bytes is not None else None}


def _from_json_bytes(name: str, data: bytes) -> Tokenizer:
    try:
        from tokenizers import Tokenizer as HFTok
    except ImportError:
        raise TokenizerError("Hugging Face tokenizer files need the `tokenizers` package: "
                             "pip install 'dtrun[data]'") from None
    try:
        tok = HFTok.from_str(data.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - a corrupt/unsupported file: name it
        raise TokenizerError(f"{name}: not a readable tokenizer.json ({type(e).__name__}: {e})") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    eot = next((vocab[t] for t in EOT_CANDIDATES if t in vocab), None)
    size = max(tok.get_vocab_size(with_added_tokens=True), (max(vocab.values()) + 1) if vocab else 0)
    return Tokenizer(name=name, kind="hf", vocab_size=size, eot=eot, sha256=hashlib.sha256(data).hexdigest(),
                     json_bytes=data, _impl=tok)


def _tiktoken(name: str) -> Tokenizer:
    try:
        import tiktoken
    except ImportError:
        raise TokenizerError(f"tokenizer {name!r} needs tiktoken: pip install 'dtrun[data]'") from None
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 - offline: the vocabulary file is not cached
        cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or "<tmp>/data-gym-cache"
        raise TokenizerError(
            f"tokenizer {name!r}: tiktoken's vocabulary file for it is not on this machine and cannot be "
            f"downloaded here ({type(e).__name__}). On a machine with internet run "
            f"`python -c \"import tiktoken; tiktoken.get_encoding('{name}')\"` with TIKTOKEN_CACHE_DIR set, copy that "
            f"folder here and set TIKTOKEN_CACHE_DIR to it (looked in {cache}); or pass --tokenizer PATH/tokenizer.json"
        ) from None
    h = hashlib.sha256()
    for tok, rank in sorted(enc._mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(tok + b"\x00" + str(rank).encode() + b"\n")
    return Tokenizer(name=name, kind="tiktoken", vocab_size=enc.n_vocab, eot=enc.eot_token, sha256=h.hexdigest(),
                     _impl=enc)


def load(name: str) -> Tokenizer:
    """The tokenizer called ``name`` (see the module docstring), or ``TokenizerError``."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"{name}: folder without a tokenizer.json")
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise TokenizerError(f"{name}: cannot read ({e.strerror})") from None
        return _from_json_bytes(os.path.abspath(path), data)
    if name in TIKTOKEN_NAMES:
        return _tiktoken(name)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        try:
            from huggingface_hub import try_to_load_from_cache
        except ImportError:
            try_to_load_from_cache = None
        cached = try_to_load_from_cache(name, "tokenizer.json") if try_to_load_from_cache else None
        if isinstance(cached, str) and os.path.isfile(cached):
            with open(cached, "rb") as f:
                return _from_json_bytes(name, f.read())
        raise TokenizerError(
            f"tokenizer {name!r}: its tokenizer.json is not in the local Hugging Face cache and nothing is "
            f"downloaded here. Fetch it on a machine with internet (`huggingface-cli download {name} "
            f"tokenizer.json`) and copy the cache (HF_HOME), or pass --tokenizer PATH/tokenizer.json")
    raise TokenizerError(
        f"unknown tokenizer {name!r}: give a tiktoken encoding ({', '.join(TIKTOKEN_NAMES)}), a path to a "
        f"tokenizer.json, or a Hugging Face repo id (org/name) whose tokenizer.json is in the local cache")


def from_manifest(manifest: dict[str, Any], data_uri: str) -> Tokenizer:
    """The tokenizer a ``data prepare`` manifest names: its copied tokenizer.json, else by name."""
    t = manifest.get("tokenizer") or {}
    if t.get("file"):
        from orchestrator.contract import runuri

        fs, path = runuri._fs(runuri.join(data_uri, t["file"]))
        with fs.open(path, "rb") as f:
            tok = _from_json_bytes(t.get("name") or "tokenizer.json", f.read())
    else:
        tok = load(t.get("name") or "")
    if t.get("sha256") and tok.sha256 != t["sha256"]:
        raise TokenizerError(f"the tokenizer {t.get('name')!r} found here differs from the one the data was "
                             f"prepared with (sha256 {tok.sha256[:12]} vs {t['sha256'][:12]})")
    return tok


def train_bpe(texts_or_files: list[str], vocab_size: int, out_path: str, *, files: bool = True) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style, ``<|endoftext|>`` as its first id) and save
    its tokenizer.json at ``out_path``. Seconds on a few MB."""
    try:
        from tokenizers import Tokenizer as HFTok
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise TokenizerError("training a tokenizer needs the `tokenizers` package: pip install 'dtrun[data]'") from None
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    if files:
        tok.train(texts_or_files, trainer)
    else:
        tok.train_from_iterator(texts_or_files, trainer)
    data = tok.to_str().encode("utf-8")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "wb") as f:
        f.write(data)
    return _from_json_bytes(os.path.abspath(out_path), data)


def manifest_json(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=1, sort_keys=True) + "\n"

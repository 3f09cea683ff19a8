"""The token-shard format, read by the trainer's loader and written by ``dtrun data prepare``.

llm.c's format: a header of 256 little-endian int32 — ``[magic, version, n_tokens, 0, …]`` — then
the tokens. Magic 20240520 (version 1) holds uint16 tokens (GPT-2's vocabulary fits); magic
20240801 (version 7 in llm.c's LLaMA-3 scripts) holds uint32 tokens. ``.npy`` arrays of an integer
dtype are read too. Anything else is refused with a message naming the file: a headerless file
would otherwise be read as garbage tokens without any error.

Validation shards are told apart by name: a file whose name holds ``val`` (llm.c's
``fineweb_val_000000.bin``, ``data prepare``'s ``val_000000.bin``) never joins the training stream.

Pure numpy; no torch (``dtrun data prepare`` runs on the user's machine without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MAGIC_U16 = 20240520
MAGIC_U32 = 20240801
VERSION = {MAGIC_U16: 1, MAGIC_U32: 7}
DTYPE = {MAGIC_U16: np.dtype("<u2"), MAGIC_U32: np.dtype("<u4")}


class ShardFormatError(ValueError):
    """A file that is not a token shard dtrun can read (the message names it and says why)."""


@dataclass(frozen=True)
class ShardInfo:
    path: str
    dtype: np.dtype
    offset: int  # bytes before the first token
    n_tokens: int


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits, else uint32 (llm.c's LLaMA-3 variant)."""
    return DTYPE[MAGIC_U16] if vocab_size <= 1 << 16 else DTYPE[MAGIC_U32]


def encode(tokens: np.ndarray, vocab_size: int) -> bytes:
    """One shard file's bytes: llm.c header + tokens in the narrowest dtype the vocabulary allows."""
    dt = token_dtype(vocab_size)
    tokens = np.asarray(tokens)
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids outside [0, {vocab_size})")
    magic = MAGIC_U16 if dt == DTYPE[MAGIC_U16] else MAGIC_U32
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, VERSION[magic], tokens.size)
    return header.tobytes() + tokens.astype(dt, copy=False).tobytes()


def parse_header(path: str, head: bytes, size: int) -> ShardInfo:
    """Read a ``.bin`` shard's header (``head`` = its first ``HEADER_BYTES``, ``size`` = file bytes)."""
    if len(head) < HEADER_BYTES:
        raise ShardFormatError(f"{path}: {size} bytes, too short for an llm.c shard header ({HEADER_BYTES} bytes)")
    h = np.frombuffer(head[:HEADER_BYTES], dtype="<i4")
    magic, n = int(h[0]), int(h[2])
    if magic not in DTYPE:
        raise ShardFormatError(
            f"{path}: not an llm.c token shard (magic {magic}; expected {MAGIC_U16} for uint16 tokens or "
            f"{MAGIC_U32} for uint32). Make shards with `dtrun data prepare` or llm.c's scripts.")
    dt = DTYPE[magic]
    want = HEADER_BYTES + n * dt.itemsize
    if n < 0 or size < want:
        raise ShardFormatError(f"{path}: header says {n} tokens ({want} bytes) but the file has {size} bytes "
                               "(truncated upload?)")
    return ShardInfo(path, dt, HEADER_BYTES, n)


def read_info(fs: Any, path: str) -> ShardInfo:
    """The format of one shard through an fsspec filesystem: llm.c ``.bin`` or ``.npy``."""
    if path.endswith(".npy"):
        with fs.open(path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                        else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read(f)
            except ValueError as e:
                raise ShardFormatError(f"{path}: not a readable .npy array ({e})") from None
            offset = f.tell()
        dtype = np.dtype(dtype)
        if dtype.kind not in "ui":
            raise ShardFormatError(f"{path}: dtype {dtype} is not an integer token type")
        return ShardInfo(path, dtype, offset, int(np.prod(shape)))
    with fs.open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    return parse_header(path, head, int(fs.size(path)))



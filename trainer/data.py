"""Training data: deterministic, resumable, per data-parallel rank.

Every sample has a global index; step ``s``, micro-batch ``m`` of data-parallel rank ``r`` reads
samples ``s·B + m·(dp·mb) + r·mb + j`` (``B`` global batch, ``mb`` micro-batch). The order is a pure
function of the index, so the loader's state is one counter (``samples_seen``), saved per
data-parallel rank and restorable at another dp degree.

* ``synthetic``: seeded token sequences with structure a model can learn (an arithmetic
  progression mod vocab with 10% noise), generated per sample from ``(seed, index)``.
* token shards: ``uint16`` ``.bin`` files (raw, or llm.c's format with its 256×int32 header,
  magic 20240520) or ``.npy`` arrays, from a directory, glob or file through fsspec (local paths
  are memory-mapped; remote ones read by byte range). Shards are concatenated in name order and
  sample ``i`` is the window ``[i·T, i·T + T + 1)`` of that stream (wrapping around).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from trainer.errors import ConfigError

_LLMC_MAGIC = 20240520
_LLMC_HEADER_BYTES = 256 * 4


class SyntheticSource:
    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.V, self.T, self.seed = vocab_size, seq_len, seed

    def sample(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, i])
        start = int(rng.integers(self.V))
        stride = int(rng.integers(1, 8))
        seq = (start + stride * np.arange(self.T + 1)) % self.V
        noise = rng.random(self.T + 1) < 0.1
        seq[noise] = rng.integers(self.V, size=int(noise.sum()))
        return seq.astype(np.int64)


class _Shard:
    def __init__(self, fs: Any, path: str, local: bool):
        self.fs, self.path, self.local = fs, path, local
        self.offset, self.dtype = 0, np.dtype(np.uint16)
        if path.endswith(".npy"):
            with fs.open(path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(f)
                self.offset = f.tell()
            self.dtype = np.dtype(dtype)
            self.n = int(np.prod(shape))
        else:
            with fs.open(path, "rb") as f:
                buf = f.read(_LLMC_HEADER_BYTES)
            head = np.frombuffer(buf[:len(buf) // 4 * 4], dtype=np.int32)
            size = fs.size(path)
            if head.size >= 3 and head[0] == _LLMC_MAGIC:
                self.offset = _LLMC_HEADER_BYTES
                self.n = int(head[2])
            else:
                self.n = size // 2
        if self.dtype.kind not in "ui":
            raise ValueError(f"dtype {self.dtype} is not an integer token type")
        self._mm = (np.memmap(path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.n,))
                    if local and self.n > 0 else None)

    def read(self, start: int, count: int) -> np.ndarray:
        if self._mm is not None:
            return np.asarray(self._mm[start:start + count])
        isz = self.dtype.itemsize
        with self.fs.open(self.path, "rb") as f:
            f.seek(self.offset + start * isz)
            return np.frombuffer(f.read(count * isz), dtype=self.dtype)


class ShardSource:
    def __init__(self, uri: str, seq_len: int, vocab_size: int):
        import fsspec

        from orchestrator.contract.runuri import _fs

        self.T, self.V = seq_len, vocab_size
        try:
            fs, path = _fs(uri) if uri.startswith("s3://") else fsspec.core.url_to_fs(uri)
        except Exception as e:  # noqa: BLE001 - unknown scheme, missing fsspec backend (gcsfs, …)
            raise ConfigError(f"trainer.data: cannot open {uri}: {type(e).__name__}: {e}") from None
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        try:
            if any(ch in path for ch in "*?["):
                files = fs.glob(path)
            elif fs.isdir(path):
                files = [f for f in fs.ls(path, detail=False) if f.endswith((".bin", ".npy"))]
            else:
                files = [path] if fs.exists(path) else []
        except Exception as e:  # noqa: BLE001 - any storage error here is a config problem
            raise ConfigError(f"trainer.data: cannot list {uri}: {e}") from None
        from trainer.shards import is_validation

        # validation shards (val_*.bin from `dtrun data prepare`, llm.c's *_val_*) never train
        files = sorted(f for f in files if not is_validation(f) and not f.endswith((".json", ".tmp")))
        if not files:
            raise ConfigError(f"trainer.data: no .bin or .npy token shards at {uri}")
        self.shards = []
        for f in files:
            try:
                shard = _Shard(fs, f, local)
            except Exception as e:  # noqa: BLE001 - truncated/corrupt file: name it, no traceback
                raise ConfigError(f"trainer.data: token shard {f} is unreadable "
                                  f"({type(e).__name__}: {e})") from None
            if shard.n > 0:  # an empty shard adds nothing (and cannot be memory-mapped)
                self.shards.append(shard)
        if not self.shards:
            raise ConfigError(f"trainer.data: every token shard at {uri} is empty")
        self.starts = np.cumsum([0] + [s.n for s in self.shards])
        self.total = int(self.starts[-1])
        if self.total < seq_len + 1:
            raise ConfigError(f"trainer.data: {uri} holds {self.total} tokens, fewer than seq_len + 1")

    def _read(self, pos: int, count: int) -> np.ndarray:
        out = []
        while count > 0:
            pos %= self.total
            k = int(np.searchsorted(self.starts, pos, side="right") - 1)
            local = pos - int(self.starts[k])
            take = min(count, self.shards[k].n - local)
            out.append(self.shards[k].read(local, take))
            pos, count = pos + take, count - take
        return np.concatenate(out)

    def sample(self, i: int) -> np.ndarray:
        seq = self._read(i * self.T, self.T + 1).astype(np.int64)
        if seq.max(initial=0) >= self.V:
            raise ConfigError(f"trainer.data: token id {int(seq.max())} ≥ vocab_size {self.V}")
        return seq


class DataLoader:
    """Micro-batches ``(inputs, targets)`` of shape (mb, T) for one data-parallel rank."""

    def __init__(self, source: Any, *, global_batch: int, micro_batch: int, dp_rank: int, dp: int,
                 device: torch.device):
        self.source, self.B, self.mb, self.dp_rank, self.dp = source, global_batch, micro_batch, dp_rank, dp
        self.device = device
        self.samples_seen = 0  # global samples consumed by completed steps

    @property
    def accum_steps(self) -> int:
        return self.B // (self.dp * self.mb)

    def batches(self, step: int):
        """The micro-batches of optimizer step ``step`` for this rank."""
        base = step * self.B
        for m in range(self.accum_steps):
            first = base + m * self.dp * self.mb + self.dp_rank * self.mb
            arr = np.stack([self.source.sample(first + j) for j in range(self.mb)])
            t = torch.from_numpy(arr)
            if self.device.type == "cuda":
                t = t.pin_memory().to(self.device, non_blocking=True)
            yield t[:, :-1], t[:, 1:]

    def advance(self, step: int) -> None:
        self.samples_seen = (step + 1) * self.B

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen, "dp_rank": self.dp_rank, "dp": self.dp}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.samples_seen = int(sd["samples_seen"])


def build_source(data: str, seq_len: int, vocab_size: int, seed: int) -> Any:
    if data == "synthetic":
        return SyntheticSource(vocab_size, seq_len, seed)
    uri = data if "://" in data else os.path.abspath(os.path.expanduser(data))
    return ShardSource(uri, seq_len, vocab_size)

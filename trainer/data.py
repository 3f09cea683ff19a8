"""Training data: deterministic, resumable, per data-parallel rank.

Every sample has a global index; step ``s``, micro-batch ``m`` of data-parallel rank ``r`` reads
samples ``s·B + m·(dp·mb) + r·mb + j`` (``B`` global batch, ``mb`` micro-batch). The order is a pure
function of the index, so the loader's state is one counter (``samples_seen``), saved per
data-parallel rank and restorable at another dp degree.

* ``synthetic``: seeded token sequences with structure a model can learn (an arithmetic
  progression mod vocab with 10% noise), generated per sample from ``(seed, index)``.
* token shards (format: ``trainer/shards.py`` — llm.c ``.bin`` with a uint16 or uint32 header,
  or ``.npy``; anything else is refused naming the file) from a directory, glob or file through
  fsspec. Shards are concatenated in name order and sample ``i`` is the window
  ``[i·T, i·T + T + 1)`` of that stream (wrapping around). A directory or glob never yields a
  validation shard (``orchestrator.contract.dataset.is_validation``: llm.c's
  ``fineweb_val_000000.bin``); validation data is named explicitly (``trainer.val_data``) and read by :func:`build_val_source`.

Input pipeline (what keeps a GPU fed from S3): a micro-batch of one rank is ``mb`` consecutive
samples, i.e. one contiguous token range; ranges are served from aligned blocks of
``READ_BLOCK_BYTES`` fetched with one ranged GET each (``fs.cat_file``: no s3fs read-ahead), the
next ``READ_AHEAD_BLOCKS`` blocks fetched concurrently in the background as soon as one is used,
and kept in a small LRU, so a step costs a few large requests, not one per sample. Local files are
memory-mapped. A background thread (:class:`DataLoader`) assembles the micro-batches of the next
``PREFETCH_STEPS`` steps while the current one trains, pinning host memory on CUDA; the main
thread copies them with ``non_blocking=True``. The state in the checkpoint is still one counter.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import queue
import threading
from typing import Any

import numpy as np
import torch

from orchestrator.contract.dataset import list_shards
from trainer import shards as shardfmt
from trainer.errors import ConfigError

READ_BLOCK_BYTES = int(os.environ.get("DTRUN_DATA_BLOCK_BYTES", 8 << 20))
"""One ranged GET per aligned block of this size (remote shards); env ``DTRUN_DATA_BLOCK_BYTES``."""
CACHE_BLOCKS = 8
"""Blocks kept per shard source, over all its shards (LRU): every rank of a data-parallel group reads the same blocks."""
READ_AHEAD_BLOCKS = max(1, min(int(os.environ.get("DTRUN_DATA_READ_AHEAD", "4")), CACHE_BLOCKS - 2))
"""Blocks fetched ahead of the one in use, concurrently (up to the read-ahead pool's 4 threads):
with small blocks (≈ one per step) one block ahead leaves a request's latency exposed whenever the
loop catches up; several in flight hide it. Bounded: at most this many blocks (of
``READ_BLOCK_BYTES``) in flight, and fewer than ``CACHE_BLOCKS`` so read-ahead never evicts the
block in use. Env ``DTRUN_DATA_READ_AHEAD``."""
PREFETCH_STEPS = 2
"""Optimizer steps of micro-batches the background thread prepares ahead of the loop."""


_READ_AHEAD = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="dtrun-readahead")


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

    def samples(self, first: int, count: int) -> np.ndarray:
        return np.stack([self.sample(first + j) for j in range(count)])


class _BlockCache:
    """The LRU of one :class:`ShardSource` (``CACHE_BLOCKS`` blocks over all its shards: a long run
    visits hundreds of shards and must not keep ``CACHE_BLOCKS`` blocks of each)."""

    def __init__(self) -> None:
        self.blocks: collections.OrderedDict[tuple[str, int], bytes] = collections.OrderedDict()
        self.lock = threading.Lock()


class _Shard:
    def __init__(self, fs: Any, info: shardfmt.ShardInfo, local: bool, cache: _BlockCache | None = None):
        self.fs, self.path, self.local = fs, info.path, local
        self.offset, self.dtype, self.n = info.offset, np.dtype(info.dtype), info.n_tokens
        self._mm = (np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.n,))
                    if local and self.n > 0 else None)
        self._cache = cache or _BlockCache()
        self._blocks = self._cache.blocks  # keyed (path, block)
        self._inflight: dict[int, Any] = {}
        self._lock = self._cache.lock
        self.requests = 0  # ranged GETs issued (benchmarks)
        self.n_blocks = -(-self.n * self.dtype.itemsize // READ_BLOCK_BYTES)

    def _fetch(self, k: int) -> bytes:
        start = self.offset + k * READ_BLOCK_BYTES
        end = min(start + READ_BLOCK_BYTES, self.offset + self.n * self.dtype.itemsize)
        b = self.fs.cat_file(self.path, start=start, end=end)
        with self._lock:
            self.requests += 1
            self._blocks[(self.path, k)] = b
            self._inflight.pop(k, None)
            while len(self._blocks) > CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        return b

    def _block(self, k: int) -> bytes:
        with self._lock:
            b = self._blocks.get((self.path, k))
            if b is not None:
                self._blocks.move_to_end((self.path, k))
            fut = self._inflight.get(k)
            # Read-ahead: the stream moves forward, so fetch the next blocks in the background.
            for nxt in range(k + 1, min(k + 1 + READ_AHEAD_BLOCKS, self.n_blocks)):
                if (self.path, nxt) not in self._blocks and nxt not in self._inflight:
                    self._inflight[nxt] = _READ_AHEAD.submit(self._fetch, nxt)
        if b is not None:
            return b
        if fut is not None:
            try:
                return fut.result()
            except Exception:  # noqa: BLE001 - the read-ahead failed: fetch again here, raising here
                pass
        return self._fetch(k)

    def read(self, start: int, count: int) -> np.ndarray:
        if self._mm is not None:
            return np.asarray(self._mm[start:start + count])
        isz = self.dtype.itemsize
        lo, hi = start * isz, (start + count) * isz  # byte range in the token area
        parts = []
        for k in range(lo // READ_BLOCK_BYTES, (hi - 1) // READ_BLOCK_BYTES + 1):
            b = self._block(k)
            base = k * READ_BLOCK_BYTES
            parts.append(b[max(lo - base, 0):min(hi - base, len(b))])
        return np.frombuffer(b"".join(parts), dtype=self.dtype)


class NoShards(ConfigError):
    """No token shard where the spec points."""


class TokenOutOfVocab(ConfigError):
    """A token id ≥ vocab_size in the windows this rank read: found by one rank, not all."""

    rank_local = True  # trainer.train.main prints it on whichever rank raised it


class ShardSource:
    def __init__(self, uri: str, seq_len: int, vocab_size: int, *, field: str = "trainer.data",
                 which: str = "train"):
        import fsspec

        from orchestrator.contract.runuri import _fs

        self.T, self.V, self.field = seq_len, vocab_size, field
        try:
            fs, path = _fs(uri) if uri.startswith("s3://") else fsspec.core.url_to_fs(uri)
        except Exception as e:  # noqa: BLE001 - unknown scheme, missing fsspec backend (gcsfs, …)
            raise ConfigError(f"{field}: cannot open {uri}: {type(e).__name__}: {e}") from None
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        files = list_shards(fs, path, uri, field, which=which)
        if not files:
            raise NoShards(f"{field}: no .bin or .npy token shards at {uri}")
        self.files = files
        self.shards = []
        cache = _BlockCache()
        for f in files:
            try:
                shard = _Shard(fs, shardfmt.read_info(fs, f), local, cache)
            except shardfmt.ShardFormatError as e:
                raise ConfigError(f"{field}: {e}") from None
            except Exception as e:  # noqa: BLE001 - truncated/corrupt file: name it, no traceback
                raise ConfigError(f"{field}: token shard {f} is unreadable "
                                  f"({type(e).__name__}: {e})") from None
            if shard.n > 0:  # an empty shard adds nothing (and cannot be memory-mapped)
                self.shards.append(shard)
        if not self.shards:
            raise ConfigError(f"{field}: every token shard at {uri} is empty")
        self.starts = np.cumsum([0] + [s.n for s in self.shards])
        self.total = int(self.starts[-1])
        if self.total < seq_len + 1:
            raise ConfigError(f"{field}: {uri} holds {self.total} tokens, fewer than seq_len + 1")

    @property
    def requests(self) -> int:
        return sum(s.requests for s in self.shards)

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

    def samples(self, first: int, count: int) -> np.ndarray:
        """Samples ``first … first+count-1`` as (count, T+1) int64: one contiguous range read."""
        T = self.T
        flat = self._read(first * T, count * T + 1).astype(np.int64)
        if flat.max(initial=0) >= self.V:
            raise TokenOutOfVocab(f"{self.field}: token id {int(flat.max())} ≥ vocab_size {self.V}")
        idx = np.arange(count)[:, None] * T + np.arange(T + 1)[None, :]
        return flat[idx]

    def sample(self, i: int) -> np.ndarray:
        return self.samples(i, 1)[0]


class DataLoader:
    """Micro-batches ``(inputs, targets)`` of shape (mb, T) for one data-parallel rank.

    ``batches(step)`` serves from a background thread that prepares the micro-batches of steps
    ``step … step + PREFETCH_STEPS`` ahead (pinned on CUDA); asking for a step out of sequence
    (a resume) restarts it there. ``prefetch=False``: assemble on the caller's thread."""

    def __init__(self, source: Any, *, global_batch: int, micro_batch: int, dp_rank: int, dp: int,
                 device: torch.device, prefetch: bool = True):
        self.source, self.B, self.mb, self.dp_rank, self.dp = source, global_batch, micro_batch, dp_rank, dp
        self.device = device
        self.samples_seen = 0  # global samples consumed by completed steps
        self.prefetch = prefetch
        self._q: queue.Queue | None = None
        self._next_step: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def accum_steps(self) -> int:
        return self.B // (self.dp * self.mb)

    def _host_batch(self, step: int, m: int) -> torch.Tensor:
        first = step * self.B + m * self.dp * self.mb + self.dp_rank * self.mb
        t = torch.from_numpy(self.source.samples(first, self.mb))
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t

    def _worker(self, step: int, q: queue.Queue, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                for m in range(self.accum_steps):
                    item = (step, m, self._host_batch(step, m))
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                step += 1
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            q.put((None, None, e))

    def _restart(self, step: int) -> None:
        self.close()
        self._stop = threading.Event()
        self._q = queue.Queue(maxsize=max(1, PREFETCH_STEPS * self.accum_steps))
        self._thread = threading.Thread(target=self._worker, args=(step, self._q, self._stop), daemon=True,
                                        name="dtrun-data")
        self._thread.start()

    def batches(self, step: int):
        """The micro-batches of optimizer step ``step`` for this rank."""
        if not self.prefetch:
            for m in range(self.accum_steps):
                yield self._split(self._host_batch(step, m))
            return
        if self._next_step != step or self._thread is None:
            self._restart(step)
        assert self._q is not None
        for m in range(self.accum_steps):
            s, mm, t = self._q.get()
            if s is None:
                self._next_step = None
                self._thread = None
                raise t
            assert (s, mm) == (step, m), (s, mm, step, m)
            yield self._split(t)
        self._next_step = step + 1

    def _split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device.type == "cuda":
            t = t.to(self.device, non_blocking=True)
        return t[:, :-1], t[:, 1:]

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread, self._next_step = None, None

    def advance(self, step: int) -> None:
        self.samples_seen = (step + 1) * self.B

    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen, "dp_rank": self.dp_rank, "dp": self.dp}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.samples_seen = int(sd["samples_seen"])


def _uri(data: str) -> str:
    return data if "://" in data else os.path.abspath(os.path.expanduser(data))


def build_source(data: str, seq_len: int, vocab_size: int, seed: int) -> Any:
    """The training stream (``trainer.data``); validation shards in a folder/glob are left out."""
    if data == "synthetic":
        return SyntheticSource(vocab_size, seq_len, seed)
    return ShardSource(_uri(data), seq_len, vocab_size)


def build_val_source(data: str, val_data: str | None, seq_len: int, vocab_size: int, seed: int) -> Any:
    """The validation stream, or None when the job has none: ``trainer.val_data`` (every shard it
    names, or only the validation-named ones where it names some — a ``data prepare`` folder; ``synthetic`` is a held-out synthetic stream, another seed), else the validation-named
    shards beside ``trainer.data`` (``data prepare``'s ``val_*.bin``, llm.c's ``*_val_*.bin``)."""
    if val_data == "synthetic":
        return SyntheticSource(vocab_size, seq_len, seed + 1_000_003)
    if val_data is not None:
        return ShardSource(_uri(val_data), seq_len, vocab_size, field="trainer.val_data", which="val_or_all")
    if data == "synthetic":
        return None
    folder = _uri(data)
    if any(ch in folder for ch in "*?[") or folder.endswith((".bin", ".npy")):
        folder = folder.rsplit("/", 1)[0]
    try:
        return ShardSource(folder, seq_len, vocab_size, field="trainer.val_data", which="val")
    except NoShards:
        return None

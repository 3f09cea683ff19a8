"""``dtrun data prepare``: text → llm.c token shards, a validation split and a manifest.

Sources: a file, a folder (walked in name order) or a glob of ``.txt``/``.md``/``.text`` (each
file one document), ``.jsonl``/``.json`` (one JSON object per line, its ``text`` field a
document), ``.parquet`` (its ``text`` column), or a Hugging Face dataset: a folder written by
``datasets``' ``save_to_disk`` or ``hf:NAME[:SPLIT]`` from the local ``datasets`` cache (both need
the ``datasets`` package; nothing is downloaded).

How (deterministic, so a rerun writes the same bytes):

1. *plan*: the sources are cut into work units of about ``unit_bytes()`` (text files at blank
   lines, JSONL at line ends, Parquet by row group, datasets by row range), in a fixed order. Every
   file is opened here first: a missing, unreadable or empty input is an error before anything is
   written.
2. *tokenize*: units go to a pool of worker processes (``--workers``, default all cores; each
   worker single-threaded); results come back in unit order. Each document is preceded by the
   tokenizer's end-of-text token (llm.c's convention), when it has one.
3. *write*: the first ``val_tokens`` tokens of the stream become ``val_000000.bin`` … (the
   validation split; by default ``auto_val_tokens``: a tenth of the corpus, at most 1M), the rest
   ``train_000000.bin`` … of ``shard_tokens`` tokens each (the last one shorter). uint16 tokens
   when the vocabulary fits, the uint32 variant otherwise (``trainer.shards``). After each shard,
   ``_prepare_state.json`` records it and where the next shard starts (unit, offset): a rerun
   after an interruption skips the finished units without tokenizing them again. Last, ``manifest.json`` (tokenizer name and sha256, vocabulary size,
   token counts, shard list with sha256) and, for Hugging Face tokenizers, a copy of
   ``tokenizer.json``; the state file is then removed. ``manifest.json`` present = complete.

Output goes to a local folder or any fsspec URI (``s3://`` with the run URI's endpoint/credential
rules). On a bad input (an error, not an interruption) everything this preparation wrote under the
output is removed again: nothing half-written is left for a trainer to pick up.

Reading the sources (step 1, and each unit's documents) is ``trainer.sources``; this module
tokenizes, writes the shards, the resumable state and the manifest.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from orchestrator.contract.dataset import MANIFEST, MANIFEST_FORMAT
from trainer import shards
from trainer.sources import (  # noqa: F401 - UNIT_BYTES_ENV, iter_documents: callers import them from here
    UNIT_BYTES_ENV, PrepareError, Unit, _docs, _W, iter_documents, plan_units, unit_bytes,
)
from trainer.tokenizer import Tokenizer, TokenizerError, load, manifest_json

STATE = "_prepare_state.json"
VAL_TOKENS_CAP = 1_000_000
VAL_FRACTION = 10
"""The default validation split: 1/VAL_FRACTION of the corpus, at most VAL_TOKENS_CAP tokens.
A tenth is nanoGPT's split for small corpora (enough windows for a steady loss on a 50k-token
corpus: 5k tokens); 1M tokens (1,000 windows of 1,024) estimates the loss to ~0.01 nats, and more
only takes training data away, so corpora above 10M tokens hold out exactly 1M."""
STOP_ENV = "DTRUN_DEBUG_PREPARE_EXIT_AFTER_SHARDS"
"""Test-only knob: the process exits (code 99, like a kill) after writing this many shards."""
EXIT_DEBUG_STOP = 99


# ---- tokenizing (worker processes) ----------------------------------------------------------------

def _init_worker(tok_name: str, tok_json: bytes | None, text_field: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from trainer.tokenizer import _from_json_bytes

    _W["tok"] = _from_json_bytes(tok_name, tok_json) if tok_json is not None else load(tok_name)
    _W["field"] = text_field


def _encode_unit(unit: Unit) -> tuple[np.ndarray, int, int]:
    """(tokens as uint32, documents, input bytes) for one unit."""
    tok: Tokenizer = _W["tok"]
    docs: list[str] = []
    starts: list[bool] = []  # does an end-of-text token precede this text?
    ndocs = nbytes = 0
    for sg in unit:
        d = _docs(sg, _W["field"])
        docs += d
        if sg.kind == "text":
            starts += [sg.first] * len(d)
            ndocs += 1 if sg.first else 0
        else:
            starts += [True] * len(d)
            ndocs += len(d)
        nbytes += sg.b - sg.a if sg.kind in ("text", "jsonl") else 0
    ids = tok.encode_batch(docs) if docs else []
    parts = []
    for st, d in zip(starts, ids):
        if tok.eot is not None and st:
            parts.append(np.array([tok.eot], dtype=np.uint32))
        parts.append(np.asarray(d, dtype=np.uint32))
    arr = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    return arr, ndocs, nbytes


# ---- output -------------------------------------------------------------------------------------

class _Out:
    def __init__(self, uri: str):
        from orchestrator.contract import runuri

        self.uri = uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))
        self.local = runuri.local_path(self.uri) if "://" in self.uri else self.uri
        if self.local is None:
            self.fs, self.root = runuri._fs(self.uri)
        else:
            self.fs, self.root = None, self.local

    def path(self, name: str) -> str:
        return os.path.join(self.root, name) if self.local is not None else self.root.rstrip("/") + "/" + name

    def put(self, name: str, data: bytes) -> None:
        if self.local is not None:
            os.makedirs(self.root, exist_ok=True)
            tmp = self.path(name) + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(name))
        else:
            self.fs.pipe_file(self.path(name), data)

    def get(self, name: str) -> bytes | None:
        try:
            if self.local is not None:
                with open(self.path(name), "rb") as f:
                    return f.read()
            return self.fs.cat_file(self.path(name))
        except (FileNotFoundError, IsADirectoryError):
            return None

    def remove(self, name: str) -> None:
        try:
            if self.local is not None:
                os.remove(self.path(name))
            else:
                self.fs.rm(self.path(name))
        except FileNotFoundError:
            pass

    def names(self) -> list[str]:
        try:
            if self.local is not None:
                return sorted(os.listdir(self.root)) if os.path.isdir(self.root) else []
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False))
        except FileNotFoundError:
            return []


def _config_hash(desc: list[dict[str, Any]], tok: Tokenizer, shard_tokens: int, val_tokens: int,
                 text_field: str) -> str:
    stat = []
    for d in desc:
        p = d["path"]
        st = os.stat(p) if os.path.exists(p) else None
        stat.append([p, d["bytes"], st.st_mtime_ns if st else None])
    blob = json.dumps([stat, tok.sha256, shard_tokens, "auto" if val_tokens is None else val_tokens, text_field,
                       unit_bytes()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class Progress:
    docs: int = 0
    tokens: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    shards: int = 0
    skipped_units: int = 0


def auto_val_tokens(corpus_tokens: int) -> int:
    """The default ``--val-tokens`` for a corpus of this many tokens."""
    return min(VAL_TOKENS_CAP, corpus_tokens // VAL_FRACTION)


def prepare(source: str, out: str, *, tokenizer: str = "gpt2", val_tokens: int | None = None,
            shard_tokens: int = 100_000_000, workers: int | None = None, text_field: str = "text",
            on_progress: Callable[[Progress], None] | None = None) -> dict[str, Any]:
    """Prepare ``source`` into ``out``; returns the manifest. ``val_tokens`` None: ``auto_val_tokens``
    of the corpus. Errors: ``PrepareError`` / ``TokenizerError`` (bad input; the output is cleaned up)."""
    if (val_tokens is not None and val_tokens < 0) or shard_tokens <= 0:
        raise PrepareError("--val-tokens must be ≥ 0 and --shard-tokens > 0")
    tok = load(tokenizer)  # TokenizerError before anything else
    units, desc, total_bytes = plan_units(source, text_field)
    o = _Out(out)
    cfg = _config_hash(desc, tok, shard_tokens, val_tokens, text_field)
    old_manifest = o.get(MANIFEST)
    if old_manifest is not None:
        m = json.loads(old_manifest)
        if m.get("config") == cfg:
            return m  # already prepared, identical inputs
        raise PrepareError(f"{out}: already holds a finished preparation of other inputs (manifest.json); "
                           f"choose another --out or remove it")
    raw_state = o.get(STATE)
    state: dict[str, Any] = {"config": cfg, "shards": [], "cursor": [0, 0], "docs": 0, "bytes": 0}
    if raw_state is not None:
        st = json.loads(raw_state)
        if st.get("config") != cfg:
            raise PrepareError(f"{out}: holds an unfinished preparation of other inputs or options "
                               f"({STATE}); choose another --out or remove it")
        state = st
    fresh = raw_state is None
    wrote: list[str] = []
    try:
        manifest = _run(units, desc, total_bytes, tok, o, state, cfg, val_tokens, shard_tokens, workers,
                        text_field, on_progress, wrote)
    except (PrepareError, TokenizerError):
        # Bad input: remove every shard and state this preparation wrote (nothing half-written).
        names = set(wrote) | {s["name"] for s in state.get("shards", [])} | {STATE}
        for n in names:
            o.remove(n)
        if fresh and o.local is not None and os.path.isdir(o.root) and not os.listdir(o.root):
            os.rmdir(o.root)
        raise
    return manifest


def _run(units, desc, total_bytes, tok, o: _Out, state, cfg, val_tokens, shard_tokens, workers, text_field,
         on_progress, wrote) -> dict[str, Any]:
    dtype = shards.token_dtype(tok.vocab_size)
    start_unit, skip = state["cursor"]
    # auto: known once the stream holds VAL_FRACTION × the cap (then it is the cap) or has ended;
    # until then the tokens wait in memory (at most 10M tokens, 40 MB). A resumed run reads it back.
    val_tokens = state.get("val_tokens", val_tokens)
    val_done = sum(s["tokens"] for s in state["shards"] if s["split"] == "val")
    train_done = sum(s["tokens"] for s in state["shards"] if s["split"] == "train")
    n_val = sum(1 for s in state["shards"] if s["split"] == "val")
    n_train = sum(1 for s in state["shards"] if s["split"] == "train")
    prog = Progress(docs=state["docs"], tokens=val_done + train_done, bytes_done=state["bytes"],
                    bytes_total=total_bytes, shards=len(state["shards"]), skipped_units=start_unit)
    base_docs, base_bytes = state["docs"], state["bytes"]
    unit_stats: dict[int, tuple[int, int]] = {}  # unit index → (documents, input bytes), this run
    buf: list[list[Any]] = []  # [unit index, array, offset]
    buffered = 0

    def take(n: int) -> np.ndarray:
        nonlocal buffered
        parts, need = [], n
        while need:
            ui, arr, off = buf[0]
            k = min(need, len(arr) - off)
            parts.append(arr[off:off + k])
            need -= k
            if off + k == len(arr):
                buf.pop(0)
            else:
                buf[0][2] = off + k
        buffered -= n
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)

    def flush(split: str, n: int, next_unit: int) -> None:
        nonlocal n_val, n_train
        arr = take(n)
        if split == "val":
            name, n_val = f"val_{n_val:06d}.bin", n_val + 1
        else:
            name, n_train = f"train_{n_train:06d}.bin", n_train + 1
        data = shards.encode(arr, tok.vocab_size)
        wrote.append(name)
        o.put(name, data)
        state["shards"].append({"name": name, "split": split, "tokens": int(n),
                                "sha256": hashlib.sha256(data).hexdigest()})
        state["cursor"] = [buf[0][0], buf[0][2]] if buf else [next_unit, 0]
        # docs/bytes of the units wholly before the cursor (a rerun counts the cursor's unit again)
        cu = state["cursor"][0]
        state["docs"] = base_docs + sum(d for u, (d, _) in unit_stats.items() if u < cu)
        state["bytes"] = base_bytes + sum(b for u, (_, b) in unit_stats.items() if u < cu)
        o.put(STATE, json.dumps(state).encode())
        prog.shards += 1
        if stop_after and prog.shards - first_shards >= stop_after:
            os._exit(EXIT_DEBUG_STOP)  # test knob: a kill right after a shard and its state were written

    def drain(next_unit: int) -> None:
        """Write every full shard the buffer holds: validation first, then training."""
        nonlocal val_done, train_done
        while True:
            if val_done < val_tokens:
                n = min(val_tokens - val_done, shard_tokens)
                if buffered >= n and n > 0:
                    flush("val", n, next_unit)
                    val_done += n
                    continue
            elif buffered >= shard_tokens:
                flush("train", shard_tokens, next_unit)
                train_done += shard_tokens
                continue
            break

    first_shards = prog.shards
    stop_after = int(os.environ.get(STOP_ENV, "0") or 0)
    nworkers = max(1, min(workers or os.cpu_count() or 1, len(units) - start_unit or 1))
    todo = units[start_unit:]
    results = _results(todo, tok, text_field, nworkers)
    for i, (arr, ndocs, nbytes) in enumerate(results):
        ui = start_unit + i
        if i == 0 and skip:
            arr = arr[skip:]
            buf.append([ui, arr, 0])
        else:
            buf.append([ui, arr, 0])
        buffered += len(arr)
        unit_stats[ui] = (ndocs, nbytes)
        prog.docs += ndocs
        prog.bytes_done += nbytes
        prog.tokens += len(arr)
        if val_tokens is None and buffered >= VAL_FRACTION * VAL_TOKENS_CAP:
            val_tokens = state["val_tokens"] = VAL_TOKENS_CAP
        if val_tokens is not None:
            drain(ui + 1)
        if on_progress:
            on_progress(prog)
    # the tail
    if val_tokens is None:  # auto, and the whole corpus is in memory: a tenth of it
        val_tokens = state["val_tokens"] = auto_val_tokens(buffered)
        drain(len(units))
    if val_done < val_tokens:
        total = val_done + buffered
        raise PrepareError(f"the corpus holds {total:,} tokens, not more than --val-tokens ({val_tokens:,}): "
                           f"nothing would be left to train on; use a larger corpus or a smaller --val-tokens")
    if buffered:
        flush("train", buffered, len(units))
        train_done += state["shards"][-1]["tokens"]
    if train_done == 0:
        raise PrepareError("the corpus tokenized to 0 training tokens (empty documents?)")
    state["docs"] = base_docs + sum(d for d, _ in unit_stats.values())
    if on_progress:
        on_progress(prog)
    if tok.json_bytes is not None:
        o.put("tokenizer.json", tok.json_bytes)
    split = {s: [x for x in state["shards"] if x["split"] == s] for s in ("train", "val")}
    manifest = {
        "format": MANIFEST_FORMAT, "config": cfg, "tokenizer": tok.describe(), "vocab_size": tok.vocab_size,
        "dtype": str(dtype.name), "shard_tokens": shard_tokens, "val_tokens": val_tokens,
        "documents": state["docs"], "sources": desc,
        "train": {"tokens": sum(x["tokens"] for x in split["train"]),
                  "shards": [{k: x[k] for k in ("name", "tokens", "sha256")} for x in split["train"]]},
        "val": {"tokens": sum(x["tokens"] for x in split["val"]),
                "shards": [{k: x[k] for k in ("name", "tokens", "sha256")} for x in split["val"]]},
    }
    o.put(MANIFEST, manifest_json(manifest).encode())
    o.remove(STATE)
    return manifest


def _results(todo: list[Unit], tok: Tokenizer, text_field: str, nworkers: int) -> Iterator[tuple[np.ndarray, int, int]]:
    args = (tok.name, tok.json_bytes, text_field)
    ctx = mp.get_context("spawn")  # the tokenizers' thread pools do not survive fork
    pool = ctx.Pool(nworkers, initializer=_init_worker, initargs=args)
    try:
        yield from pool.imap(_encode_unit, todo, chunksize=1)
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def describe_rate(p: Progress, t0: float) -> str:
    dt = max(1e-9, time.monotonic() - t0)
    return f"{p.docs:,} docs, {p.tokens:,} tokens, {p.bytes_done / dt / 1e6:.1f} MB/s"

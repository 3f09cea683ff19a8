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
"""

from __future__ import annotations

import glob as _glob
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
from trainer.tokenizer import Tokenizer, TokenizerError, load, manifest_json

UNIT_BYTES_ENV = "DTRUN_PREPARE_UNIT_BYTES"
"""Work-unit size in bytes (default 1 MiB): the granularity of parallelism and of resuming."""


def unit_bytes() -> int:
    return int(os.environ.get(UNIT_BYTES_ENV) or (1 << 20))
TEXT_EXT = (".txt", ".md", ".text", ".rst")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
PARQUET_EXT = (".parquet",)
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


class PrepareError(ValueError):
    """Bad input for ``data prepare`` (the message names the file or option)."""


@dataclass(frozen=True)
class Seg:
    """A piece of one source: a byte range of a text/JSONL file, a Parquet row group, dataset rows."""
    kind: str  # text | jsonl | parquet | hfdisk | hfname
    path: str
    a: int
    b: int
    first: bool  # the piece starts a document (text files: only the first chunk)


Unit = tuple  # a work unit: consecutive Segs (small files grouped up to about unit_bytes())


# ---- planning -------------------------------------------------------------------------------------

def _list_sources(source: str) -> list[tuple[str, str]]:
    """[(kind, path)] in a fixed order."""
    if source.startswith("hf:"):
        return [("hfname", source[3:])]
    path = os.path.expanduser(source)
    if any(ch in path for ch in "*?["):
        files = sorted(_glob.glob(path, recursive=True))
        if not files:
            raise PrepareError(f"{source}: no file matches")
    elif os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(os.path.join(path, "state.json")):
            return [("hfdisk", path)]
        files = []
        for root, dirs, names in os.walk(path):
            dirs.sort()
            files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        files = sorted(files)
    elif os.path.exists(path):
        files = [path]
    else:
        raise PrepareError(f"{source}: no such file or folder")
    out = []
    for f in files:
        low = f.lower()
        if low.endswith(TEXT_EXT):
            out.append(("text", f))
        elif low.endswith(JSONL_EXT):
            out.append(("jsonl", f))
        elif low.endswith(PARQUET_EXT):
            out.append(("parquet", f))
        elif len(files) == 1:
            raise PrepareError(f"{f}: unknown kind of file (expected {', '.join(TEXT_EXT + JSONL_EXT + PARQUET_EXT)})")
    if not out:
        raise PrepareError(f"{source}: holds no text, JSONL or Parquet files (the corpus is empty)")
    return out


def _split_bytes(path: str, sep: bytes) -> list[tuple[int, int]]:
    """Byte ranges of about UNIT_BYTES ending just after ``sep`` (or at the end of the file)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise PrepareError(f"{path}: cannot read ({e.strerror or e})") from None
    out, a, n = [], 0, len(data)
    while a < n:
        b = min(n, a + unit_bytes())
        if b < n:
            j = data.find(sep, b)
            b = n if j < 0 else j + len(sep)
        out.append((a, b))
        a = b
    return out


def plan_units(source: str, text_field: str = "text") -> tuple[list[Unit], list[dict[str, Any]], int]:
    """(units, source descriptions for the manifest, total input bytes)."""
    segs: list[Seg] = []
    desc: list[dict[str, Any]] = []
    total = 0
    for kind, path in _list_sources(source):
        if kind in ("text", "jsonl"):
            ranges = _split_bytes(path, b"\n\n" if kind == "text" else b"\n")
            size = ranges[-1][1] if ranges else 0
            segs += [Seg(kind, path, a, b, first=(kind == "jsonl" or i == 0)) for i, (a, b) in enumerate(ranges)]
        elif kind == "parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise PrepareError(f"{path}: Parquet needs pyarrow: pip install 'dtrun[data]'") from None
            try:
                pf = pq.ParquetFile(path)
            except Exception as e:  # noqa: BLE001 - not a parquet file, unreadable
                raise PrepareError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
            if text_field not in pf.schema_arrow.names:
                raise PrepareError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                                   f"use --text-field")
            size = os.path.getsize(path)
            segs += [Seg(kind, path, g, g + 1, True) for g in range(pf.num_row_groups)]
        else:
            ds = _open_dataset(kind, path)
            if text_field not in ds.column_names:
                raise PrepareError(f"{path}: no column {text_field!r} (columns: {', '.join(ds.column_names)})")
            n = len(ds)
            step = 2000
            segs += [Seg(kind, path, a, min(n, a + step), True) for a in range(0, n, step)]
            size = int(getattr(ds, "data", None).nbytes) if getattr(ds, "data", None) is not None else n * 1000
        desc.append({"path": os.path.abspath(path) if kind != "hfname" else path, "kind": kind, "bytes": size})
        total += size
    if total == 0 or not segs:
        raise PrepareError(f"{source}: the corpus is empty (0 bytes of text)")
    # Group consecutive small text/JSONL pieces into units of about UNIT_BYTES: one task per
    # thousands of tiny files would spend the time in inter-process traffic, not in tokenizing.
    units: list[Unit] = []
    cur: list[Seg] = []
    size = 0
    for sg in segs:
        byte_kind = sg.kind in ("text", "jsonl")
        if cur and (not byte_kind or size + (sg.b - sg.a) > unit_bytes()):
            units.append(tuple(cur))
            cur, size = [], 0
        cur.append(sg)
        size += sg.b - sg.a if byte_kind else unit_bytes()
    if cur:
        units.append(tuple(cur))
    return units, desc, total


def iter_documents(source: str, text_field: str = "text") -> Iterator[str]:
    """Every document ``prepare`` reads from ``source`` (text, JSONL, Parquet, datasets), in its
    order; text files in pieces of about ``unit_bytes()`` cut at blank lines. ``data tokenizer``
    trains on this, so a tokenizer sees what the shards will hold."""
    units, _, _ = plan_units(source, text_field)
    try:
        for u in units:
            for sg in u:
                yield from _docs(sg, text_field)
    finally:
        _W.pop("ds", None)


def _open_dataset(kind: str, path: str):
    try:
        import datasets
    except ImportError:
        raise PrepareError(f"{path}: a Hugging Face dataset needs the `datasets` package (pip install datasets)") from None
    try:
        if kind == "hfdisk":
            ds = datasets.load_from_disk(path)
        else:
            name, _, split = path.partition(":")
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
            ds = datasets.load_dataset(name, split=split or "train")
    except Exception as e:  # noqa: BLE001 - not cached, not a dataset folder
        raise PrepareError(f"{path}: cannot open this Hugging Face dataset offline ({type(e).__name__}: {e}); "
                           f"download it first on a machine with internet (datasets caches it) or give a folder "
                           f"written by save_to_disk") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise PrepareError(f"{path}: a DatasetDict without a 'train' split; name one as hf:NAME:SPLIT")
        ds = ds["train"]
    return ds


# ---- tokenizing (worker processes) ----------------------------------------------------------------

_W: dict[str, Any] = {}


def _init_worker(tok_name: str, tok_json: bytes | None, text_field: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from trainer.tokenizer import _from_json_bytes

    _W["tok"] = _from_json_bytes(tok_name, tok_json) if tok_json is not None else load(tok_name)
    _W["field"] = text_field


def _docs(u: Seg, field: str) -> list[str]:
    if u.kind in ("text", "jsonl"):
        try:
            with open(u.path, "rb") as f:
                f.seek(u.a)
                raw = f.read(u.b - u.a)
        except OSError as e:
            raise PrepareError(f"{u.path}: cannot read ({e.strerror or e})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise PrepareError(f"{u.path}: not UTF-8 text (byte {u.a + e.start})") from None
        if u.kind == "text":
            return [text]
        out = []
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepareError(f"{u.path}: a line near byte {u.a} is not JSON ({e.msg})") from None
            v = obj.get(field) if isinstance(obj, dict) else None
            if not isinstance(v, str):
                raise PrepareError(f"{u.path}: a line near byte {u.a} has no string field {field!r} (use --text-field)")
            out.append(v)
        return out
    if u.kind == "parquet":
        import pyarrow.parquet as pq

        col = pq.ParquetFile(u.path).read_row_group(u.a, columns=[field]).column(0).to_pylist()
        return [c for c in col if isinstance(c, str)]
    ds = _W.get("ds")
    if ds is None:
        ds = _W["ds"] = _open_dataset(u.kind, u.path)
    return [c for c in ds[u.a:u.b][field] if isinstance(c, str)]


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

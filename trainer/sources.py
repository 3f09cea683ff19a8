"""Reading the sources of ``dtrun data prepare``: which files a source names, cutting them into work
units, and the documents in each piece.

A source is a file, a folder (walked in name order) or a glob of text (``.txt``/``.md``/``.text``/
``.rst``: each file one document), JSONL (one JSON object per line, its ``text`` field a document),
Parquet (its ``text`` column), or a Hugging Face dataset (a ``save_to_disk`` folder or
``hf:NAME[:SPLIT]`` from the local cache). ``plan_units`` cuts them into ``Unit``s of about
``unit_bytes()`` in a fixed order and opens every input first, so a bad one is a ``PrepareError``
before anything is written; ``_docs`` reads one piece back (in a worker process).
``trainer.prepare`` tokenizes the units and writes the shards, the validation split and the manifest.
"""

from __future__ import annotations

import glob as _glob
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator


UNIT_BYTES_ENV = "DTRUN_PREPARE_UNIT_BYTES"
"""Work-unit size in bytes (default 1 MiB): the granularity of parallelism and of resuming."""


def unit_bytes() -> int:
    return int(os.environ.get(UNIT_BYTES_ENV) or (1 << 20))
TEXT_EXT = (".txt", ".md", ".text", ".rst")
JSONL_EXT = (".jsonl", ".json", ".ndjson")
PARQUET_EXT = (".parquet",)


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



# ---- reading a piece back -----------------------------------------------------------------------

_W: dict[str, Any] = {}
"""Per-process state: the open dataset of ``_docs`` and, in a worker, its tokenizer and text field."""


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

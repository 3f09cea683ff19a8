"""The run URI: the only thing controller and trainer share (see shared DESIGN.md).

Layout under ``<run-uri>/``::

    checkpoints/step-<N>/            a DCP checkpoint; counts only once COMMITTED exists
    checkpoints/step-<N>/COMMITTED   JSON: step, tokens, loss, world_size, parallel, time
    progress.json                    trainer heartbeat: step, steps, loss, tokens_per_s, mfu,
                                     last_committed_step, time, attempt
    metrics.jsonl                    one JSON row per logged step (and per validation: val_loss)
    tensorboard/                     event files, when trainer.trackers has tensorboard
    lease.json                       controller lease: {"expires": unix time, "controller": host/pid}
    STOP                             controller asks for a graceful stop (checkpoint, exit 0)
    DONE                             trainer finished: final metrics (JSON)
    trainer.log                      (local provider) the node's stdout/stderr
    nodes/a<A>/node-<R>.json         attempt A's node R (node bootstrap): rank, private IP, host,
                                     state (STARTING, RUNNING, EXITED), exit code, times
    nodes/a<A>/node-<R>.log          that node's output (bootstrap + torchrun + its ranks), the
                                     last NODE_LOG_BYTES, rewritten while it runs

Paths with ``://`` go through a lazily imported fsspec (s3fs for s3://, endpoint from
``AWS_ENDPOINT_URL``, credentials from the standard AWS chain); plain paths stay on ``os``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

PROGRESS = "progress.json"
METRICS = "metrics.jsonl"
LEASE = "lease.json"
STOP = "STOP"
DONE = "DONE"
WATCHDOG = "watchdog.json"
JOB_FILE = "job.yaml"
CHECKPOINTS = "checkpoints"
COMMITTED = "COMMITTED"

# Trainer exit codes (the node bootstrap passes them through).
EXIT_DONE = 0          # finished (DONE written) or STOP honoured
EXIT_PREEMPTED = 75    # SIGTERM (spot notice) → emergency checkpoint saved → "resume me" (EX_TEMPFAIL)
EXIT_BAD_CONFIG = 2    # invalid config / parallel degrees / run URI unusable: do not retry
EXIT_WATCHDOG = 76     # the node bootstrap's watchdog stopped the run (budget, deadline, lost
                       # controller, idle); the reason is in <run-uri>/watchdog.json

_STEP_RE = re.compile(r"step-(\d+)$")
NODES = "nodes"
NODE_LOG_BYTES = 1 << 20
_NODE_RE = re.compile(r"node-(\d+)\.json$")

BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "hf": "huggingface_hub", "http": "aiohttp", "https": "aiohttp"}
"""The Python package fsspec needs for each scheme (its ``known_implementations``)."""
READ_ONLY = ("http", "https")
"""Schemes dtrun can read data from but never write a run to."""
SCHEMES = ("file",) + tuple(BACKENDS)
_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_BAD_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{1,})(:/?)(?!/)(.*)$")
_BAD_SLASHES = re.compile(r"^(" + "|".join(SCHEMES) + r")(//|:)(.*)$")


def malformed(uri: str) -> str | None:
    """The URI it was probably meant to be (``s3:/b`` → ``s3://b``), or None when well formed."""
    if _SCHEME_RE.match(uri):
        return None
    m = _BAD_SLASHES.match(uri) if uri.split("/", 1)[0].rstrip(":") in SCHEMES else None
    if m is None:
        m = _BAD_COLON.match(uri)
        if m is None or m.group(1).lower() not in SCHEMES:
            return None
    return f"{m.group(1)}://{m.group(3).lstrip('/')}"


def scheme(uri: str) -> str:
    m = _SCHEME_RE.match(uri)
    return m.group(1).lower() if m else "file"


def anchored(uri: str, base: str) -> str:
    """A relative local path or ``file://`` URI made absolute against ``base`` (the job file's
    folder), so the same job file means the same place from any working directory; other URIs
    (and malformed ones, which the checks refuse by name) unchanged."""
    if malformed(uri) is not None:
        return uri
    if uri.startswith("file://"):
        path = uri[len("file://"):]
        return "file://" + os.path.normpath(os.path.join(base, os.path.expanduser(path)))
    if "://" in uri:
        return uri
    return os.path.normpath(os.path.join(base, os.path.expanduser(uri)))


def join(uri: str, *parts: str) -> str:
    out = uri.rstrip("/")
    for p in parts:
        out += "/" + p.strip("/")
    return out


def _fs(uri: str):
    """(filesystem, path) for a URI; plain paths and file:// on the local filesystem."""
    import fsspec

    if uri.startswith("s3://"):
        opts: dict[str, Any] = {}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["client_kwargs"] = {"endpoint_url": endpoint}
        fs = fsspec.filesystem("s3", **opts)
        return fs, uri[len("s3://"):]
    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path


@contextlib.contextmanager
def _store_errors(uri: str):
    """Object-store client errors that are not OSError (botocore's EndpointConnectionError,
    NoCredentialsError, ReadTimeoutError, ...) become OSError naming the URI, so a caller's
    ``except OSError`` also covers a store outage (a controller tick must not crash on one)."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        if (type(e).__module__ or "").split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec"):
            raise OSError(f"{uri}: {type(e).__name__}: {e}") from e
        raise


def local_path(uri: str) -> str | None:
    """The local filesystem path of a file:// URI or plain path, else None."""
    if uri.startswith("file://"):
        return uri[len("file://"):]
    if "://" not in uri:
        return uri
    return None


def exists(uri: str) -> bool:
    lp = local_path(uri)
    if lp is not None:
        return os.path.exists(lp)
    fs, path = _fs(uri)
    with _store_errors(uri):
        return fs.exists(path)


def read_text(uri: str) -> str | None:
    """The file's text, or None if it does not exist."""
    lp = local_path(uri)
    try:
        if lp is not None:
            return Path(lp).read_text()
        fs, path = _fs(uri)
        # One GET (cat_file), not open()+read: s3fs's file object pins the ETag, so a writer
        # replacing the object between its HEAD and GET (progress.json, rewritten every few
        # seconds) made the read fail with FileExpired.
        with _store_errors(uri):
            return fs.cat_file(path).decode()
    except FileNotFoundError:
        return None


def read_json(uri: str) -> Any | None:
    text = read_text(uri)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def write_text(uri: str, text: str) -> None:
    """Write atomically on local disk (tmp + rename); S3 puts are atomic already."""
    lp = local_path(uri)
    if lp is not None:
        d = os.path.dirname(lp) or "."
        os.makedirs(d, exist_ok=True)
        tmp = f"{lp}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, lp)
        return
    fs, path = _fs(uri)
    with _store_errors(uri), fs.open(path, "w") as f:
        f.write(text)


def write_json(uri: str, obj: Any) -> None:
    write_text(uri, json.dumps(obj, indent=None, sort_keys=True))


def append_line(uri: str, line: str) -> None:
    lp = local_path(uri)
    if lp is not None:
        os.makedirs(os.path.dirname(lp) or ".", exist_ok=True)
        with open(lp, "a") as f:
            f.write(line.rstrip("\n") + "\n")
        return
    # Object stores have no append: rewrite (metrics.jsonl stays small: one row per log step).
    old = read_text(uri) or ""
    write_text(uri, old + line.rstrip("\n") + "\n")


def remove(uri: str, recursive: bool = False) -> None:
    lp = local_path(uri)
    try:
        if lp is not None:
            if os.path.isdir(lp):
                import shutil

                shutil.rmtree(lp, ignore_errors=True)
            elif os.path.exists(lp):
                os.remove(lp)
            return
        fs, path = _fs(uri)
        with _store_errors(uri):
            if fs.exists(path):
                fs.rm(path, recursive=recursive)
    except FileNotFoundError:
        pass


def list_dir(uri: str) -> list[str]:
    """Names (not paths) directly under uri; empty if it does not exist."""
    lp = local_path(uri)
    if lp is not None:
        try:
            return sorted(os.listdir(lp))
        except FileNotFoundError:
            return []
    fs, path = _fs(uri)
    try:
        with _store_errors(uri):
            fs.invalidate_cache(path)
            entries = fs.ls(path, detail=False)
    except FileNotFoundError:
        return []
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)


def put_file(local: str, uri: str) -> None:
    """Copy a local file to ``uri`` (a whole-object PUT on S3; tmp + rename on local disk)."""
    lp = local_path(uri)
    if lp is not None:
        import shutil

        os.makedirs(os.path.dirname(lp) or ".", exist_ok=True)
        tmp = f"{lp}.tmp.{os.getpid()}"
        shutil.copyfile(local, tmp)
        os.replace(tmp, lp)
        return
    fs, path = _fs(uri)
    with _store_errors(uri):
        fs.put_file(local, path)


def get_file(uri: str, local: str) -> None:
    """Copy the object at ``uri`` to the local path (parent folders created)."""
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    lp = local_path(uri)
    if lp is not None:
        import shutil

        shutil.copyfile(lp, local)
        return
    fs, path = _fs(uri)
    with _store_errors(uri):
        fs.get_file(path, local)


def list_files(uri: str) -> list[str]:
    """Every file under ``uri``, as paths relative to it (``a/b.bin``), sorted; empty if none."""
    lp = local_path(uri)
    if lp is not None:
        out = []
        for root, _dirs, files in os.walk(lp):
            out += [os.path.relpath(os.path.join(root, f), lp) for f in files]
        return sorted(out)
    fs, path = _fs(uri)
    base = path.rstrip("/")
    try:
        with _store_errors(uri):
            fs.invalidate_cache(base)
            found = fs.find(base)
    except FileNotFoundError:
        return []
    return sorted(f[len(base) + 1:] for f in found if f.startswith(base + "/"))


def retain(uri: str, keep: int) -> list[int]:
    """Keep the newest ``keep`` COMMITTED checkpoints: remove every older step folder (committed or
    partial); partial folders newer than the newest committed one may still be writing and stay.
    Returns the steps removed."""
    steps = checkpoint_steps(uri)
    done = [s for s in steps if committed(uri, s) is not None]
    kept = set(done[-keep:])
    newest = done[-1] if done else -1
    gone = [s for s in steps if s not in kept and s <= newest]
    for s in gone:
        remove(checkpoint_uri(uri, s), recursive=True)
    return gone


def checkpoint_steps(uri: str) -> list[int]:
    """Every step folder under checkpoints/, committed or not, ascending."""
    steps = []
    for name in list_dir(join(uri, CHECKPOINTS)):
        m = _STEP_RE.match(name)
        if m:
            steps.append(int(m.group(1)))
    return sorted(steps)


def checkpoint_uri(uri: str, step: int) -> str:
    return join(uri, CHECKPOINTS, f"step-{step}")


def committed(uri: str, step: int) -> dict | None:
    """The COMMITTED record of a step, or None if the step is partial."""
    rec = read_json(join(checkpoint_uri(uri, step), COMMITTED))
    return rec if isinstance(rec, dict) else None


def latest_committed(uri: str) -> tuple[int, dict] | None:
    """(step, COMMITTED record) of the newest committed checkpoint, or None."""
    for step in reversed(checkpoint_steps(uri)):
        rec = committed(uri, step)
        if rec is not None:
            return step, rec
    return None


def now() -> float:
    return time.time()


def node_uri(uri: str, attempt: int, rank: int, kind: str = "json") -> str:
    """``nodes/a<attempt>/node-<rank>.<kind>`` (kind: json, the node's record; log, its output)."""
    return join(uri, NODES, f"a{attempt}", f"node-{rank}.{kind}")


def node_records(uri: str, attempt: int) -> list[dict]:
    """Every node record of one attempt, by rank (what each node's bootstrap wrote)."""
    out = []
    for name in list_dir(join(uri, NODES, f"a{attempt}")):
        m = _NODE_RE.match(name)
        if m:
            rec = read_json(node_uri(uri, attempt, int(m.group(1))))
            if isinstance(rec, dict):
                out.append(rec)
    return sorted(out, key=lambda r: r.get("rank", 0))

"""Shipping a command job's code folder to its nodes (``command.code``).

The folder's files go to ``<run-uri>/code.tar.gz`` before the first launch; every node unpacks it
(``infra/usercode.py``), so every provider gets the same code through the one channel it already
has (the run URI) and no provider needs a second sync path.

Left out, each named in a warning (``dtrun up --dry-run`` prints them, ``dtrun up`` records them as
an event): what ``.gitignore`` ignores (git's own rules through ``git ls-files`` inside a git work
tree; outside one, the folder's ``.gitignore`` patterns by ``fnmatch``), files over
``command.max_file_mb``, the ``.git`` folder, and the run URI's folder when it lies inside the code.
"""

from __future__ import annotations

import fnmatch
import io
import os
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.contract import runuri

CODE_ARCHIVE = "code.tar.gz"
MAX_NAMED = 20
"""At most this many left-out paths are named (then "and N more")."""


@dataclass
class CodeFiles:
    folder: str
    files: list[tuple[str, int]] = field(default_factory=list)  # (relative path, bytes)
    left_out: list[str] = field(default_factory=list)            # "path (why)"

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.files)

    def warnings(self) -> list[str]:
        named = self.left_out[:MAX_NAMED]
        more = len(self.left_out) - len(named)
        return named + ([f"and {more} more"] if more > 0 else [])


def _git_lists(folder: Path) -> tuple[list[str], list[str]] | None:
    """(files git would ship: tracked + untracked not ignored, ignored paths with folders
    collapsed), relative to ``folder``; None outside a git work tree or without git."""
    def run(*args: str) -> list[str] | None:
        try:
            r = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if r.returncode != 0:
            return None
        return [x for x in r.stdout.decode(errors="replace").split("\0") if x]

    inside = run("rev-parse", "--is-inside-work-tree")
    if not inside:
        return None
    keep = run("ls-files", "-z", "--cached", "--others", "--exclude-standard")
    ignored = run("ls-files", "-z", "--others", "--ignored", "--exclude-standard", "--directory")
    if keep is None:
        return None
    return keep, [x.rstrip("/") for x in ignored or []]


def _gitignore_patterns(folder: Path) -> list[str]:
    try:
        lines = (folder / ".gitignore").read_text().splitlines()
    except OSError:
        return []
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith(("#", "!"))]


def _ignored(rel: str, is_dir: bool, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for pat in patterns:
        dir_only = pat.endswith("/")
        p = pat.strip("/")
        if dir_only and not is_dir:
            continue
        if "/" in pat.rstrip("/"):  # anchored to the folder
            if fnmatch.fnmatch(rel, p):
                return True
        elif fnmatch.fnmatch(name, p):
            return True
    return False


def _walk_plain(folder: Path) -> tuple[list[str], list[str]]:
    """Without git: every file, less what the folder's .gitignore names (fnmatch subset of
    git's rules: no negation, no ``**``)."""
    pats = _gitignore_patterns(folder)
    keep, ignored = [], []
    for root, dirs, files in os.walk(folder):
        rroot = os.path.relpath(root, folder)
        rroot = "" if rroot == "." else rroot + "/"
        for d in list(dirs):
            if d == ".git":
                dirs.remove(d)
            elif _ignored(rroot + d, True, pats):
                ignored.append(rroot + d)
                dirs.remove(d)
        for f in files:
            (ignored if _ignored(rroot + f, False, pats) else keep).append(rroot + f)
    return sorted(keep), sorted(ignored)


def code_files(folder: str, max_file_mb: float, exclude: tuple[str, ...] = ()) -> CodeFiles:
    """The files to ship from ``folder`` and what is left out (with the reason)."""
    root = Path(folder)
    lists = _git_lists(root)
    keep, ignored = lists if lists is not None else _walk_plain(root)
    out = CodeFiles(folder=str(root))
    out.left_out += [f"{p} (.gitignore)" for p in sorted(ignored)]
    limit = max_file_mb * 2**20
    ex = [e.rstrip("/") for e in exclude if e and e not in (".", "")]
    for rel in keep:
        if rel.split("/", 1)[0] == ".git":
            continue
        if any(rel == e or rel.startswith(e + "/") for e in ex):
            continue
        p = root / rel
        if p.is_symlink() or not p.is_file():
            continue  # a deleted tracked file, or a link (may point outside the folder)
        size = p.stat().st_size
        if size > limit:
            out.left_out.append(f"{rel} ({size / 2**20:.1f} MiB > command.max_file_mb {max_file_mb:g})")
            continue
        out.files.append((rel, size))
    for e in ex:
        out.left_out.append(f"{e} (the run URI)")
    return out


def _run_dir_inside(spec: Any) -> tuple[str, ...]:
    lp = runuri.local_path(spec.run_uri)
    if lp is None:
        return ()
    try:
        rel = Path(lp).resolve().relative_to(Path(spec.command.code).resolve())
    except ValueError:
        return ()
    return (rel.as_posix(),)


def spec_code_files(spec: Any) -> CodeFiles:
    c = spec.command
    return code_files(c.code, c.max_file_mb, exclude=_run_dir_inside(spec))


def code_report(spec: Any) -> dict[str, Any]:
    """What the dry run shows: the folder, file count, bytes, and what is left out (named)."""
    cf = spec_code_files(spec)
    return {"folder": cf.folder, "files": len(cf.files), "bytes": cf.bytes, "left_out": cf.warnings()}


def pack(spec: Any) -> tuple[CodeFiles, str]:
    """Write the code archive to ``<run-uri>/code.tar.gz``; (the files, the archive's URI)."""
    cf = spec_code_files(spec)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel, _ in cf.files:
            tar.add(os.path.join(cf.folder, rel), arcname=rel, recursive=False)
    uri = runuri.join(spec.run_uri, CODE_ARCHIVE)
    import tempfile

    fd, tmp = tempfile.mkstemp(suffix=".tar.gz")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buf.getvalue())
        runuri.put_file(tmp, uri)
    finally:
        os.unlink(tmp)
    return cf, uri


def ship_event(spec: Any) -> str:
    """Pack and upload the code; the controller's event line (what was left out, named)."""
    cf, uri = pack(spec)
    msg = f"code: {len(cf.files)} files ({cf.bytes / 2**20:.1f} MiB) from {cf.folder} → {uri}"
    if cf.left_out:
        msg += "; not shipped: " + ", ".join(cf.warnings())
    return msg

"""Write a small text corpus from the docstrings of this Python's standard library.

    python examples/stdlib_corpus.py OUT_DIR [--max-mb N]

One ``.txt`` file per stdlib module (its module, class and function docstrings, blank-line
separated); nothing leaves the machine and nothing is copied into the repository. Used by
``make demo`` and ``benchmarks/bench_data_prepare.py``.
"""

from __future__ import annotations

import argparse
import ast
import sysconfig
from pathlib import Path


def build(out: Path, max_mb: float = 8.0) -> tuple[int, int]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    out.mkdir(parents=True, exist_ok=True)
    files = total = 0
    for f in sorted(lib.rglob("*.py")):
        if any(p in f.parts for p in ("site-packages", "test", "tests", "idlelib", "lib2to3")):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        docs = [ast.get_docstring(n) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        docs = [d for d in docs if d and len(d) > 40]
        if not docs:
            continue
        text = "\n\n".join(docs) + "\n"
        name = "_".join(f.relative_to(lib).with_suffix("").parts) + ".txt"
        target = out / name
        if not target.exists() or target.read_text(encoding="utf-8") != text:  # a rerun leaves files as they are
            target.write_text(text, encoding="utf-8")
        files += 1
        total += len(text.encode())
        if total >= max_mb * 1e6:
            break
    return files, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--max-mb", type=float, default=8.0)
    a = ap.parse_args()
    files, total = build(Path(a.out), a.max_mb)
    print(f"{a.out}: {files} files, {total / 1e6:.1f} MB of standard-library docstrings")


if __name__ == "__main__":
    main()

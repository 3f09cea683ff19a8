"""The layout stays true: imports never cross the lines the package docstrings draw.

Reads every module's imports with ``ast`` (lazy imports inside functions included, since they run
too) and fails naming the file, the line and the rule. See ``orchestrator/__init__.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "providers", "trainer", "infra")
HEAVY = ("torch", "sky", "modal", "boto3", "botocore", "s3fs")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, at module level) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    for n in tree.body:  # imports under a top-level `if`/`try` also run at import time
        if isinstance(n, (ast.If, ast.Try)):
            top.update(id(c) for c in ast.walk(n))
    mod = _module_name(path)
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names]
            out += [(node.lineno, n, id(node) in top) for n in names]
    return out


def _all_files() -> list[Path]:
    files = []
    for pkg in PACKAGES:
        files += sorted(p for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


RULES = [
    # (who, what it may not import, why)
    ("orchestrator.contract", ("orchestrator.plan", "orchestrator.run", "orchestrator.cli", "providers", "trainer")
     + HEAVY, "contract is the bottom layer: it imports nothing of dtrun"),
    ("orchestrator.plan", ("orchestrator.run", "orchestrator.cli", "trainer") + HEAVY,
     "plan is pure Python: no run/, cli/, trainer, torch or provider SDK"),
    ("orchestrator.run", ("orchestrator.cli",), "nothing imports cli"),
    ("providers", ("orchestrator.plan", "orchestrator.run", "orchestrator.cli", "trainer"),
     "providers import only orchestrator.contract of the orchestrator"),
    ("trainer", ("orchestrator.run", "orchestrator.cli", "providers"),
     "the trainer imports only the contract and the plan (spec, model shapes)"),
    ("infra", ("orchestrator.plan", "orchestrator.run", "orchestrator.cli", "providers"),
     "a node needs only the contract (and the trainer)"),
    ("infra.node_bootstrap", ("torch",), "the node's watchdog never imports torch, so it stays light"),
]


def _violations() -> list[str]:
    bad = []
    for f in _all_files():
        mod = _module_name(f)
        for line, target, _top in _imports(f):
            for who, banned, why in RULES:
                if not _under(mod, who):
                    continue
                for b in banned:
                    if _under(target, b) or (b in HEAVY and target.split(".")[0] == b):
                        bad.append(f"{f.relative_to(ROOT)}:{line}: imports {target} ({why})")
    return bad


def test_no_import_crosses_a_line():
    assert _violations() == []


def test_rules_catch_a_crossing(tmp_path, monkeypatch):
    """The checker itself fails on a crossing (so the test above can fail)."""
    fake = ROOT / "orchestrator" / "plan" / "_layout_probe.py"
    fake.write_text("def f():\n    from orchestrator.run import controller\n")
    try:
        assert any("_layout_probe.py:2" in v for v in _violations())
    finally:
        fake.unlink()


def _module_level_graph() -> dict[str, set[str]]:
    mods = {_module_name(f): f for f in _all_files()}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for _line, target, top in _imports(f):
            if not top:
                continue
            # `from pkg import mod` names a module; `from mod import name` names its module
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != m:
                graph[m].add(target)
    return graph


def _loops(graph: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first walk of ``graph`` meets, as "a → b → a"."""
    seen: dict[str, int] = {}
    stack: list[str] = []
    loops: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if seen.get(n) == 1:
                loops.append(" → ".join(stack[stack.index(n):] + [n]))
            elif n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    return loops


def test_no_import_loops():
    loops = _loops(_module_level_graph())
    # a package importing its own submodule in __init__ is not a loop worth reporting
    loops = [lp for lp in loops if not all(_under(x, lp.split(" → ")[0]) for x in lp.split(" → "))]
    assert loops == []


@pytest.mark.parametrize("pkg", ["orchestrator", "orchestrator/contract", "orchestrator/plan", "orchestrator/run",
                                 "orchestrator/cli", "providers", "trainer"])
def test_every_package_says_what_it_is_for(pkg):
    doc = ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text()))
    assert doc and "import" in doc, f"{pkg}/__init__.py: docstring must say what it is for and what it may import"


def _package_of(mods: dict[str, Path], m: str) -> str:
    return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]


def _lazy_loops(mods: dict[str, Path]) -> list[str]:
    """Import loops between modules of one package, lazy imports (inside functions) included:
    two modules that need each other belong in one place (or their shared part in a third)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for _line, target, _top in _imports(f):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if (target and target != m and mods[target].name != "__init__.py"
                    and _package_of(mods, target) == _package_of(mods, m)):
                graph[m].add(target)
    return _loops(graph)


def test_no_lazy_import_loops_inside_a_package():
    assert _lazy_loops({_module_name(f): f for f in _all_files()}) == []


def test_lazy_loop_check_catches_a_loop_hidden_in_functions():
    """Two modules of orchestrator/cli importing each other only inside functions are reported."""
    mods = {_module_name(f): f for f in _all_files()}
    a = ROOT / "orchestrator" / "cli" / "_layout_probe_a.py"
    b = ROOT / "orchestrator" / "cli" / "_layout_probe_b.py"
    a.write_text("def f():\n    from orchestrator.cli import _layout_probe_b\n")
    b.write_text("def g():\n    from orchestrator.cli._layout_probe_a import f\n")
    try:
        mods.update({_module_name(a): a, _module_name(b): b})
        loops = _lazy_loops(mods)
        assert any("_layout_probe_a" in lp and "_layout_probe_b" in lp for lp in loops)
    finally:
        a.unlink()
        b.unlink()

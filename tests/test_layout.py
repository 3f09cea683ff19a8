"""The layout stays true: imports never cross the lines the package docstrings draw.

Reads every module's imports with ``ast`` (lazy imports inside functions included, since they run
too) and fails naming the file, the line and the rule. See ``orchestrator/__init__.py``. Also: no
import loops (at module level anywhere; through lazy imports inside a package and across
packages). Each check has a probe test that proves it can fail.
"""

from __future__ import annotations

import ast
import functools
from fnmatch import fnmatchcase
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


def _imports(path: Path, mod: str | None = None) -> list[tuple[int, str, bool]]:
    """(line, imported module, at module level) for every import in the file (``mod``: its module
    name, when the file is not under the repository — the probes below)."""
    st = path.stat()
    return list(_imports_of(str(path), st.st_mtime_ns, st.st_size, mod or _module_name(path)))


@functools.lru_cache(maxsize=None)
def _imports_of(file: str, _mtime_ns: int, _size: int, mod: str) -> tuple[tuple[int, str, bool], ...]:
    """:func:`_imports`, parsed once per version of the file (the checks below walk every file
    several times)."""
    path = Path(file)
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    for n in tree.body:  # imports under a top-level `if`/`try` also run at import time
        if isinstance(n, (ast.If, ast.Try)):
            top.update(id(c) for c in ast.walk(n))
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
    return tuple(out)


def _all_files() -> list[Path]:
    files = []
    for pkg in PACKAGES:
        files += sorted(p for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


RULES = [
    # (who, what it may not import, why); who is a module prefix, or a pattern with "*"
    ("orchestrator.contract", ("orchestrator.plan", "orchestrator.run", "orchestrator.cli", "providers", "trainer")
     + HEAVY, "contract is the bottom layer: it imports nothing of dtrun"),
    ("orchestrator.plan", ("orchestrator.run", "orchestrator.cli", "trainer") + HEAVY,
     "plan is pure Python: no run/, cli/, trainer, torch or provider SDK"),
    ("orchestrator.run", ("orchestrator.cli",), "nothing imports cli"),
    ("orchestrator.run", ("orchestrator.dashboard",), "the dashboard reads run/; run/ never imports it"),
    ("orchestrator.dashboard", ("orchestrator.cli", "trainer") + HEAVY,
     "the dashboard reads the state store and the run URI; it imports no cli, trainer or SDK"),
    ("orchestrator.run", ("orchestrator.server",), "the server builds on run/, not the other way round"),
    ("orchestrator.server", ("orchestrator.cli", "trainer"),
     "the server's state and replicas import contract, plan, run and providers; never cli or the trainer"),
    ("orchestrator.run", ("trainer",),
     "run/ reaches the trainer only through the contract (the run URI, the dataset) or a subprocess"),
    ("providers", ("orchestrator.plan", "orchestrator.run", "orchestrator.cli", "trainer"),
     "providers import only orchestrator.contract of the orchestrator"),
    ("trainer", ("orchestrator.run", "orchestrator.cli", "providers"),
     "the trainer imports only the contract and the plan (spec, model shapes)"),
    ("infra", ("orchestrator.plan", "orchestrator.run", "orchestrator.cli", "providers"),
     "a node needs only the contract (and the trainer)"),
    ("infra.node*", ("torch",),
     "the node's own process (bootstrap, config, network, process tree, watchdog, log, report, setup) "
     "never imports torch, so it stays light and outlives the trainer"),
]


def _ruled(mod: str, who: str) -> bool:
    return fnmatchcase(mod, who) if "*" in who else _under(mod, who)


def _violations(extra: dict[str, Path] | None = None) -> list[str]:
    """Every import that breaks a rule; ``extra``: more modules (name → file) to check."""
    bad = []
    files = {_module_name(f): f for f in _all_files()} | (extra or {})
    for mod, f in files.items():
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
        for line, target, _top in _imports(f, mod):
            for who, banned, why in RULES:
                if not _ruled(mod, who):
                    continue
                for b in banned:
                    if _under(target, b) or (b in HEAVY and target.split(".")[0] == b):
                        bad.append(f"{where}:{line}: imports {target} ({why})")
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


@pytest.mark.parametrize("mod, body, rule", [
    ("orchestrator.run._probe", "def f():\n    from trainer.shardlist import list_shards\n", "run/ reaches the trainer"),
    ("orchestrator.run._probe", "import trainer.preflight\n", "run/ reaches the trainer"),
    ("infra.node_watchdog_probe", "def f():\n    import torch.distributed\n", "never imports torch"),
    ("infra.node.watchdog", "from torch import cuda\n", "never imports torch"),
])
def test_each_new_rule_catches_its_crossing(tmp_path, mod, body, rule):
    """``run → trainer`` (lazy or not) and torch in a node module are reported (so the rules can fail)."""
    f = tmp_path / "probe.py"
    f.write_text(body)
    assert [v for v in _violations({mod: f}) if str(f) in v and rule in v]


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
                                 "orchestrator/server", "orchestrator/cli", "providers", "trainer"])
def test_every_package_says_what_it_is_for(pkg):
    doc = ast.get_docstring(ast.parse((ROOT / pkg / "__init__.py").read_text()))
    assert doc and "import" in doc, f"{pkg}/__init__.py: docstring must say what it is for and what it may import"


def _package_of(mods: dict[str, Path], m: str) -> str:
    return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]


def _lazy_loops(mods: dict[str, Path], across: bool = False) -> list[str]:
    """Import loops between modules of one package, lazy imports (inside functions) included:
    two modules that need each other belong in one place (or their shared part in a third).

    ``across``: the loops whose modules are in more than one package instead (``providers.catalog``
    ↔ ``providers.skypilot.prices`` was one), imports of a package's ``__init__`` included; a
    package's ``__init__`` importing its own submodules that import it back is not counted (as in
    :func:`test_no_import_loops`)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for _line, target, _top in _imports(f, m):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if not target or target == m:
                continue
            if across or (mods[target].name != "__init__.py"
                          and _package_of(mods, target) == _package_of(mods, m)):
                graph[m].add(target)
    loops = _loops(graph)
    if not across:
        return loops
    out = []
    for lp in loops:
        names = lp.split(" → ")
        if len({_package_of(mods, x) for x in names}) > 1 and not all(_under(x, names[0]) for x in names):
            out.append(lp)
    return out


def test_no_lazy_import_loops_inside_a_package():
    assert _lazy_loops({_module_name(f): f for f in _all_files()}) == []


def test_no_lazy_import_loops_across_packages():
    assert _lazy_loops({_module_name(f): f for f in _all_files()}, across=True) == []


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


def test_lazy_loop_check_catches_a_loop_across_packages(tmp_path):
    """A module of providers/ and one of providers/skypilot/ importing each other only inside
    functions (the shape of the old catalog ↔ prices circle) are reported; the same pair inside one
    package is left to the check above, and a package's __init__ importing its submodule is not."""
    mods = {_module_name(f): f for f in _all_files()}
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from providers.skypilot import _probe_prices\n")
    b.write_text("def g():\n    from providers._probe_catalog import f\n    return f\n")
    loops = _lazy_loops({**mods, "providers._probe_catalog": a, "providers.skypilot._probe_prices": b}, across=True)
    assert any("providers._probe_catalog" in lp and "providers.skypilot._probe_prices" in lp for lp in loops)
    # through a package's __init__ (a re-export) it is the same circle
    c = tmp_path / "c.py"
    c.write_text("def f():\n    from providers.skypilot import SkyPilotProvider\n")
    d = tmp_path / "d.py"
    d.write_text("from providers.skypilot._probe_provider import SkyPilotProvider\n")
    e = tmp_path / "e.py"
    e.write_text("class SkyPilotProvider:\n    def go(self):\n        from providers._probe_catalog import f\n")
    loops = _lazy_loops({**mods, "providers._probe_catalog": c, "providers.skypilot": d,
                         "providers.skypilot._probe_provider": e}, across=True)
    assert any("providers._probe_catalog" in lp and "providers.skypilot._probe_provider" in lp for lp in loops)
    # one package's own loop is not reported here
    loops = _lazy_loops({**mods, "providers._probe_a": a, "providers._probe_b": b}, across=True)
    assert not any("_probe" in lp for lp in loops)

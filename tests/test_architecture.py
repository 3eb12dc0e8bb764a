"""The layers of docs/architecture.md hold: every import runs downward (or stays in its own
folder), no import cycle of any length, and every module is placed in a layer."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "osdp_fx"

LAYERS: list[tuple[str, ...]] = [
    ("_version",),
    ("errors",),
    ("units",),
    ("core",),
    ("plan",),
    ("cost_models", "runtime"),  # side by side: neither imports the other
    ("passes",),
    ("planner",),
    ("module",),
    ("training",),
    ("api",),
    ("examples",),
    ("",),  # the package's __init__: the public names
    ("cli",),
    ("__main__",),
]
"""Bottom first: a module may import its own folder and any layer below its own."""

def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (at any depth in the file)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                member = f"{target}.{alias.name}"
                found.add(member if member in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


MODULES = _modules()
IMPORTS = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def _folder(module: str) -> str:
    """The top-level folder (or module) of ``osdp_fx`` that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    folder = _folder(module)
    return next(i for i, names in enumerate(LAYERS) if folder in names)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_parser_sees_the_package():
    assert "osdp_fx.api" in MODULES and "osdp_fx.plan.plan" in IMPORTS["osdp_fx.module"]
    assert "osdp_fx.runtime.collectives" in IMPORTS["osdp_fx.runtime.hierarchy"]


def test_the_cycle_finder_finds_a_long_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}}) == []


def test_every_module_has_a_layer():
    unplaced = [m for m in MODULES if not any(_folder(m) in names for names in LAYERS)]
    assert not unplaced, unplaced


def test_imports_run_downward():
    wrong = [f"{a} imports {b}" for a, targets in IMPORTS.items() for b in targets
             if _folder(a) != _folder(b) and _layer(b) >= _layer(a)]
    assert not wrong, wrong


def test_no_import_cycle():
    assert not _cycles(IMPORTS)


def test_every_module_is_in_the_architecture_doc():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [m for m, path in MODULES.items() if path.name != "__init__.py"
               and str(path.relative_to(PACKAGE)) not in doc]
    assert not missing, missing


def test_test_files_have_distinct_names():
    """pytest imports test files by their base name (the test folders are not packages), so two
    files of one name in different folders fail to collect together (``import file mismatch``)."""
    names = sorted(p.name for p in (PACKAGE.parent / "tests").rglob("test_*.py"))
    assert not {n for n in names if names.count(n) > 1}

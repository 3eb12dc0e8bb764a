"""The layers of docs/architecture.md hold: the cost models import neither the runtime nor the
passes, no two modules import each other, and modules and classes stay small enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "osdp_fx"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 150


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


def test_the_parser_sees_the_package():
    assert "osdp_fx.api" in MODULES and "osdp_fx.plan" in IMPORTS["osdp_fx.api"]
    assert "osdp_fx.runtime.collectives" in IMPORTS["osdp_fx.runtime.hierarchy"]


def test_cost_models_import_neither_runtime_nor_passes():
    wrong = [f"{a} imports {b}" for a, targets in IMPORTS.items()
             if a.startswith("osdp_fx.cost_models") for b in targets
             if b.startswith(("osdp_fx.runtime", "osdp_fx.passes"))]
    assert not wrong, wrong


@pytest.mark.parametrize("base", ["osdp_fx.strategies", "osdp_fx.layout", "osdp_fx.buckets",
                                  "osdp_fx.units", "osdp_fx.errors"])
def test_base_modules_import_no_layer_above(base):
    allowed = {"osdp_fx.strategies", "osdp_fx.layout", "osdp_fx.buckets", "osdp_fx.units",
               "osdp_fx.errors"}
    assert IMPORTS[base] <= allowed, IMPORTS[base] - allowed


def test_no_two_modules_import_each_other():
    mutual = sorted({tuple(sorted((a, b))) for a, targets in IMPORTS.items() for b in targets
                     if a in IMPORTS.get(b, set())})
    assert not mutual, mutual


def test_modules_and_classes_are_small():
    long_modules = {n: len(p.read_text().splitlines()) for n, p in MODULES.items()
                    if len(p.read_text().splitlines()) > MAX_MODULE_LINES}
    long_classes = {f"{n}.{c.name}": c.end_lineno - c.lineno + 1
                    for n, p in MODULES.items() for c in ast.walk(ast.parse(p.read_text()))
                    if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > MAX_CLASS_LINES}
    assert not long_modules and not long_classes, (long_modules, long_classes)

"""The Python blocks of docs/finetuning.md are self-contained: each compiles, every name it reads
is imported or defined in the block itself (or is a builtin), and it runs as written."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF_CONTAINED = [ROOT / "docs" / "finetuning.md"]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def unbound_names(source: str) -> set[str]:
    """Names ``source`` reads that it never imports, assigns, defines or takes as an argument,
    and that are not builtins (scopes are not told apart: simple, and enough for snippets)."""
    tree = ast.parse(source)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


def test_the_name_check_finds_a_missing_import():
    assert unbound_names("import torch\nx = torch.zeros(1)\n") == set()
    assert unbound_names("from torch import nn\nclass A(nn.Module):\n"
                         "    def f(self, x):\n        return torch.relu(x)\n") == {"torch"}


@pytest.mark.parametrize("path", SELF_CONTAINED, ids=lambda p: p.name)
def test_every_python_block_imports_what_it_uses_and_runs(path):
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no python block"
    for i, block in enumerate(blocks):
        code = compile(block, f"{path.name}, python block {i + 1}", "exec")
        missing = unbound_names(block)
        assert not missing, f"{path.name}, python block {i + 1} uses {sorted(missing)} unimported"
        exec(code, {"__name__": f"snippet_{i}"})

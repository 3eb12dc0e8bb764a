"""The test tiers (``harness/tiers.py``) name tests that exist: a test renamed without its tier
entry would move between the gate CI runs and the end-to-end tier without anyone seeing it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from harness import tiers

TESTS = Path(__file__).resolve().parent


def defined_tests(module: str) -> set[str]:
    """The names of the test functions defined at the top level of ``tests/<module>``."""
    tree = ast.parse((TESTS / module).read_text())
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test")}


@pytest.mark.parametrize("module", sorted(tiers.SLOW_MODULES | set(tiers.FAST_CASES)
                                          | set(tiers.SLOW_CASES)))
def test_every_module_and_test_the_tiers_name_exists(module):
    assert (TESTS / module).is_file(), f"tiers.py names {module}, which is not a test module"
    defined = defined_tests(module)
    for table in (tiers.FAST_CASES, tiers.SLOW_CASES):
        named = getattr(table.get(module), "names", ())
        missing = sorted(set(named) - defined)
        assert not missing, f"tiers.py names {missing} in {module}, which defines no such test"


def test_the_check_finds_a_name_that_is_not_a_test():
    predicate = tiers._names("test_that_is_not_there", test_quiet_silences_progress=tiers._is())
    assert set(predicate.names) - defined_tests("core/test_progress.py") == {
        "test_that_is_not_there"}

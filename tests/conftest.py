"""Shared fixtures: persistent multi-process gloo worlds, reused across test cases."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Searched plans are not cached across test cases (each case searches, as it asserts on the
# search); tests of the plan cache pass plan_cache= a directory of their own.
os.environ["OSDP_FX_PLAN_CACHE"] = "off"

from harness import shared_captures  # noqa: E402
from harness.tiers import is_slow  # noqa: E402
from harness.world import World, freeze_imported_objects  # noqa: E402

# The processes of a session (the pytest workers and their ranks, which inherit the variable)
# keep exported programs in one directory; the process that makes it removes it at the end.
_capture_dir = None
if shared_captures.CAPTURE_DIR_ENV not in os.environ:
    _capture_dir = os.environ[shared_captures.CAPTURE_DIR_ENV] = tempfile.mkdtemp(
        prefix="osdp-captures-")
shared_captures.install()  # cases share captures of the same Hugging Face model
freeze_imported_objects()

_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_unconfigure(config):
    if _capture_dir is not None:
        shutil.rmtree(_capture_dir, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the slow tier (``harness/tiers.py``): ``pytest -m "not slow"`` leaves it out."""
    for item in items:
        module = os.path.relpath(str(item.path), _TESTS).replace(os.sep, "/")
        params = item.callspec.params if hasattr(item, "callspec") else {}
        name = getattr(item, "originalname", None) or item.name
        if is_slow(module, name, params):
            item.add_marker(pytest.mark.slow)


_worlds: dict[int, World] = {}


def get_world(size: int) -> World:
    """A live world of ``size`` gloo ranks, started on first use and kept for the session."""
    world = _worlds.get(size)
    if world is None or not world.alive():
        world = _worlds[size] = World(size)
    return world


@pytest.fixture(scope="session")
def worlds():
    yield get_world
    for world in _worlds.values():
        world.close()
    _worlds.clear()

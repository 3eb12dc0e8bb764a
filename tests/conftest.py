"""Shared fixtures: persistent multi-process gloo worlds, reused across test cases."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Searched plans are not cached across test cases (each case searches, as it asserts on the
# search); tests of the plan cache pass plan_cache= a directory of their own.
os.environ["OSDP_FX_PLAN_CACHE"] = "off"

from harness import schedule
from harness.tiers import is_slow  # noqa: E402
from harness.world import World, freeze_imported_objects  # noqa: E402

freeze_imported_objects()

_TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the slow tier (``harness/tiers.py``): ``pytest -m "not slow"`` leaves it out; order
    the tests longest first, each group marked for one xdist worker (``harness/schedule.py``)."""
    slow = []
    for item in items:
        module = os.path.relpath(str(item.path), _TESTS).replace(os.sep, "/")
        params = item.callspec.params if hasattr(item, "callspec") else {}
        name = getattr(item, "originalname", None) or item.name
        slow.append(is_slow(module, name, params) or item.get_closest_marker("slow") is not None)
        if slow[-1]:
            item.add_marker(pytest.mark.slow)
        group = schedule.group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items[:] = schedule.order(items, slow)


def pytest_configure(config):
    """``pytest -n N`` distributes with ``--dist loadgroup`` unless ``--dist`` is given: each
    worker takes the next test as its queue runs low, a group's tests all on one worker
    (``harness/schedule.py``). xdist's default, ``load``, hands out runs of consecutive tests:
    the longest, collected first, would all go to one worker."""
    if not config.pluginmanager.hasplugin("xdist"):  # the mark is xdist's
        config.addinivalue_line("markers", "xdist_group(name): tests that run on one worker")
        return
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # an xdist worker: it marks the grouped tests' node ids
        config.option.loadgroup = config.option.loadgroup or workerinput.get("osdp_loadgroup")
        return
    given = any(a == "--dist" or a.startswith("--dist=") for a in config.invocation_params.args)
    if getattr(config.option, "dist", "no") == "load" and not given:
        config.option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["osdp_loadgroup"] = node.config.getvalue("dist") == "loadgroup"


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

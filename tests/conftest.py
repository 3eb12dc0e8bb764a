"""Shared fixtures: persistent multi-process gloo worlds, reused across test cases."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Two pytest workers share the machine's cores: each gets its share of intra-op threads, as
# torchrun gives each rank one, since a pool larger than its cores makes every small operator
# wait on threads that are not running (Devices.detect's selective-checkpoint figure measured 0)
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

sys.path.insert(0, os.path.dirname(__file__))

from harness.world import World, freeze_imported_objects  # noqa: E402

freeze_imported_objects()

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

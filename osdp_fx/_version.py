"""The version of osdp-fx (``osdp_fx.__version__``) and the torch releases its features need, at
the bottom of the layers so that any module may read them (the plan cache keys plans by the
version). This module imports nothing: ``osdp_fx/__init__.py`` checks the installed torch
against :data:`TORCH_FLOOR` before any module that needs it is imported."""

from __future__ import annotations

import re

VERSION = "0.2.0.dev0"

TORCH_FLOOR = (2, 6)
"""The oldest torch release osdp-fx runs on (``pyproject.toml`` declares it): compile_osdp,
training under every plan, ``state_dict`` and checkpoints use DTensor (public in
``torch.distributed.tensor``), DeviceMesh and torch.distributed.checkpoint as torch 2.6 has them."""

TORCH_COMPILE_FLOOR = (2, 7)
"""The oldest torch release under which ``torch.compile`` of a compiled module works: the first
with dynamo's per-code execution strategies (``runtime/compile_support.py`` checks for them)."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.13.0+cpu' -> (2, 13), '2.7.0a0+git1' -> (2, 7)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found[1]), int(found[2])


def torch_too_old(version: str) -> str | None:
    """Why osdp-fx cannot run on torch ``version`` and what to do, or None when it can."""
    if torch_release(version) >= TORCH_FLOOR:
        return None
    floor = ".".join(map(str, TORCH_FLOOR))
    return (f"osdp-fx needs torch {floor} or newer (DTensor parameters, DeviceMesh and "
            f"torch.distributed.checkpoint as {floor} has them); this is torch {version}. "
            f"Upgrade it, e.g. pip install 'torch>={floor}' (2.13 is tested on the CPU, 2.11 "
            f"on a GPU)")

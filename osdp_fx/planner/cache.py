"""A cache of searched plans: a restarted job plans at once, and plans the same.

A search measures (node times, the devices' links) and so may choose differently from run to
run; a restart after a failure would pay the search again and might not choose the plan its
checkpoint was trained under. ``compile_osdp`` therefore keeps each searched plan in a cache
directory under a key of everything the search depends on that does not change between runs:

* the captured graph (its code), its parameters' names, shapes, dtypes and trainability;
* the example inputs' shapes and dtypes (and the largest shape planned for);
* the world asked for (the ``Devices`` record before measuring: size, ranks per node, memory
  limit, and every figure when given; when they are to be measured, that they are), the
  model's device;
* the step (``StepSetting``: optimizer, mixed precision, gradient accumulation, schedule) and
  what the search may vary (``SearchOptions``: batch sizes, splits, recomputation, prefetch,
  autotuning, the largest shape);
* the versions of osdp-fx and torch, and a digest of osdp-fx's own source files
  (:func:`code_digest`: a checkout whose code changed under the same version plans afresh).

An entry holds the plan's JSON (``docs/plan-format.md``) and the ``Devices`` it was planned for
(measured ones included), so that a hit predicts with the same figures. Rank 0 looks the key up
and every rank takes its answer; rank 0 writes an entry, atomically, once the plan is final.

The same directory keeps, in its ``devices/`` folder (:class:`DevicesCache`), what
``compile_osdp`` measured of the machine when it was given no ``Devices``: keyed by the host, the
device, the world and its backend, and the code that measures (:func:`devices_key`), so that a
restart plans with the same figures without measuring again.

Where: ``compile_osdp(plan_cache=...)`` (a directory; False: off), else the environment
variable ``OSDP_FX_PLAN_CACHE`` (a directory; ``off`` or ``0``: off), else
``$XDG_CACHE_HOME/osdp_fx/plans`` (``~/.cache/osdp_fx/plans``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import torch

from .._version import VERSION
from ..core.devices import Devices
from ..core.setting import StepSetting
from ..errors import InputError
from ..passes.capture import Captured
from ..plan.plan import Plan
from .make import SearchOptions

CACHE_ENV = "OSDP_FX_PLAN_CACHE"
"""The environment variable naming the cache directory (``off`` or ``0``: no cache)."""
_OFF = ("off", "0", "false", "no")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/osdp_fx/plans``, or ``~/.cache/osdp_fx/plans``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "osdp_fx" / "plans"


def cache_dir(plan_cache: bool | str | os.PathLike[str] | None) -> Path | None:
    """The cache directory ``plan_cache`` asks for (None: no cache)."""
    if plan_cache is False:
        return None
    if isinstance(plan_cache, (str, os.PathLike)) and not isinstance(plan_cache, bool):
        return Path(plan_cache)
    if plan_cache not in (True, None):
        raise InputError(f"plan_cache={plan_cache!r} is not a cache: pass True (the default "
                         "directory), False (no cache) or the path of a directory")
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env)
    return default_cache_dir()


@dataclasses.dataclass(frozen=True)
class CachedPlan:
    """One cache entry."""

    path: Path
    """The entry's file."""
    plan: dict[str, Any]
    """The plan's JSON form."""
    devices: Devices
    """The devices it was planned for (measured ones included)."""


@functools.cache
def code_digest() -> str:
    """A digest of the source of every module of the installed osdp_fx package (read once per
    process)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def plan_key(captured: Captured, inputs: tuple[Any, ...], *, devices: Devices, measured: bool,
             device: torch.device, options: SearchOptions, setting: StepSetting) -> str:
    """The key of a search: a digest of what it depends on (module docstring)."""
    gm = captured.gm
    facts = {
        "versions": [VERSION, torch.__version__, code_digest()],
        "graph": gm.code,
        "params": [[n, list(p.shape), str(p.dtype), p.requires_grad]
                   for n, p in gm.named_parameters(remove_duplicate=False)],
        "inputs": [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x)
                   for x in inputs],
        "world": [devices.world_size, devices.ranks_per_node, devices.memory_bytes],
        "device": [device.type, torch.cuda.get_device_name(device)
                   if device.type == "cuda" else ""],
        "devices": "measured" if measured else dataclasses.asdict(devices),
        "options": repr(options),
        "step": repr(dataclasses.replace(setting, devices=None)),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()


class PlanCache:
    """The plans cached in one directory, by key."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: str) -> Path:
        return self.directory / f"{key[:32]}.json"

    def get(self, key: str) -> CachedPlan | None:
        """The entry of ``key``, or None (absent, or unreadable: then the search runs)."""
        path = self.path(key)
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") != key:
                return None
            return CachedPlan(path, entry["plan"], Devices(**entry["devices"]))
        except (OSError, ValueError, KeyError, TypeError, InputError):
            return None

    def put(self, key: str, plan: Plan, devices: Devices) -> Path | None:
        """Write the entry of ``key`` (atomically); None when the directory is not writable."""
        return _write_entry(self.path(key), {"key": key, "plan": plan.to_dict(),
                                             "devices": dataclasses.asdict(devices)})


def _write_entry(path: Path, entry: dict[str, Any]) -> Path | None:
    """Write ``entry`` as JSON at ``path`` atomically (a temporary file, then a rename); None
    when its directory is not writable."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry, indent=1))
        os.replace(tmp, path)
    except OSError:
        return None
    return path


DEVICES_FOLDER = "devices"
"""The subdirectory of the plan cache that keeps measured devices (:class:`DevicesCache`)."""


def devices_key(devices: Devices, *, backend: str, device: torch.device) -> str:
    """The key of a measurement (``detect_devices``) of this machine for the world of
    ``devices``: the host's name, the device's kind and name and the CPU threads torch uses,
    the world's size, ranks per node and backend, and the code that measures (the versions of
    osdp-fx and torch and :func:`code_digest`)."""
    facts = {
        "versions": [VERSION, torch.__version__, code_digest()],
        "host": socket.gethostname(),
        "device": [device.type, torch.cuda.get_device_name(device)
                   if device.type == "cuda" else "", torch.get_num_threads()],
        "world": [devices.world_size, devices.ranks_per_node, backend],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class CachedDevices:
    """One measurement in the cache."""

    path: Path
    devices: Devices


class DevicesCache:
    """Measured devices by :func:`devices_key`, in one directory (the plan cache's
    :data:`DEVICES_FOLDER`): a restart of the same job on the same machines does not measure
    again, and plans with the same figures."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, key: str) -> Path:
        return self.directory / f"{key[:32]}.json"

    def get(self, key: str) -> CachedDevices | None:
        """The measurement of ``key``, or None (absent or unreadable: then it is measured)."""
        path = self.path(key)
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") != key:
                return None
            return CachedDevices(path, Devices(**entry["devices"]))
        except (OSError, ValueError, KeyError, TypeError, InputError):
            return None

    def put(self, key: str, devices: Devices) -> Path | None:
        """Write the measurement of ``key`` (atomically); None when not writable."""
        return _write_entry(self.path(key), {"key": key, "devices": dataclasses.asdict(devices)})

"""The module paths of osdp-fx 0.1, kept importable for one version with a DeprecationWarning.

0.2 moved the flat modules into subpackages by role (``docs/architecture.md``). ``import
osdp_fx.search`` (or ``from osdp_fx.plan_request import ...``) still works: a finder on
``sys.meta_path`` answers each old name with the module at its new path, the same module object,
so ``isinstance`` checks and monkeypatching see one module. Removed in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "strategies": "core.strategies", "layout": "core.layout", "buckets": "core.buckets",
    "precision": "core.precision", "meta": "core.node_meta", "regions": "core.regions",
    "io_spec": "core.io_spec", "devices": "core.devices", "presets": "core.presets",
    "progress": "core.progress", "storage_tracker": "runtime.storage_tracker",
    "param_table": "runtime.param_table", "plan_request": "plan.request",
    "plan_table": "plan.table", "plan_view": "plan.folded", "plotting": "plan.plot",
    "capture": "passes.capture", "passes.runner": "passes.manager",
    "analysis": "planner.analysis", "search": "planner.search",
    "exhaustive": "planner.exhaustive", "local_search": "planner.local_search",
    "search_margin": "planner.search_margin", "schedule": "planner.schedule_search",
    "solver": "planner.solver", "autotune": "planner.autotune", "detect": "planner.detect",
    "checkpoint": "training.checkpoint", "materialize": "training.materialize",
    "clip": "training.clip",
}
"""Old name -> new name, both relative to ``osdp_fx``. ``plan`` and ``planner`` are packages now
and export what their modules did (``Plan``, ``make_plan``), so they need no entry."""


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new} in osdp-fx 0.2; the old path is removed "
                      "in 0.3", DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at the new path is already executed


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        package, _, rest = fullname.partition(".")
        if package != "osdp_fx" or rest not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(f"osdp_fx.{MOVED[rest]}"))


def install() -> None:
    """Answer the old module paths (once per process)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())

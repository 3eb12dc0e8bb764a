"""The graph passes, declared in one ordered list, and the manager that runs them.

:data:`PIPELINE` is the order of the passes (``docs/architecture.md`` draws it). Each pass states
what it requires of the graph and what it ensures; a graph module records the properties it has
in ``gm.meta["osdp_properties"]`` (capture sets ``normalized``). :class:`PassManager` runs the
passes it is given in the pipeline's order, refuses a pass out of that order or one whose
requirements the graph lacks, names each pass, logs what it did and wraps a failure with the
pass's name. A pass that changes the graph invalidates what was measured on it (splitting or
casting drops ``profiled``, so the graph is profiled again before it is planned).

The search is not a pass: it reads the profiled graph between ``slowest_rank_times`` and
``recompute``, and the planner may split the graph after a first profile (then profiles again),
so the pipeline runs in several calls, each in declared order:

- ``planner/make.py``: ``cast_params``; ``passes/split_linear.py`` (``apply_splits``):
  ``split_linear``, after the cast when the search splits, before it when a plan file names the
  splits (the two commute: splitting the cast graph gives the graph of casting the split one,
  ``tests/passes/test_split_linear.py``);
- ``planner/analysis.py``: ``profile``, ``slowest_rank_times`` (each time the graph changed);
- ``api.py``: ``recompute``, ``annotate_aliases``, then ``shard`` (per autotuned candidate on a
  copy, once on the graph).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

log = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule], PassResult]

PROPERTIES_KEY = "osdp_properties"
"""``gm.meta`` key of the set of properties the graph has (``normalized``, ``profiled``, ...)."""


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """One graph pass of the pipeline."""

    name: str
    """The name the manager knows it by."""
    requires: frozenset[str]
    """Properties the graph must have before it runs."""
    ensures: frozenset[str]
    """Properties the graph has after it."""
    invalidates: frozenset[str] = frozenset()
    """Properties it takes away (what was measured on the graph before it changed)."""


def _spec(name: str, requires: set[str], ensures: set[str],
          invalidates: set[str] = set()) -> PassSpec:  # noqa: B006 (never mutated)
    return PassSpec(name, frozenset(requires), frozenset(ensures), frozenset(invalidates))


PIPELINE: tuple[PassSpec, ...] = (
    _spec("cast_params", {"normalized"}, {"cast"}, {"profiled", "slowest_rank_times"}),
    _spec("split_linear", {"normalized"}, {"split"}, {"profiled", "slowest_rank_times"}),
    _spec("profile", {"normalized"}, {"profiled"}, {"slowest_rank_times"}),
    _spec("slowest_rank_times", {"profiled"}, {"slowest_rank_times"}),
    _spec("recompute", {"normalized"}, {"recomputed"}, {"profiled", "slowest_rank_times"}),
    _spec("annotate_aliases", {"normalized"}, {"aliases"}),
    _spec("shard", {"aliases"}, {"sharded"}),
)
"""Every graph pass, in order (capture and normalisation come first, ``passes/capture.py``; the search
runs between ``slowest_rank_times`` and ``recompute``). Where each lives: ``passes/<module>.py``
of its function, ``<name>_pass`` or the like (``docs/architecture.md``, the pass list)."""


class PassFailed(RuntimeError):
    """A pass raised an internal error (not a user error); the message names the pass."""


def properties(gm: fx.GraphModule) -> set[str]:
    """The properties ``gm`` has (a set stored in its ``meta``)."""
    return gm.meta.setdefault(PROPERTIES_KEY, set())


class PassManager:
    """Runs passes of a declared pipeline on a graph module, in the pipeline's order (in the
    spirit of ``torch.fx.passes.infra.pass_manager.PassManager``, with requirements checked on
    the graph's recorded properties instead of constraints between pass functions)."""

    def __init__(self, pipeline: Sequence[PassSpec] = PIPELINE) -> None:
        self.pipeline = tuple(pipeline)
        self._index = {spec.name: i for i, spec in enumerate(self.pipeline)}

    def __call__(self, gm: fx.GraphModule,
                 passes: Iterable[tuple[str, Pass]]) -> fx.GraphModule:
        """Run ``passes`` (each a pipeline name and the call) on ``gm``; they must come in the
        pipeline's order. Returns the graph module the last pass returned."""
        from ..errors import OSDPError

        last = -1
        for name, fn in passes:
            assert name in self._index, f"pass {name!r} is not in the declared PIPELINE"
            assert self._index[name] > last, (
                f"pass {name!r} given after {self.pipeline[last].name!r}: the PIPELINE runs it "
                "before")
            last = self._index[name]
            spec = self.pipeline[last]
            missing = spec.requires - properties(gm)
            assert not missing, f"pass {name!r} requires a graph that is {sorted(missing)}"
            start = time.perf_counter()
            try:
                result = fn(gm)
            except OSDPError:
                raise
            except Exception as exc:
                raise PassFailed(f"pass {name!r} failed: {type(exc).__name__}: {exc}") from exc
            have = properties(gm) - spec.invalidates | spec.ensures
            gm = result.graph_module
            gm.meta[PROPERTIES_KEY] = have
            log.info("pass %s: %s in %.3f s", name,
                     "modified" if result.modified else "no change", time.perf_counter() - start)
        return gm


run_passes = PassManager()
"""The manager of :data:`PIPELINE`: ``run_passes(gm, [(name, call), ...])``."""

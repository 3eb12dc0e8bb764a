"""The graph passes' pipeline: the order they run in, declared once, and the one runner.

Capture and normalisation come first (``passes/capture.py``: the graph is then ``normalized``).
Then, in declared order (:data:`PIPELINE`), each pass a :class:`GraphPass` next to its function:

- ``cast_params`` (``CastParams``, ``precision.py``): mixed precision, so that the profile
  measures the low-precision computation a step runs;
- ``split_linear`` (``SplitLinear``, ``split_linear.py``): a big linear cut into parts, each
  gathered, freed and sharded on its own;
- ``profile`` (``ProfileGraph``, ``profile.py``): FLOPs, bytes, saved tensors and time per
  node, what the cost models and the search read;
- ``slowest_rank_times`` (``SlowestRankTimes``, ``profile.py``): every rank plans on the same
  node times, the slowest rank's (a data-parallel step goes at its pace);
- ``recompute`` (``RecomputeRegions``, ``recompute.py``): the plan's recomputed regions, each one
  ``RecomputedRegion`` whose activations backward re-creates;
- ``annotate_aliases`` (``AnnotateAliases``, ``aliases.py``): which nodes view which parameters,
  so that the shard pass frees a gathered parameter after its views' last use too;
- ``shard`` (``ShardParameters``, ``shard.py``): the plan's collectives inserted and the parameters
  replaced by this rank's shards.

The search is not a pass: it reads the profiled graph between ``slowest_rank_times`` and
``recompute``. The pipeline runs in several calls of :func:`run_pipeline` (the planner casts,
profiles, may split and profiles again; ``api.py`` recomputes, annotates, then shards copies of
the graph for autotuning and the graph itself), so its order is kept on the graph: ``gm.meta``
records the properties the graph has (``osdp_properties``) and the passes run on it
(``osdp_passes``), and a deep copy of the graph module copies both. The order rule: a pass may
not run after a pass declared later whose results still hold, unless it invalidates them (it
changes what they measured: a split after a profile, which is then profiled again) or the two
commute (:data:`COMMUTING`). A broken contract is a :class:`PassContractError` (a bug of
osdp-fx, not of its user).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable
from typing import ClassVar, NamedTuple, NoReturn

from torch import fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..errors import OSDPError

log = logging.getLogger(__name__)

PIPELINE: tuple[str, ...] = (
    "cast_params", "split_linear", "profile", "slowest_rank_times", "recompute",
    "annotate_aliases", "shard",
)
"""Every graph pass's name, in the order they run (the index above says why each exists)."""

COMMUTING: frozenset[frozenset[str]] = frozenset({frozenset({"cast_params", "split_linear"})})
"""Passes that may run in either order: splitting the cast graph gives the graph of casting the
split one (``tests/passes/test_split_linear.py``), so a plan file's splits are applied before the
cast and the searched ones after it."""

PROPERTIES_KEY = "osdp_properties"
"""``gm.meta`` key of the set of properties the graph has (``normalized``, ``profiled``, ...)."""
HISTORY_KEY = "osdp_passes"
"""``gm.meta`` key of the passes run on the graph, in order (a list of :class:`Ran`)."""


class PassContractError(RuntimeError):
    """A pass ran out of the pipeline's order or on a graph that lacks what it requires: a bug
    of osdp-fx (the message names the pass, what is missing and the passes run before)."""


class PassFailed(RuntimeError):
    """A pass raised an internal error (not a user error); the message names the pass."""


class Ran(NamedTuple):
    """One pass run on a graph: its name and the properties it ensured."""

    name: str
    ensured: frozenset[str]


def properties(gm: fx.GraphModule) -> set[str]:
    """The properties ``gm`` has (a set stored in its ``meta``)."""
    return gm.meta.setdefault(PROPERTIES_KEY, set())


def history(gm: fx.GraphModule) -> list[Ran]:
    """The passes run on ``gm`` so far, in order (a list stored in its ``meta``)."""
    return gm.meta.setdefault(HISTORY_KEY, [])


class GraphPass(PassBase):
    """A pass of :data:`PIPELINE`: its options are its constructor's arguments, its contract
    class keywords, e.g. ``class ShardParameters(GraphPass, name="shard", requires={"aliases"},
    ensures={"sharded"})`` (``invalidates``: the properties it takes away, what was measured on
    the graph before it changed it). ``call`` delegates to the pass's function.

    Calling a pass runs it as torch's ``PassBase`` does (``requires``, ``call``, ``ensures``),
    recording on the graph what it ensured and took away, logging it, and wrapping a failure
    other than an ``OSDPError`` in :class:`PassFailed`."""

    name: ClassVar[str]
    required: ClassVar[frozenset[str]]
    ensured: ClassVar[frozenset[str]]
    invalidated: ClassVar[frozenset[str]]

    def __init_subclass__(cls, *, name: str, requires: Collection[str] = (),
                          ensures: Collection[str] = (), invalidates: Collection[str] = (),
                          **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name not in PIPELINE:
            raise PassContractError(f"pass {name!r} ({cls.__qualname__}) is not in the declared "
                                    "PIPELINE (osdp_fx/passes/pipeline.py)")
        cls.name = name
        cls.required, cls.ensured = frozenset(requires), frozenset(ensures)
        cls.invalidated = frozenset(invalidates)

    def __call__(self, graph_module: fx.GraphModule) -> PassResult:
        self.requires(graph_module)
        after = properties(graph_module) - self.invalidated | self.ensured
        ran = [*history(graph_module), Ran(self.name, self.ensured)]
        start = time.perf_counter()
        try:
            result = self.call(graph_module)
        except OSDPError:
            raise
        except Exception as exc:
            raise PassFailed(f"pass {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        gm = result.graph_module
        gm.meta[PROPERTIES_KEY], gm.meta[HISTORY_KEY] = after, ran
        self.ensures(gm)
        log.debug("pass %s: %s in %.3f s", self.name,
                  "modified" if result.modified else "no change", time.perf_counter() - start)
        return result

    def requires(self, graph_module: fx.GraphModule) -> None:
        """Refuse a graph that lacks a property this pass requires, or on which a pass declared
        after this one has run and still holds (the order rule, module docstring)."""
        missing = self.required - properties(graph_module)
        if missing:
            self._broken(graph_module, f"requires a graph that is {sorted(missing)}")
        late = self._overtaken_by(graph_module)
        if late:
            self._broken(graph_module, f"comes before {late} in the declared PIPELINE, and what "
                         "they did still holds")

    def ensures(self, graph_module: fx.GraphModule) -> None:
        """Check that the graph the pass returned records what the pass ensured and took away."""
        have = properties(graph_module)
        if not self.ensured <= have or self.invalidated & (have - self.ensured):
            self._broken(graph_module, f"left a graph that is {sorted(have)}")

    def _overtaken_by(self, gm: fx.GraphModule) -> list[str]:
        """The passes declared after this one whose results ``gm`` still has and that this pass
        neither invalidates nor commutes with."""
        here, have = PIPELINE.index(self.name), properties(gm)
        return sorted({r.name for r in history(gm)
                       if PIPELINE.index(r.name) > here and r.ensured <= have
                       and not r.ensured & self.invalidated
                       and frozenset({r.name, self.name}) not in COMMUTING})

    def _broken(self, gm: fx.GraphModule, what: str) -> NoReturn:
        ran = [r.name for r in history(gm)] or "none"
        raise PassContractError(f"pass {self.name!r} {what} (passes run on this graph before: "
                                f"{ran}; osdp_fx/passes/pipeline.py)")


def run_pipeline(gm: fx.GraphModule, passes: Iterable[GraphPass], *,
                 skip: Collection[str] = ()) -> fx.GraphModule:
    """Run ``passes`` on ``gm`` in turn, each checked against what ran on the graph before (in
    this call or an earlier one) and what it requires, except those named in ``skip``. Returns
    the graph module the last pass returned."""
    for graph_pass in passes:
        if graph_pass.name in skip:
            log.info("pass %s: skipped", graph_pass.name)
            continue
        gm = graph_pass(gm).graph_module
    return gm

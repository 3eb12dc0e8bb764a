"""The graph passes, declared in one ordered list, and the runner every pass goes through.

:data:`PIPELINE` is the order in which ``compile_osdp`` applies them (``docs/architecture.md``
draws it). Each pass states what it requires of the graph and what it ensures; a graph module
records the properties it has in ``gm.meta["osdp_properties"]`` (capture sets ``normalized``),
and :func:`run_passes` refuses to run a pass whose requirements are not met, names each pass,
logs what it did, wraps a failure with the pass's name, and can turn passes off by name. A
pass that changes the graph invalidates what was measured on it (splitting or casting drops
``profiled``, so the graph is profiled again before it is planned).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

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
    """The name :func:`run_passes` knows it by."""
    module: str
    """Where it lives."""
    requires: frozenset[str]
    """Properties the graph must have before it runs."""
    ensures: frozenset[str]
    """Properties the graph has after it."""
    invalidates: frozenset[str] = frozenset()
    """Properties it takes away (what was measured on the graph before it changed)."""


def _spec(name: str, module: str, requires: set[str], ensures: set[str],
          invalidates: set[str] = set()) -> PassSpec:  # noqa: B006 (never mutated)
    return PassSpec(name, module, frozenset(requires), frozenset(ensures), frozenset(invalidates))


PIPELINE: tuple[PassSpec, ...] = (
    _spec("split_linear", "passes/split_linear.py", {"normalized"}, {"split"},
          {"profiled", "slowest_rank_times"}),
    _spec("cast_params", "passes/precision.py", {"normalized"}, {"cast"},
          {"profiled", "slowest_rank_times"}),
    _spec("profile", "passes/profile.py", {"normalized"}, {"profiled"}, {"slowest_rank_times"}),
    _spec("slowest_rank_times", "passes/profile.py", {"profiled"}, {"slowest_rank_times"}),
    _spec("recompute", "passes/recompute.py", {"normalized"}, {"recomputed"},
          {"profiled", "slowest_rank_times"}),
    _spec("annotate_aliases", "passes/aliases.py", {"normalized"}, {"aliases"}),
    _spec("shard", "passes/shard.py", {"aliases"}, {"sharded"}),
)
"""Every graph pass, in the order compile_osdp runs them (capture and normalisation come first,
``capture.py``; the search runs between ``slowest_rank_times`` and ``annotate_aliases``)."""

_BY_NAME = {spec.name: spec for spec in PIPELINE}


class PassFailed(RuntimeError):
    """A pass raised an internal error (not a user error); the message names the pass."""


def properties(gm: fx.GraphModule) -> set[str]:
    """The properties ``gm`` has (a set stored in its ``meta``)."""
    return gm.meta.setdefault(PROPERTIES_KEY, set())


def run_passes(
    gm: fx.GraphModule, passes: Iterable[tuple[str, Pass]], *, disabled: Iterable[str] = ()
) -> fx.GraphModule:
    """Run ``passes`` (each a name of :data:`PIPELINE` and the call) in order on ``gm``; skip
    those named in ``disabled``."""
    from ..errors import OSDPError

    skip = set(disabled)
    for name, fn in passes:
        spec = _BY_NAME.get(name)
        assert spec is not None, f"pass {name!r} is not in the declared PIPELINE"
        if name in skip:
            log.info("pass %s: disabled", name)
            continue
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
        log.info("pass %s: %s in %.3f s", name, "modified" if result.modified else "no change",
                 time.perf_counter() - start)
    return gm

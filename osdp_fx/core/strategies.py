"""The sharding strategies: one value per strategy and one table of what each does.

Every other module asks this table (:data:`TRAITS`, :func:`traits`) instead of comparing
strategy names. ``N`` ranks form ``n`` nodes of ``R`` ranks each (one node when the mesh is not
given):

============== ============ ================== ================ ==============================
strategy       shard over   between fwd & bwd  gathers          reduces the gradient
============== ============ ================== ================ ==============================
replicate      (none)       full tensor kept   -                all-reduce over N
shard_grad_op  all N ranks  gathered kept      all N            reduce-scatter over N
full_shard     all N ranks  freed, re-gathered all N            reduce-scatter over N
hybrid_shard   R per node   freed, re-gathered R in the node    reduce-scatter over R, then
                                                                all-reduce of the shard over n
hierarchical   all N ranks  freed, re-gathered n across nodes,  reduce-scatter over R, then
                                               then R           over n
============== ============ ================== ================ ==============================

Torch-free: the planner, the cost models and the runtime all read it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal

__all__ = [
    "COLLECTIVES", "Collective", "FREED_AFTER_FORWARD", "FULL_SHARD", "HIERARCHICAL", "HYBRID_SHARD", "MESH_STRATEGIES",
    "REPLICATE", "SHARDED", "SHARD_GRAD_OP", "STRATEGIES", "Strategy", "StrategyTraits",
    "TRAITS", "searched_strategies", "traits",
]


class Strategy(str, enum.Enum):
    """A parameter group's strategy; a ``str`` so that plans and JSON files keep their names."""

    REPLICATE = "replicate"
    SHARD_GRAD_OP = "shard_grad_op"
    FULL_SHARD = "full_shard"
    HYBRID_SHARD = "hybrid_shard"
    HIERARCHICAL = "hierarchical"

    def __str__(self) -> str:
        return self.value


Collective = Literal["all_gather", "reduce_scatter", "all_reduce"]
"""A collective a strategy issues (``StrategyTraits.reduce_stages``, ``layout.Stage``)."""
COLLECTIVES: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce")

Scope = Literal["world", "intra", "inter"]
"""Which ranks a collective stage spans: all ranks, the ranks of one node, or one rank per node
(those with the same local index)."""


@dataclasses.dataclass(frozen=True)
class StrategyTraits:
    """What one strategy does, as the runtime, the cost models and the plan need to know it."""

    shard_over: Literal["none", "world", "node"]
    """How a parameter is cut: not at all, into N chunks (one per rank), or into R chunks (one
    per rank of a node; every node holds all of them)."""
    keeps_gathered: bool
    """The gathered parameter stays alive from its forward to its backward."""
    freed_after_forward: bool
    """The gathered parameter is freed after its last forward use and re-gathered in backward."""
    needs_mesh: bool
    """Its collectives use the nodes x ranks-per-node mesh (on one node it equals full_shard)."""
    chunk_order: Literal["rank", "local", "local_major"]
    """Which chunk rank ``r`` holds: ``r``; its local index ``r % R``; or ``r % R * n + r // R``
    (so that a two-stage gather, across nodes then inside the node, yields chunks in order)."""
    gather_stages: tuple[tuple[Scope, Literal["full", "block"]], ...]
    """All-gather stages in order: (scope, size): 'full' the padded parameter, 'block' 1/R of
    it."""
    reduce_stages: tuple[tuple[str, Scope, Literal["full", "block"]], ...]
    """Gradient reduction stages in order: (collective, scope, size)."""

    @property
    def sharded(self) -> bool:
        return self.shard_over != "none"


TRAITS: dict[Strategy, StrategyTraits] = {
    Strategy.REPLICATE: StrategyTraits(
        "none", keeps_gathered=False, freed_after_forward=False, needs_mesh=False,
        chunk_order="rank", gather_stages=(), reduce_stages=(("all_reduce", "world", "full"),)),
    Strategy.SHARD_GRAD_OP: StrategyTraits(
        "world", keeps_gathered=True, freed_after_forward=False, needs_mesh=False,
        chunk_order="rank", gather_stages=(("world", "full"),),
        reduce_stages=(("reduce_scatter", "world", "full"),)),
    Strategy.FULL_SHARD: StrategyTraits(
        "world", keeps_gathered=False, freed_after_forward=True, needs_mesh=False,
        chunk_order="rank", gather_stages=(("world", "full"),),
        reduce_stages=(("reduce_scatter", "world", "full"),)),
    Strategy.HYBRID_SHARD: StrategyTraits(
        "node", keeps_gathered=False, freed_after_forward=True, needs_mesh=True,
        chunk_order="local", gather_stages=(("intra", "full"),),
        reduce_stages=(("reduce_scatter", "intra", "full"), ("all_reduce", "inter", "block"))),
    Strategy.HIERARCHICAL: StrategyTraits(
        "world", keeps_gathered=False, freed_after_forward=True, needs_mesh=True,
        chunk_order="local_major", gather_stages=(("inter", "block"), ("intra", "full")),
        reduce_stages=(("reduce_scatter", "intra", "full"), ("reduce_scatter", "inter", "block"))),
}


def traits(strategy: str) -> StrategyTraits:
    """The table row of ``strategy`` (a :class:`Strategy` or its name)."""
    row = TRAITS.get(strategy)  # type: ignore[call-overload]  # a name hashes as its member
    return row if row is not None else TRAITS[Strategy(strategy)]


REPLICATE = Strategy.REPLICATE
SHARD_GRAD_OP = Strategy.SHARD_GRAD_OP
FULL_SHARD = Strategy.FULL_SHARD
HYBRID_SHARD = Strategy.HYBRID_SHARD
HIERARCHICAL = Strategy.HIERARCHICAL
STRATEGIES: tuple[Strategy, ...] = tuple(Strategy)
SHARDED = tuple(s for s in Strategy if TRAITS[s].sharded)
MESH_STRATEGIES = tuple(s for s in Strategy if TRAITS[s].needs_mesh)
"""Strategies whose collectives use the nodes x ranks_per_node mesh (equal to full_shard on one
node)."""
FREED_AFTER_FORWARD = tuple(s for s in Strategy if TRAITS[s].freed_after_forward)
"""Strategies that free the gathered parameter after its last forward use and re-gather it."""


def searched_strategies(num_nodes: int) -> list[Strategy]:
    """Strategies the search offers a trainable group: hybrid_shard and hierarchical only on
    several nodes (on one node they equal full_shard)."""
    if num_nodes > 1:
        return list(STRATEGIES)
    return [s for s in STRATEGIES if s not in MESH_STRATEGIES]

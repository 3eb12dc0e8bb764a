"""Shard arithmetic: how many chunks a parameter is cut into, how big each is, which one a rank
holds, and the mesh of nodes x ranks per node. Torch-free: the plan, the cost models and the
runtime all read it.

Ranks are placed node by node, as torchrun numbers them: rank ``r`` runs on node ``r // R`` at
local index ``r % R`` (``R`` ranks per node, ``n`` nodes). A sharded parameter is flattened,
padded to a multiple of its chunk count and cut into equal chunks; which chunk a rank holds
depends on the strategy (``strategies.StrategyTraits.chunk_order``)::

    full_shard, shard_grad_op:  N chunks, rank r holds chunk r
    hybrid_shard:               R chunks, rank r holds chunk r % R (each node holds all R)
    hierarchical:               N chunks, rank (node k, local l) holds chunk l * n + k

The hierarchical order makes the two-stage all-gather (across nodes, then inside the node)
reassemble the flat order (``runtime/hierarchy.py``).
"""

from __future__ import annotations

import dataclasses

from .strategies import traits

WORLD = "world"
"""Name of the default process group (graph nodes carry group names, not group objects)."""


def shard_numel(numel: int, chunks: int) -> int:
    """Elements of each chunk of a ``numel``-element tensor cut into ``chunks`` (padded up)."""
    return -(-numel // chunks)


def shard_count(strategy: str, world_size: int, ranks_per_node: int | None = None) -> int:
    """Distinct flat chunks a parameter under ``strategy`` is cut into: 1 for replicate, the
    ranks of one node for hybrid_shard (every node holds them all), else every rank."""
    over = traits(strategy).shard_over
    if over == "none":
        return 1
    if over == "node":
        return ranks_per_node or world_size
    return world_size


def mesh_shape(world_size: int, ranks_per_node: int | None) -> tuple[int, int]:
    """(nodes, ranks per node) of a world; one node when ``ranks_per_node`` is None."""
    per_node = ranks_per_node or world_size
    return world_size // per_node, per_node


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """Where one rank's shard of a parameter under some strategy lies."""

    group: str
    """Name of the sharding group the graph's all_gather_param node carries."""
    chunks: int
    """Number of distinct flat chunks the padded parameter is cut into."""
    index: int
    """The chunk this rank holds."""
    copies: int
    """Ranks that hold each chunk (the number of nodes for hybrid_shard, else 1)."""


def mesh_group_name(strategy: str, world_size: int, ranks_per_node: int | None) -> str:
    """Name of a two-level sharding group, e.g. ``'hybrid_shard/2x4'`` (2 nodes of 4 ranks)."""
    nodes, per_node = mesh_shape(world_size, ranks_per_node)
    return f"{strategy}/{nodes}x{per_node}"


def shard_layout(strategy: str, *, world_size: int, ranks_per_node: int | None, rank: int,
                 flat_group: str = WORLD) -> ShardLayout:
    """The chunk ``rank`` holds of a parameter sharded under ``strategy`` (module docstring);
    ``flat_group`` names the group of the strategies that need no mesh."""
    nodes, per_node = mesh_shape(world_size, ranks_per_node)
    chunks = shard_count(strategy, world_size, ranks_per_node)
    t = traits(strategy)
    if t.chunk_order == "local":
        index = rank % per_node
    elif t.chunk_order == "local_major":
        index = rank % per_node * nodes + rank // per_node
    else:
        index = rank if chunks > 1 else 0
    group = mesh_group_name(strategy, world_size, ranks_per_node) if t.needs_mesh else flat_group
    return ShardLayout(group, chunks, index, world_size // chunks)

"""Shard arithmetic: how many chunks a parameter is cut into, how big each is, which one a rank
holds, and the mesh of nodes x ranks per node. Torch-free: the plan, the cost models and the
runtime all read it.

Ranks are placed node by node, as torchrun numbers them: rank ``r`` runs on node ``r // R`` at
local index ``r % R`` (``R`` ranks per node, ``n`` nodes). A sharded parameter is flattened,
padded to a multiple of its chunk count of rows (:func:`row_numel`) and cut into equal chunks
of whole rows, so that what a rank holds, less its padding, is ``torch.chunk``'s chunk of dim 0
(a ``DTensor`` sharded on dim 0, as FSDP2's); which chunk a rank holds
depends on the strategy (``strategies.StrategyTraits.chunk_order``)::

    full_shard, shard_grad_op:  N chunks, rank r holds chunk r
    hybrid_shard:               R chunks, rank r holds chunk r % R (each node holds all R)
    hierarchical:               N chunks, rank (node k, local l) holds chunk l * n + k

The hierarchical order makes the two-stage all-gather (across nodes, then inside the node)
reassemble the flat order (``runtime/hierarchy.py``).
"""

from __future__ import annotations

import dataclasses
import math

from ..units import format_bytes
from .strategies import traits

WORLD = "world"
"""Name of the default process group (graph nodes carry group names, not group objects)."""


def row_numel(shape: tuple[int, ...] | list[int]) -> int:
    """Elements of one row (one index of dim 0) of a tensor of ``shape``: shards are cut
    between rows (1 for a 1-D or 0-D tensor)."""
    return max(math.prod(shape[1:]), 1) if len(shape) > 1 else 1


def shard_numel(numel: int, chunks: int, row: int = 1) -> int:
    """Elements of each chunk of a ``numel``-element tensor of rows of ``row`` elements cut into
    ``chunks`` of whole rows, ``ceil(rows / chunks)`` rows each (the last ones padded up)."""
    rows = -(-numel // row)
    return -(-rows // chunks) * row


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


@dataclasses.dataclass(frozen=True)
class Stage:
    """One collective of a parameter group's training step."""

    collective: str
    """'all_gather', 'reduce_scatter' or 'all_reduce'."""
    nbytes: int
    """Bytes of this collective's full buffer: the gathered result, the reduce-scatter's input,
    or the all-reduced tensor."""
    ranks: int
    """Ranks in the group it runs over."""
    scope: str
    """'world' (every rank), 'intra' (the ranks of one node) or 'inter' (the ranks with the same
    local index, one per node)."""

    def spans_nodes(self, num_nodes: int) -> bool:
        """Whether it runs over inter-node links."""
        return self.scope == "inter" or (self.scope == "world" and num_nodes > 1)

    def __str__(self) -> str:
        where = "" if self.scope == "world" else f"[{self.scope}]"
        return f"{self.collective}{where} {format_bytes(self.nbytes)}"


def collective_stages(
    strategy: str,
    numel: int,
    element_size: int,
    *,
    world_size: int,
    ranks_per_node: int | None = None,
    regathered: bool = True,
    trainable: bool = True,
    gather_element_size: int | None = None,
    reduce_element_size: int | None = None,
    row: int = 1,
) -> tuple[list[Stage], list[Stage]]:
    """(forward, backward) collectives of one step of a group of ``numel`` elements of
    ``element_size`` bytes (gathered at ``gather_element_size`` and reduced at
    ``reduce_element_size`` bytes per element, when mixed precision makes them differ), in rows of
``row`` elements.

    With ``N = world_size`` ranks as ``n`` nodes of ``R = ranks_per_node`` and ``Pp`` the bytes
    of the parameter padded to its :func:`shard_count`:

    * replicate: all-reduce of the gradient (``P`` bytes, unpadded) over N ranks;
    * shard_grad_op: all-gather of ``Pp`` over N; reduce-scatter of ``Pp`` over N;
      full_shard also re-gathers in backward when ``regathered`` (an operator saved it);
    * hybrid_shard: all-gather of ``Pp`` over the R ranks of the node (re-gathered likewise);
      reduce-scatter of ``Pp`` over the node, then all-reduce of the ``Pp / R`` shard over the
      n ranks with the same local index;
    * hierarchical: all-gather of ``Pp / R`` over the n ranks with the same local index (each
      brings its shard: inter-node links carry each byte once per node), then of ``Pp`` over the
      node (re-gathered likewise); reduce-scatter of ``Pp`` over the node, then of ``Pp / R``
      across nodes.

    Stages over a single rank are left out, so on one node hybrid_shard and hierarchical have
    full_shard's collectives; nothing is communicated at world size 1. A frozen group (not
    ``trainable``) has no gradient: no all-reduce or reduce-scatter, only its gathers.
    """
    per_node = ranks_per_node or world_size
    nodes = world_size // per_node
    if world_size == 1:
        return [], []
    t = traits(strategy)
    reduced = reduce_element_size or element_size
    if not t.sharded:
        return [], ([Stage("all_reduce", numel * reduced, world_size, "world")]
                    if trainable else [])
    chunks = shard_count(strategy, world_size, ranks_per_node)
    padded_numel = shard_numel(numel, chunks, row) * chunks
    padded, grad = padded_numel * (gather_element_size or element_size), padded_numel * reduced
    ranks = {"world": world_size, "intra": per_node, "inter": nodes}

    def size(nbytes: int, part: str) -> int:
        return nbytes if part == "full" else nbytes // per_node

    gather = [Stage("all_gather", size(padded, part), ranks[scope], scope)
              for scope, part in t.gather_stages]
    scatter = [Stage(collective, size(grad, part), ranks[scope], scope)
               for collective, scope, part in t.reduce_stages] if trainable else []
    again = gather if t.freed_after_forward and regathered else []
    return ([s for s in gather if s.ranks > 1],
            [s for s in again + scatter if s.ranks > 1])


@dataclasses.dataclass(frozen=True)
class SplitSpec:
    """One parameter split into parts along one dimension."""

    name: str
    """Canonical name of the original parameter."""
    dim: int
    """Dimension of the original tensor that is split."""
    parts: tuple[str, ...]
    """Names of the part parameters, in order."""
    sizes: tuple[int, ...]
    """Size of each part along ``dim``."""
    bias_of: str | None = None
    """For a linear's bias: the weight whose split it follows (a plan's ``splits`` names the
    weight alone)."""


def split_weights(names: list[str] | tuple[str, ...] | dict[str, object]) -> dict[str, str]:
    """Among parameter group names, the parts of split weights (``<weight>_part<i>``,
    ``passes/split_linear.py``: ``_part0``, ``_part1``, ... all present) and the weight each is
    a part of. The cost models read a plan's groups with it: the runtime shows a split weight
    as one parameter, whose gradient holds every part's."""
    names = set(names)
    out: dict[str, str] = {}
    for name in names:
        base, sep, index = name.rpartition("_part")
        if not sep or not index.isdigit() or f"{base}_part1" not in names:
            continue
        if all(f"{base}_part{i}" in names for i in range(int(index) + 1)):
            out[name] = base
    return out

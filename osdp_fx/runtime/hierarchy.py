"""The mesh of nodes x ranks per node: its size, its process groups, and the two-level
collectives of ``hybrid_shard`` and ``hierarchical``.

Ranks are placed node by node, as torchrun numbers them: rank ``r`` runs on node
``r // R`` at local index ``r % R`` (``R`` ranks per node, ``n`` nodes). Two kinds of subgroup:

* **intra**: the ``R`` ranks of one node (fast links);
* **inter**: the ``n`` ranks with the same local index, one per node (slow links).

They are the dimensions ``"intra"`` and ``"inter"`` of a ``DeviceMesh`` of shape ``(n, R)``,
created once per world and mesh shape by :func:`init_mesh` (collective: every rank creates the
subgroups in the same order) and registered in :mod:`.collectives` under names, because graph
nodes carry group names, not ProcessGroup objects.

Which flat chunk of a parameter a rank holds is shard arithmetic (``osdp_fx/core/layout.py``). The
hierarchical order makes the two-stage all-gather reassemble the flat order: the inter
all-gather of local index ``l`` concatenates chunks ``l*n .. l*n + n-1`` (a contiguous block
that each node receives once), and the intra all-gather then concatenates the blocks of local
indices ``0 .. R-1``. Its reduce-scatter runs the same stages backwards: inside the node, every
rank ``l`` gets block ``l`` summed over the node; across nodes, chunk ``l*n + k`` of that block
summed over all nodes. Hybrid sharding reduce-scatters inside the node, then all-reduces the
shard across nodes. Every strategy's gradient is the sum over all ``N`` ranks, divided by ``N``
by the caller (:func:`averaging_ranks`).

Like the flat collectives, the two-level ones are started (``*_start``) and waited for later, so
prefetched gathers and reduce-scatters overlap computation: the first stage runs asynchronously,
the second when the result is waited for (:class:`StagedPending`).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..core.layout import (  # noqa: F401
    ShardLayout,
    mesh_group_name,
    mesh_shape,
    shard_count,
    shard_layout,
)
from ..core.strategies import MESH_STRATEGIES, traits
from ..errors import InputError
from .collectives import (
    WORLD,
    Pending,
    all_gather_flat_start,
    all_reduce_sum_,
    forget_named_groups,
    group_size,
    reduce_scatter_flat_start,
    register_group,
)
from .memory import note_resized

log = logging.getLogger(__name__)

LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
"""Environment variable torchrun sets to the number of ranks it started on this node."""


def ranks_per_node_for(devices: Any, world_size: int) -> int | None:
    """Ranks per node of this world, or None when nothing says (one node, or whatever
    ``detect_devices`` finds later).

    In order: ``devices.ranks_per_node`` when the user's Devices gives it (so a world on one
    machine can be treated as several nodes); the ``LOCAL_WORLD_SIZE`` torchrun sets; None.
    """
    given = getattr(devices, "ranks_per_node", None)
    if given is not None:
        return given
    env = os.environ.get(LOCAL_WORLD_SIZE)
    if env is None or world_size == 1:
        return None
    try:
        per_node = int(env)
    except ValueError:
        per_node = 0
    if per_node < 1 or world_size % per_node:
        raise InputError(
            f"{LOCAL_WORLD_SIZE}={env!r} does not divide the world size {world_size}: osdp-fx "
            "needs the same number of ranks on every node; launch every node with the same "
            "torchrun --nproc-per-node, or pass Devices(world_size=..., ranks_per_node=...) to compile_osdp"
        )
    return per_node


@dataclasses.dataclass(frozen=True)
class _TwoLevel:
    """A registered two-level sharding group."""

    strategy: str
    """hybrid_shard or hierarchical."""
    intra: str | None
    """Registered name of this rank's node group; None when a node has one rank."""
    inter: str | None
    """Registered name of this rank's cross-node group; None on one node."""
    chunks: int
    """Shards of a parameter."""
    ranks: int
    """Ranks whose gradients are summed: the world."""


_two_level: dict[str, _TwoLevel] = {}
_meshes: dict[tuple[int, int], tuple[Any, Any]] = {}  # (nodes, per node) -> (world group, mesh)


def init_mesh(world_size: int, ranks_per_node: int | None) -> None:
    """Create (once per world and mesh shape) the intra- and inter-node groups and register the
    two-level sharding groups of :func:`shard_layout` under their names.

    Collective when the mesh has several nodes of several ranks: every rank must call it, in the
    same order relative to other group creations.
    """
    nodes, per_node = mesh_shape(world_size, ranks_per_node)
    intra: str | None = WORLD if per_node > 1 else None
    inter: str | None = WORLD if nodes > 1 else None
    if nodes > 1 and per_node > 1:
        world_group = dist.group.WORLD
        cached = _meshes.get((nodes, per_node))
        if cached is None or cached[0] is not world_group:
            from torch.distributed.device_mesh import init_device_mesh

            device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
            mesh = init_device_mesh(device, (nodes, per_node), mesh_dim_names=("inter", "intra"))
            _meshes[(nodes, per_node)] = (world_group, mesh)
            log.info("mesh of %d nodes x %d ranks: groups created", nodes, per_node)
        mesh = _meshes[(nodes, per_node)][1]
        intra, inter = f"intra/{nodes}x{per_node}", f"inter/{nodes}x{per_node}"
        register_group(intra, mesh.get_group("intra"))
        register_group(inter, mesh.get_group("inter"))
    for strategy in MESH_STRATEGIES:
        _two_level[mesh_group_name(strategy, world_size, ranks_per_node)] = _TwoLevel(
            strategy, intra, inter, shard_count(strategy, world_size, ranks_per_node), world_size)


class StagedPending(Pending):
    """A collective in two stages: the first runs asynchronously; ``wait()`` completes it and
    runs ``then`` (the second stage, synchronously) on its output, then releases that
    intermediate output (gloo's worker may hold the last reference a few milliseconds longer)
    unless ``then`` worked in place on it."""

    def __init__(self, first: Pending, then: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._first: Pending | None = first
        self._then: Callable[[torch.Tensor], torch.Tensor] | None = then
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            assert self._first is not None and self._then is not None
            middle = self._first.wait()
            self._result = self._then(middle)
            self._first = self._then = None
            storage = middle.untyped_storage()
            if storage.data_ptr() != self._result.untyped_storage().data_ptr():
                storage.resize_(0)
                note_resized(storage)
        return self._result


def _staged(t: torch.Tensor, groups: list[str | None], start: Callable[..., Pending], *,
            consume: bool) -> Pending:
    """``start(t, group, consume=consume)`` over the first group that has several ranks (None:
    a single rank, skipped), then, when waited for, ``start`` over the second on the first's
    output, handed over (it is this function's own buffer, released once the second stage
    has read it: on gloo a reduce-scatter then sums it in place instead of a copy of it);
    always a new tensor."""
    stages = [g for g in groups if g is not None]
    if not stages:
        return Pending(t.reshape(-1).clone())
    first = start(t, stages[0], consume=consume)
    if len(stages) == 1:
        return first
    return StagedPending(first, lambda out: start(out, stages[1], consume=True).wait())


def gather_shards_start(shard: torch.Tensor, group: str, *, consume: bool = False) -> Pending:
    """Start gathering the flat padded parameter from every chunk of the sharding group
    ``group`` (a flat group name, or a two-level group registered by :func:`init_mesh`). A
    two-stage gather runs its first stage asynchronously and its second when waited for.
    ``consume``: ``shard`` is a buffer the caller hands over, freed when a one-stage gather
    completes (see :func:`all_gather_flat_start`)."""
    two = _two_level.get(group)
    if two is None:
        return all_gather_flat_start(shard, group, consume=consume)
    stages = [getattr(two, scope) for scope, _ in traits(two.strategy).gather_stages]
    return _staged(shard, stages, all_gather_flat_start, consume=consume)


def reduce_scatter_shards_start(full: torch.Tensor, group: str, *,
                                consume: bool = False) -> Pending:
    """Start reducing ``full`` (flat, padded) to this rank's chunk summed over every rank of the
    world; ``full`` is kept alive until the first stage completes (``consume``: handed over,
    see :func:`reduce_scatter_flat_start`)."""
    two = _two_level.get(group)
    if two is None:
        return reduce_scatter_flat_start(full, group, consume=consume)
    stages = traits(two.strategy).reduce_stages
    scatters = [getattr(two, scope) for c, scope, _ in stages if c == "reduce_scatter"]
    pending = _staged(full, scatters, reduce_scatter_flat_start, consume=consume)
    for group in (getattr(two, scope) for c, scope, _ in stages if c == "all_reduce"):
        if group is not None:  # the shard, summed over the nodes
            pending = StagedPending(pending, lambda out, g=group: all_reduce_sum_(out, g))
    return pending


_checkpoint_meshes: dict[tuple[int, str, tuple[int, ...], tuple[int, ...]], Any] = {}


def checkpoint_mesh(strategy: str, *, world_size: int, ranks_per_node: int | None,
                    device_type: str) -> tuple[Any, list[Any]]:
    """A DeviceMesh and DTensor placements under which every rank's flat chunk of a parameter
    sharded under ``strategy`` is its ``Shard(0)`` piece, so torch.distributed.checkpoint knows
    each rank's offset: a 1-D mesh listing the ranks in chunk order (hierarchical: rank
    ``(k, l)`` holds chunk ``l * n + k``), or for hybrid_shard the nodes x ranks mesh with the
    chunks replicated across nodes; for ``replicate``, the world's 1-D mesh and ``Replicate()``. Collective the first time (it creates process groups).
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    layouts = [shard_layout(strategy, world_size=world_size, ranks_per_node=ranks_per_node,
                            rank=r) for r in range(world_size)]
    if layouts[0].chunks == 1:  # replicated: the world's mesh, each rank holding the whole
        ranks = torch.arange(world_size)
        placements: list[Any] = [Replicate()]
    elif layouts[0].copies == 1:
        ranks = torch.tensor(sorted(range(world_size), key=lambda r: layouts[r].index))
        placements = [Shard(0)]
    else:  # hybrid_shard: node by node, each node holding every chunk
        ranks = torch.arange(world_size).view(mesh_shape(world_size, ranks_per_node))
        placements = [Replicate(), Shard(0)]
    key = (id(dist.group.WORLD), device_type, tuple(ranks.shape), tuple(ranks.view(-1).tolist()))
    if key not in _checkpoint_meshes:
        _checkpoint_meshes[key] = DeviceMesh(device_type, ranks)
    return _checkpoint_meshes[key], placements


def shard_chunks(group: str) -> int:
    """Chunks a parameter sharded over ``group`` is cut into."""
    two = _two_level.get(group)
    return group_size(group) if two is None else two.chunks


def averaging_ranks(group: str) -> int:
    """Ranks a gradient reduced over ``group`` is summed over (and so divided by)."""
    two = _two_level.get(group)
    return group_size(group) if two is None else two.ranks


@atexit.register
def _forget_groups() -> None:
    """Drop the groups and meshes this module keeps, at exit while the interpreter still runs: a
    process group kept alive past ``destroy_process_group`` would otherwise be destroyed during
    the interpreter's shutdown, where gloo's worker threads can no longer take the GIL (the
    process aborts). The meshes are still held by the DTensors of the user's model and
    optimizer, which live until that shutdown, and a DeviceMesh holds its process groups: once
    ``destroy_process_group`` has run (the groups can no longer be used), the meshes let go of
    them too."""
    if dist.is_available() and not dist.is_initialized():
        for mesh in [*_checkpoint_meshes.values(), *(m for _, m in _meshes.values())]:
            _release_groups(mesh)
    _two_level.clear()
    _meshes.clear()
    _checkpoint_meshes.clear()
    forget_named_groups()


def _release_groups(mesh: Any) -> None:
    """Let ``mesh`` drop the process groups it holds (torch's DeviceMesh keeps them by name in
    ``_pg_registry``; a torch without it holds none)."""
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()

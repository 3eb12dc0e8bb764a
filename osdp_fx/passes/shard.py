"""Rewriting pass: insert the collectives of a plan as explicit graph nodes.

For every parameter group the plan shards (``shard_grad_op``, ``full_shard``, ``hybrid_shard``,
``hierarchical``):

* the parameter on the graph module is replaced by this rank's flat, zero-padded shard (a
  plain leaf ``nn.Parameter``, so optimizers and their state see only the shard): 1/N of it,
  or 1/R (ranks per node) for hybrid_shard, at the chunk ``runtime.hierarchy.shard_layout``
  gives;
* its ``get_attr`` node moves to just before the parameter's first use and feeds an
  ``all_gather_param`` node, whose result replaces the parameter everywhere (its backward
  reduce-scatters the gradient into the shard);
* for ``full_shard``, ``hybrid_shard`` and ``hierarchical``, a ``free_param`` node follows the
  last forward use of the gathered tensor and of every view of it (from
  ``annotate_aliases_pass``); backward re-gathers it;
* runs of consecutive sharded parameters of at most the plan's ``gather_bucket_bytes`` gathered
  in all, and runs of small ones (``SMALL_PARAM_BYTES`` each), share one all-gather
  (``gather_buckets``): one ``all_gather_params`` node gathers the
  bucket, ``getitem`` nodes give its members, and its backward reduce-scatters their gradients
  in one collective (flat strategies over the world only);
* with ``prefetch = d > 0`` (the plan's), each all-gather but the first d starts early: a
  ``prefetch_param`` node right after the gather d places before it launches the collective
  asynchronously, and the ``all_gather_param`` node waits for it, so the communication overlaps
  the operators in between.

Replicated parameters stay whole; the runtime all-reduces their gradients. Where the plan also
shards some, each replicated parameter's ``get_attr`` feeds a ``local_param`` node that the rest
of the graph reads instead: the compiled module presents such a parameter as a ``Replicate()``
DTensor (``runtime/sharded.py``), and the graph computes with its local tensor.

Before::

    fc_weight = self.fc.weight
    linear = torch._C._nn.linear(x, fc_weight, None)
    relu = torch.relu(linear)

After (full_shard, prefetch 1; ``out`` is the next layer)::

    fc_weight = self.fc.weight                      # flat shard, shape (ceil(64/N) * 32,)
    all_gather_param = osdp_fx_runtime_params_all_gather_param(fc_weight, (64, 32), 'full_shard', 'world')
    out_weight = self.out.weight
    prefetch_param = osdp_fx_runtime_params_prefetch_param(out_weight, 'world')
    linear = torch._C._nn.linear(x, all_gather_param, None)
    free_param = osdp_fx_runtime_params_free_param(all_gather_param)
    relu = torch.relu(linear)
    all_gather_param_1 = osdp_fx_runtime_params_all_gather_param(out_weight, (8, 64), 'full_shard', 'world', prefetch_param)
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from ..core.buckets import block_of, gather_buckets
from ..core.layout import WORLD, shard_count, shard_layout
from ..core.node_meta import NodeRole, osdp_meta, set_osdp_meta
from ..core.strategies import traits
from ..plan.plan import Plan
from ..runtime.params import (
    all_gather_param,
    all_gather_params,
    free_param,
    make_shard,
    prefetch_param,
    prefetch_params,
    shard_of,
)
from ..runtime.sharded import local_param
from .capture import set_attr
from .pipeline import GraphPass
from .precision import cast_of
from .quantized import quantized_format

log = logging.getLogger(__name__)


def _bucket_gathers(gm: fx.GraphModule, world_size: int, ranks_per_node: int | None,
                    bucket_bytes: int, owners: dict[fx.Node, fx.Node]) -> None:
    """Merge each bucket of :func:`gather_buckets` (``bucket_bytes``) into one
    ``all_gather_params`` node whose outputs (``getitem``) replace the members' gathers.
    ``owners``: the gathers of a quantized weight's tensors, each with the operator reading
    them; they share a bucket whatever their dtypes (gathered as bytes)."""
    graph = gm.graph
    gathers = [n for n in graph.nodes if osdp_meta(n).role == NodeRole.ALL_GATHER]

    def gathered_dtype(node: fx.Node) -> torch.dtype:  # the cast's under mixed precision
        return node.kwargs.get("dtype") or gm.get_parameter(node.args[0].target).dtype

    def gathered_bytes(node: fx.Node) -> int:
        shard = gm.get_parameter(node.args[0].target)
        chunks = shard_count(node.args[2], world_size, ranks_per_node)
        return shard.numel() * chunks * shard.element_size()

    # gathers of one strategy over one group share (a mesh strategy's two-level gather, too:
    # its stages bring the chunks in chunk order, as a flat one does, ``runtime/hierarchy.py``);
    # gathers of different dtypes never share one flat buffer; frozen and trainable
    # parameters do (a LoRA layer's base weights and adapters alternate): the bucket's
    # reduce-scatter carries the trainable members' gradients alone
    keys = [(f"{n.args[2]}/{n.args[3]}/{sorted(n.kwargs.items())}/"
             f"{'packed' if n in owners else gathered_dtype(n)}", gathered_bytes(n))
            for n in gathers]
    blocks = [block_of(osdp_meta(n).param or "") for n in gathers]
    frozen = [not gm.get_parameter(n.args[0].target).requires_grad for n in gathers]
    for bucket in gather_buckets(keys, bucket_bytes, blocks, frozen,
                                 [owners.get(n) for n in gathers]):
        if len(bucket) == 1:
            continue
        members = [gathers[i] for i in bucket]
        head = members[0]
        shards = tuple(m.args[0] for m in members)
        for shard in shards[1:]:
            head.prepend(shard)
        # re-gathered in one all-gather too when within the bucket size (not a long run of
        # small parameters: that would hold them all at once in backward)
        together = sum(keys[i][1] for i in bucket) <= bucket_bytes
        with graph.inserting_before(head):
            merged = graph.call_function(
                all_gather_params,
                (shards, tuple(m.args[1] for m in members), head.args[2], head.args[3]),
                {**head.kwargs, **({"regather_together": True} if together else {})})
        set_osdp_meta(merged, role=NodeRole.ALL_GATHER, aliases=frozenset())
        cursor = merged
        for i, member in enumerate(members):
            with graph.inserting_after(cursor):
                cursor = graph.call_function(operator.getitem, (merged, i))
            set_osdp_meta(cursor, role=NodeRole.GATHERED, param=osdp_meta(member).param)
            member.replace_all_uses_with(cursor)
            graph.erase_node(member)


def _insert_prefetches(graph: fx.Graph, distance: int) -> None:
    """Start each all-gather ``distance`` gathers early: right after the gather ``distance``
    places before it in graph order, so it overlaps the computation in between."""
    gathers = [n for n in graph.nodes if osdp_meta(n).role == NodeRole.ALL_GATHER]
    for anchor, target in zip(gathers, gathers[distance:]) if distance > 0 else ():
        shard, _, _, group = target.args
        bucket = isinstance(shard, tuple)
        cursor = anchor
        for node in shard if bucket else (shard,):
            cursor.append(node)
            cursor = node
        with graph.inserting_after(cursor):
            started = graph.call_function(prefetch_params if bucket else prefetch_param,
                                          (shard, group),
                                          {k: v for k, v in target.kwargs.items() if k == "dtype"})
        set_osdp_meta(started, role=NodeRole.PREFETCH)
        target.args = (*target.args, started)


def _read_local(graph: fx.Graph, node: fx.Node) -> None:
    """Make the users of a replicated parameter's ``get_attr`` read its local tensor."""
    with graph.inserting_after(node):
        local = graph.call_function(local_param, (node,))
    set_osdp_meta(local, role=NodeRole.LOCAL, param=node.target,
                  aliases=frozenset({node.target}))
    node.replace_all_uses_with(local, delete_user_cb=lambda user: user is not local)


def shard_parameters_pass(
    gm: fx.GraphModule, *, plan: Plan, world_size: int, rank: int, group: str = WORLD,
    reduce_dtype: torch.dtype | None = None,
) -> PassResult:
    """Shard the parameters the plan shards and insert their collectives (module docstring).

    ``group`` names the group of shard_grad_op and full_shard; hybrid_shard and hierarchical
    use the two-level groups of the plan's mesh (``runtime.hierarchy.init_mesh``)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    param_nodes = [n for n in graph.nodes if n.op == "get_attr" and osdp_meta(n).role == NodeRole.PARAM]
    n_gathers = n_frees = 0
    owners: dict[fx.Node, fx.Node] = {}
    replicas = any(traits(p.strategy).sharded for p in plan.params)
    for node in param_nodes:
        entry = plan[node.target]
        if not traits(entry.strategy).sharded:
            if replicas:
                _read_local(graph, node)
            continue
        full = gm.get_parameter(node.target)
        layout = shard_layout(entry.strategy, world_size=world_size,
                              ranks_per_node=plan.ranks_per_node, rank=rank, flat_group=group)
        set_attr(gm, node.target, make_shard(full, world_size=layout.chunks, rank=layout.index))

        packed = bool(quantized_format(node))  # (before the gather replaces its uses)
        owner = next(iter(node.users))
        cast = cast_of(node)  # mixed precision: the shard is cast before the gather instead
        views = [n for n in graph.nodes
                 if node.target in osdp_meta(n).aliases and n is not node and n is not cast]
        first_user = min(node.users, key=order.__getitem__)
        first_user.prepend(node)
        kwargs = {"dtype": cast.args[1], "reduce_dtype": reduce_dtype} if cast is not None else {}
        with graph.inserting_after(node):
            gathered = graph.call_function(
                all_gather_param, (node, entry.shape, entry.strategy, layout.group), kwargs
            )
        set_osdp_meta(gathered, role=NodeRole.ALL_GATHER, param=node.target, aliases=frozenset())
        if packed:
            owners[gathered] = owner
        if cast is not None:
            cast.replace_all_uses_with(gathered)
            graph.erase_node(cast)
        node.replace_all_uses_with(gathered, delete_user_cb=lambda user: user is not gathered)
        n_gathers += 1

        if not traits(entry.strategy).freed_after_forward:
            continue
        uses = [u for v in [gathered, *views] for u in v.users]
        if any(u.op == "output" for u in uses):
            log.info("not freeing %s in forward: the model returns it or a view of it", node.target)
            continue
        last_use = max(uses, key=lambda u: order.get(u, -1))
        with graph.inserting_after(last_use):
            freed = graph.call_function(free_param, (gathered,))
        set_osdp_meta(freed, role=NodeRole.FREE, param=node.target)
        n_frees += 1

    _bucket_gathers(gm, world_size, plan.ranks_per_node, plan.schedule.gather_bucket_bytes,
                    owners)
    _insert_prefetches(graph, plan.schedule.prefetch)

    in_graph = {n.target for n in param_nodes}
    for entry in plan.params:  # parameters the forward never reads: sharded all the same
        if traits(entry.strategy).sharded and entry.name not in in_graph:
            full = gm.get_parameter(entry.name)
            set_attr(gm, entry.name, shard_of(full, entry.strategy, world_size=world_size,
                                              ranks_per_node=plan.ranks_per_node, rank=rank))

    graph.lint()
    gm.recompile()
    log.info("shard pass: %d parameters gathered, %d freed after last forward use",
             n_gathers, n_frees)
    return PassResult(gm, n_gathers > 0)


@dataclasses.dataclass(frozen=True)
class ShardParameters(GraphPass, name="shard", requires={"aliases"}, ensures={"sharded"}):
    """The pipeline's ``shard`` (``passes/pipeline.py``): :func:`shard_parameters_pass` under
    ``plan`` (its world size and prefetch distance) for ``rank``."""

    plan: Plan
    rank: int
    group: str = WORLD
    reduce_dtype: torch.dtype | None = None

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        return shard_parameters_pass(
            graph_module, plan=self.plan, world_size=self.plan.world_size, rank=self.rank,
            group=self.group, reduce_dtype=self.reduce_dtype)

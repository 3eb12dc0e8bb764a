"""Rewriting pass: activation recomputation of the regions a plan names.

Each region (``regions.find_regions``: the operators of one repeated submodule, e.g. a
transformer block) whose policy is ``selective`` or ``full`` ([Note: recompute policies]) is
moved into a small GraphModule, its *body*, and replaced by one ``call_module`` node of a
:class:`~osdp_fx.runtime.recompute.RecomputedRegion` that runs the body under
``torch.utils.checkpoint``; ``getitem`` nodes give the region's outputs.

[Note: recompute and sharding]
Parameters (and their mixed-precision casts) stay outside the body and are passed to it as
inputs. The pass runs before the shard pass, so the all-gather of a sharded parameter the
region reads lands before the ``call_module`` node and its free after it: recomputation in
backward reads the parameter through the re-gather backward does anyway (``StepContext``
re-gathers the handle checkpoint saved for its input), never through a second all-gather of
its own (FSDP pays that twice: pytorch issue #105635). ``tests/passes/test_recompute.py``
counts the all-gathers.

[Note: reduce-scatter in recomputed regions]
Autograd runs, among the backward nodes that are ready, the one created last first. A region's
all-gathers run before the region, so their backward (which starts a sharded parameter's
reduce-scatter) would run only after the backward of the whole region: all of a block's
gradients alive at its end, their reduce-scatters started there one after another. So the body
reads a parameter (or its cast) that only the region reads through ``runtime.params.
grad_ready``, placed before its first read: its backward node is created inside the region, and
starts the reduce-scatter as soon as the parameter's gradient is complete, as outside a region.
A bucket's all-gather (``passes/shard.py``) still reduce-scatters after the region's backward
(``cost_models/timeline.py`` predicts both).

Before (one block, ``policy="full"``)::

    ln1_weight = self.blocks.0.ln1.weight
    layer_norm = torch.nn.functional.layer_norm(add, (32,), ln1_weight, ...)
    qkv_weight = self.blocks.0.qkv.weight
    linear = torch._C._nn.linear(layer_norm, qkv_weight, qkv_bias)
    ...
    add_2 = add_1 + linear_3

After::

    ln1_weight = self.blocks.0.ln1.weight
    qkv_weight = self.blocks.0.qkv.weight
    ...
    recompute_blocks_0 = self.recompute_blocks_0(add, ln1_weight, ..., qkv_weight, ...)
    getitem = recompute_blocks_0[0]          # add_2
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Mapping

from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassResult

from ..core.node_meta import NodeRole, osdp_meta, set_osdp_meta
from ..core.regions import Recompute, check_policy, find_regions
from ..errors import PlanError
from ..runtime.params import grad_ready
from ..runtime.recompute import RecomputedRegion
from .pipeline import GraphPass

log = logging.getLogger(__name__)


def region_module_name(region: str) -> str:
    """The attribute name of a region's RecomputedRegion on the graph module."""
    return "recompute_" + region.replace(".", "_")


def _wrap_region(gm: fx.GraphModule, name: str, ops: list[fx.Node], policy: Recompute) -> None:
    graph = gm.graph
    inside = set(ops)
    first, last = ops[0], ops[-1]
    span, node = [], first
    while node is not last:
        node = node.next
        span.append(node)
    for node in span:  # parameters and casts between the region's operators: before it
        if node not in inside:
            first.prepend(node)
    inputs = list(dict.fromkeys(a for n in ops for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in ops if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in ops:
        env[n] = body.node_copy(n, env.__getitem__)
    for a in inputs:  # [Note: reduce-scatter in recomputed regions]
        role = osdp_meta(a).role
        if set(a.users) <= inside and (role == NodeRole.PARAM or role == NodeRole.CAST and all(
                set(p.users) == {a} for p in a.all_input_nodes)):  # the cast alone reads it
            first_read = next(n for n in body.nodes if env[a] in n.all_input_nodes)
            with body.inserting_before(first_read):
                ready = body.call_function(grad_ready, (env[a],))
            ready.meta = dict(env[a].meta)
            env[a].replace_all_uses_with(ready, delete_user_cb=lambda user: user is not ready)
    body.output(tuple(env[o] for o in outputs))
    body.lint()
    target = region_module_name(name)
    gm.add_submodule(target, RecomputedRegion(fx.GraphModule(nn.Module(), body), policy))
    with graph.inserting_before(first):
        call = graph.call_module(target, tuple(inputs))
    set_osdp_meta(call, role=NodeRole.RECOMPUTE)
    cursor = call
    for i, out in enumerate(outputs):
        with graph.inserting_after(cursor):
            cursor = graph.call_function(operator.getitem, (call, i))
        cursor.meta.update({k: v for k, v in out.meta.items() if k != "osdp"})
        out.replace_all_uses_with(cursor, delete_user_cb=lambda user: user not in inside)
    for n in reversed(ops):
        graph.erase_node(n)


def recompute_regions_pass(gm: fx.GraphModule, *, policies: Mapping[str, str]) -> PassResult:
    """Wrap every region ``policies`` gives ``selective`` or ``full`` (module docstring);
    ``save`` regions are left as they are. An unknown region name is a PlanError that lists the
    model's regions."""
    regions = find_regions(gm.graph)
    checked = {name: check_policy(p, where=f"region {name!r}") for name, p in policies.items()}
    unknown = [n for n in checked if n not in regions]
    if unknown:
        known = ", ".join(list(regions)[:8]) or "none (no repeated submodule was traced)"
        raise PlanError(f"the plan recomputes regions the model does not have: "
                        f"{', '.join(unknown[:8])}; the model's regions are: {known}")
    wrapped = 0
    for name, policy in checked.items():
        if policy != Recompute.SAVE:
            _wrap_region(gm, name, regions[name], policy)
            wrapped += 1
    gm.graph.lint()
    gm.recompile()
    log.info("recompute pass: %d of %d regions recomputed", wrapped, len(regions))
    return PassResult(gm, wrapped > 0)


@dataclasses.dataclass(frozen=True)
class RecomputeRegions(GraphPass, name="recompute", requires={"normalized"},
                       ensures={"recomputed"}, invalidates={"profiled", "slowest_rank_times"}):
    """The pipeline's ``recompute`` (``passes/pipeline.py``): :func:`recompute_regions_pass`
    under a plan's ``policies`` (region name -> ``save`` / ``selective`` / ``full``)."""

    policies: Mapping[str, str]

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        return recompute_regions_pass(graph_module, policies=self.policies)

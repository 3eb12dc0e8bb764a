"""Rewriting pass: compute in a lower precision (``osdp_fx.core.precision``).

After every floating parameter's ``get_attr`` a ``cast_param`` node (role ``"cast"``) gives the
parameter in the compute dtype to all its users; after every placeholder a ``cast_input`` node
casts a floating input; the dtype assertions torch.export leaves in a graph
(``aten._assert_tensor_metadata``) are removed; the graph's own dtype conversions convert to
what they meant ([Note: conversions in low precision]). Run on the captured graph before
profiling, so that the profile measures the low-precision computation. A parameter read only by
a quantized op in its stored dtype (an NF4 weight's float32 scales, ``passes/quantized.py``'s
``reads_stored_dtype``) is not cast. The shard pass later folds a sharded parameter's cast into
its all-gather (the shard is cast before it is gathered).

Before::

    fc_weight = self.fc.weight
    linear = torch._C._nn.linear(x, fc_weight, None)

After::

    cast_input = osdp_fx_precision_cast_input(x, torch.bfloat16)
    fc_weight = self.fc.weight
    cast_param = osdp_fx_precision_cast_param(fc_weight, torch.bfloat16)
    linear = torch._C._nn.linear(cast_input, cast_param, None)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from ..core.node_meta import NodeRole, osdp_meta, set_osdp_meta
from ..core.precision import CONVERSIONS, cast_input, cast_param, conversion_dtype
from .pipeline import GraphPass
from .quantized import reads_stored_dtype


def cast_params_pass(gm: fx.GraphModule, dtype: torch.dtype) -> PassResult:
    """Insert the casts of the module docstring for compute dtype ``dtype``."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = [n for n in graph.nodes if n.op == "get_attr" and osdp_meta(n).role == NodeRole.PARAM
              and gm.get_parameter(n.target).is_floating_point() and not reads_stored_dtype(n)]
    for node in [*placeholders, *params]:
        if node.op == "placeholder":
            with graph.inserting_after(placeholders[-1]):
                cast = graph.call_function(cast_input, (node, dtype))
            set_osdp_meta(cast, role=NodeRole.CAST_INPUT, param=osdp_meta(node).param)
        else:
            with graph.inserting_after(node):
                cast = param_cast_node(graph, node, dtype)
        node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    # torch.export records the dtypes it traced with, in nested regions too; they no longer hold
    asserts = 0
    graphs = [sub for sub in gm.modules() if isinstance(sub, fx.GraphModule)]
    for sub in graphs:
        for node in [n for n in sub.graph.nodes if n.op == "call_function"
                     and n.target is torch.ops.aten._assert_tensor_metadata.default]:
            sub.graph.erase_node(node)
            asserts += 1
    pinned = _retarget_traced_conversions(gm, dtype)
    changed = bool(placeholders or params or asserts or pinned)
    graph.lint()
    gm.recompile()
    return PassResult(gm, changed)


@dataclasses.dataclass(frozen=True)
class CastParams(GraphPass, name="cast_params", requires={"normalized"}, ensures={"cast"},
                 invalidates={"profiled", "slowest_rank_times"}):
    """The pipeline's ``cast_params`` (``passes/pipeline.py``): :func:`cast_params_pass`."""

    dtype: torch.dtype

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        return cast_params_pass(graph_module, self.dtype)


def param_cast_node(graph: fx.Graph, param: fx.Node, dtype: torch.dtype) -> fx.Node:
    """A ``cast_param`` node of parameter node ``param`` to ``dtype`` (role ``"cast"``), at the
    graph's insertion point."""
    cast = graph.call_function(cast_param, (param, dtype))
    set_osdp_meta(cast, role=NodeRole.CAST, param=osdp_meta(param).param)
    return cast


_DTYPE_KWARG_CONVERSIONS = (torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default)


def _retarget_traced_conversions(gm: fx.GraphModule, dtype: torch.dtype) -> int:
    """Make the traced conversions of ``gm`` and its nested regions that meant the compute dtype
    convert to ``dtype`` ([Note: conversions in low precision]); returns how many there were."""
    flow = _LowPrecisionFlow(gm)
    decided = [(owner, node) for owner, node in flow.nodes()
               if osdp_meta(node).converts_to_compute_dtype is not None]
    if decided:  # traced in the compute dtype: each conversion is the model's own
        retarget = [(owner, node) for owner, node in decided
                    if osdp_meta(node).converts_to_compute_dtype
                    and conversion_dtype(node) != dtype]
    else:
        retarget = [(owner, node) for owner, node in flow.nodes()
                    if _converts_to_its_params_dtype(gm, node)
                    or (_traced_as_same_dtype_conversion(node)
                        and flow.meant_compute_dtype(node))]
    for _, node in retarget:
        if node.target is torch.ops.aten.to.dtype:
            node.args = (node.args[0], dtype, *node.args[2:])
        elif node.target is torch.ops.aten.to.device and len(node.args) > 2:
            node.args = (*node.args[:2], dtype, *node.args[3:])
        else:
            node.kwargs = {**node.kwargs, "dtype": dtype}
    for owner in {owner for owner, _ in retarget}:
        owner.graph.lint()
        owner.recompile()
    return len(retarget)


# Note [conversions in low precision]
# torch.export traces in the dtypes the model holds, float32, where ``x.to(x.dtype)`` and an
# explicit ``x.float()`` are traced alike, as ``to(x, float32)`` of a float32 ``x``, and where
# ``x.float()`` returns ``x`` itself, so that later reads of ``x`` read the conversion (a Gemma
# RMSNorm's ``output.type_as(x)``). Under mixed precision the parameters and floating inputs
# arrive in the compute dtype, and each conversion must convert to the dtype it meant: a Hugging
# Face RMSNorm's ``hidden_states.to(torch.float32)`` and its loss's ``logits.float()`` to
# float32 (the norm's statistics and the cross-entropy computed in float32, as the model
# computes them under FSDP2's mixed precision), its ``.to(input_dtype)`` and its rotary
# embedding's ``cos.to(x.dtype)`` to the compute dtype.
#
# So where compile_osdp captures for mixed precision, torch.export traces the model with its
# floating parameters and inputs in the compute dtype and its buffers as they are (as FSDP2
# leaves them): the graph is the model's own in that dtype, whatever its code, and capture marks
# each conversion with whether it converts to the compute dtype
# (``OSDPNodeMeta.converts_to_compute_dtype``, ``passes/capture.py``). This pass retargets a
# marked one only where the pass's dtype is another.
#
# Where there is no such mark (a graph captured without a compute dtype, or a model whose trace
# in the compute dtype failed, so that it was traced as it is), a float32 conversion traced as
# float32 -> float32 is given a dtype by where its value comes from. This misses explicit
# upcasts of computed values (an RMSNorm's statistics then run in the compute dtype):
# - of a value computed from them (in the compute dtype): the compute dtype;
# - inside an autocast-disabled region (``torch.autocast(..., enabled=False)``, traced as
#   ``wrap_with_autocast``): float32 as traced, the region asks for it;
# - of a value computed from neither (a buffer such as a rotary embedding's ``inv_freq``, float
#   positions): float32 as traced, unless its result meets a value in the compute dtype before
#   the next conversion (the rotary's cosines multiplied with the queries), when it meant the
#   compute dtype;
# and a conversion to the dtype of the parameters its users compute with (peft's LoRA layer
# converts its input to ``lora_A.weight.dtype``) converts to the compute dtype.
# Values flow through the regions export nests (``wrap_with_set_grad_enabled``,
# ``wrap_with_autocast``): a region's operands are its body's placeholders and its body's outputs
# the region's ``getitem``s. Which values are in the compute dtype is decided once, in graph
# order, before any conversion of the third kind is retargeted.

class _LowPrecisionFlow:
    """The values of a captured graph and of its nested regions that are in the compute dtype
    under mixed precision ([Note: conversions in low precision])."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.low: set[fx.Node] = set()
        self.autocast_off: set[fx.Node] = set()  # nodes inside an autocast-disabled region
        self.owner: dict[fx.Node, fx.GraphModule] = {}
        self.body: dict[fx.Node, fx.GraphModule] = {}  # a region's node -> its body
        self.region: dict[fx.GraphModule, fx.Node] = {}  # a body -> its region's node
        self._visit(gm, autocast_off=False)

    def nodes(self) -> list[tuple[fx.GraphModule, fx.Node]]:
        """(owning graph module, node) for every node, in graph order, a region's body right
        after its region's node."""
        return [(owner, node) for node, owner in self.owner.items()]

    def meant_compute_dtype(self, conversion: fx.Node) -> bool:
        """Whether a conversion traced as float32 -> float32 meant the compute dtype."""
        if conversion in self.autocast_off:
            return False
        return conversion.args[0] in self.low or self._meets_low(conversion)

    def _visit(self, module: fx.GraphModule, *, autocast_off: bool) -> None:
        for node in module.graph.nodes:
            self.owner[node] = module
            if autocast_off:
                self.autocast_off.add(node)
            body = _region_body(module, node)
            if body is not None:
                self.body[node], self.region[body] = body, node
                for placeholder, operand in zip(_placeholders(body), _region_operands(node)):
                    if operand in self.low:
                        self.low.add(placeholder)
                off = autocast_off or (node.target is torch.ops.higher_order.wrap_with_autocast
                                       and node.args[2] is False)
                self._visit(body, autocast_off=off)
            elif self._region_output(node) is not None:
                if self._region_output(node) in self.low:
                    self.low.add(node)
            elif self._lowers(node, autocast_off):
                self.low.add(node)

    def _lowers(self, node: fx.Node, autocast_off: bool) -> bool:
        if osdp_meta(node).role in (NodeRole.CAST, NodeRole.CAST_INPUT):
            return _floating(node.args[0])
        if node.op != "call_function" or not _floating(node):
            return False
        if node.target in CONVERSIONS:
            dtype = conversion_dtype(node)
            if dtype is not None and dtype.is_floating_point and dtype.itemsize < 4:
                return True
            return (not autocast_off and _traced_as_same_dtype_conversion(node)
                    and node.args[0] in self.low)
        return any(a in self.low for a in node.all_input_nodes)

    def _region_output(self, node: fx.Node) -> fx.Node | None:
        """For ``getitem(region, i)``: the node the region's body returns at ``i``."""
        if not (node.op == "call_function" and node.target is operator.getitem
                and node.args[0] in self.body):
            return None
        returned = _output(self.body[node.args[0]]).args[0]
        value = returned[node.args[1]]
        return value if isinstance(value, fx.Node) else None

    def _consumers(self, node: fx.Node) -> list[fx.Node]:
        """The nodes that take ``node``'s value, across region boundaries."""
        out: list[fx.Node] = []
        for user in node.users:
            if user in self.body:  # an operand of a region: its body's placeholder
                operands = _region_operands(user)
                out += [p for p, o in zip(_placeholders(self.body[user]), operands) if o is node]
            elif user.op == "output" and self.owner[user] in self.region:
                region = self.region[self.owner[user]]
                indices = {i for i, v in enumerate(user.args[0]) if v is node}
                out += [g for g in region.users
                        if g.target is operator.getitem and g.args[1] in indices]
            elif user.op != "output":
                out.append(user)
        return out

    def _meets_low(self, start: fx.Node) -> bool:
        """Whether ``start``'s value meets a value in the compute dtype before it is converted."""
        seen, frontier = {start}, [start]
        while frontier:
            for consumer in self._consumers(frontier.pop()):
                if consumer in seen or (consumer.op == "call_function"
                                        and consumer.target in CONVERSIONS):
                    continue
                if any(a in self.low for a in consumer.all_input_nodes):
                    return True
                seen.add(consumer)
                frontier.append(consumer)
        return False


def _region_body(module: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The body of a region torch.export nests (a higher-order op whose operand is a graph
    module), or None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            sub = module.get_submodule(arg.target)
            if isinstance(sub, fx.GraphModule):
                return sub
    return None


def _region_operands(node: fx.Node) -> list[Any]:
    """A region's operands: its arguments after its body."""
    index = next(i for i, a in enumerate(node.args)
                 if isinstance(a, fx.Node) and a.op == "get_attr")
    return list(node.args[index + 1:])


def _placeholders(module: fx.GraphModule) -> list[fx.Node]:
    return [n for n in module.graph.nodes if n.op == "placeholder"]


def _output(module: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(module.graph.nodes) if n.op == "output")


def _floating(node: Any) -> bool:
    """Whether a node's value is (or holds) a floating tensor; unknown values count as one."""
    if not isinstance(node, fx.Node):
        return False
    val = node.meta.get("val")
    if val is None:
        return True
    values = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values)


def _traced_as_same_dtype_conversion(node: fx.Node) -> bool:
    """An export-graph conversion that pins the dtype it was traced with, though it changed
    nothing then: ``x.to(device)`` becomes ``aten.to(x, dtype=float32, device=...)``, and
    ``x.to(y.dtype)`` (a Hugging Face RMSNorm's ``.to(input_dtype)``, its rotary embedding's
    ``cos.to(x.dtype)``) becomes ``aten.to.dtype(x, float32)``. An explicit ``x.float()`` of a
    float32 ``x`` is traced alike; :class:`_LowPrecisionFlow` tells which dtype each meant
    ([Note: conversions in low precision])."""
    if node.op != "call_function" or node.target not in (*_DTYPE_KWARG_CONVERSIONS,
                                                         torch.ops.aten.to.dtype):
        return False
    first = node.args[0] if node.args else None
    source = first.meta.get("val") if isinstance(first, fx.Node) else None
    dtype = (node.args[1] if node.target is torch.ops.aten.to.dtype and len(node.args) > 1
             else node.kwargs.get("dtype"))
    return (isinstance(source, torch.Tensor) and dtype is not None and source.dtype == dtype
            and dtype.is_floating_point)


def _converts_to_its_params_dtype(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A conversion to the dtype of the parameters its users compute with, as traced: peft's
    LoRA layer converts its input to ``lora_A.weight.dtype`` (float32) in a model whose frozen
    weights, and so its activations, are bfloat16. Every user takes a parameter's cast (this
    pass's ``cast_param``) of that dtype, so in low precision, where that parameter arrives in
    the compute dtype, the conversion meant the compute dtype (unchanged, the user's matmul
    would fail on two dtypes)."""
    if node.op != "call_function" or node.target not in (*_DTYPE_KWARG_CONVERSIONS,
                                                         torch.ops.aten.to.dtype):
        return False
    dtype = (node.args[1] if node.target is torch.ops.aten.to.dtype and len(node.args) > 1
             else node.kwargs.get("dtype"))
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or not node.users:
        return False

    def param_dtype_of(arg: object) -> torch.dtype | None:
        if not (isinstance(arg, fx.Node) and osdp_meta(arg).role == NodeRole.CAST):
            return None
        source = arg.args[0]
        return gm.get_parameter(source.target).dtype if isinstance(source, fx.Node) else None

    return all(user.op == "call_function"
               and any(param_dtype_of(a) == dtype for a in user.args if a is not node)
               for user in node.users)


def cast_of(node: fx.Node) -> fx.Node | None:
    """The ``cast_param`` node of a parameter's get_attr, if the graph has one."""
    casts = [u for u in node.users if osdp_meta(u).role == NodeRole.CAST]
    return casts[0] if casts else None

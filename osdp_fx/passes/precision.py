"""Rewriting pass: compute in a lower precision (``osdp_fx.core.precision``).

After every floating parameter's ``get_attr`` a ``cast_param`` node (role ``"cast"``) gives the
parameter in the compute dtype to all its users; after every placeholder a ``cast_input`` node
casts a floating input; the dtype assertions torch.export leaves in a graph
(``aten._assert_tensor_metadata``) are removed. Run on the captured graph before profiling, so that the profile measures
the low-precision computation. A parameter read only by a quantized op in its stored dtype (an
NF4 weight's float32 scales, ``passes/quantized.py``'s ``reads_stored_dtype``) is not cast. The
shard pass later folds a sharded parameter's cast into its
all-gather (the shard is cast before it is gathered).

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

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from ..core.node_meta import NodeRole, osdp_meta, set_osdp_meta
from ..core.precision import cast_input, cast_param
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
    # torch.export records the dtypes it traced with; they no longer hold
    asserts = [n for n in graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default]
    for node in asserts:
        graph.erase_node(node)
    pinned = 0
    for sub in gm.modules():  # nested graphs too (torch.export's wrap_with_set_grad_enabled)
        if isinstance(sub, fx.GraphModule):
            pinned += _retarget_traced_conversions(sub, dtype)
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
    """Make every conversion :func:`_traced_as_same_dtype_conversion` or
    :func:`_converts_to_its_params_dtype` finds convert to the compute ``dtype``; returns how
    many there were."""
    nodes = [n for n in gm.graph.nodes
             if _traced_as_same_dtype_conversion(n) or _converts_to_its_params_dtype(gm, n)]
    for node in nodes:
        if node.target is torch.ops.aten.to.dtype:
            node.args = (node.args[0], dtype, *node.args[2:])
        else:
            node.kwargs = {**node.kwargs, "dtype": dtype}
    if nodes:
        gm.graph.lint()
        gm.recompile()
    return len(nodes)


def _traced_as_same_dtype_conversion(node: fx.Node) -> bool:
    """An export-graph conversion that pins the dtype it was traced with, though it changed
    nothing then: ``x.to(device)`` becomes ``aten.to(x, dtype=float32, device=...)``, and
    ``x.to(y.dtype)`` (a Hugging Face RMSNorm's ``.to(input_dtype)``, its rotary embedding's
    ``cos.to(x.dtype)``) becomes ``aten.to.dtype(x, float32)``. In low precision the dtype they
    meant is the compute dtype, so they are made to convert to it. Intentional upcasts in a
    float32 model are indistinguishable from these, so they run in the compute dtype too."""
    if node.op != "call_function" or node.target not in (*_DTYPE_KWARG_CONVERSIONS,
                                                         torch.ops.aten.to.dtype):
        return False
    source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
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

"""Rewriting pass: compute in a lower precision (``osdp_fx.precision``).

After every floating parameter's ``get_attr`` a ``cast_param`` node (role ``"cast"``) gives the
parameter in the compute dtype to all its users; after every placeholder a ``cast_input`` node
casts a floating input; the dtype assertions torch.export leaves in a graph
(``aten._assert_tensor_metadata``) are removed. Run on the captured graph before profiling, so that the profile measures
the low-precision computation. The shard pass later folds a sharded parameter's cast into its
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

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from ..meta import NodeRole, osdp_meta, set_osdp_meta
from ..precision import cast_input, cast_param


def cast_params_pass(gm: fx.GraphModule, dtype: torch.dtype) -> PassResult:
    """Insert the casts of the module docstring for compute dtype ``dtype``."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = [n for n in graph.nodes if n.op == "get_attr" and osdp_meta(n).role == NodeRole.PARAM
              and gm.get_parameter(n.target).is_floating_point()]
    for node in [*placeholders, *params]:
        fn, role = (cast_input, NodeRole.CAST_INPUT) if node.op == "placeholder" else (cast_param, NodeRole.CAST)
        with graph.inserting_after(placeholders[-1] if node.op == "placeholder" else node):
            cast = graph.call_function(fn, (node, dtype))
        set_osdp_meta(cast, role=role, param=osdp_meta(node).param)
        node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    # torch.export records the dtypes it traced with; they no longer hold
    asserts = [n for n in graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default]
    for node in asserts:
        graph.erase_node(node)
    pinned = [n for n in graph.nodes if _traced_as_same_dtype_conversion(n)]
    for node in pinned:
        node.kwargs = {**node.kwargs, "dtype": None}
    changed = bool(placeholders or params or asserts or pinned)
    graph.lint()
    gm.recompile()
    return PassResult(gm, changed)


_DTYPE_KWARG_CONVERSIONS = (torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default)


def _traced_as_same_dtype_conversion(node: fx.Node) -> bool:
    """An export-graph conversion that pins the dtype it was traced with, though it changed
    nothing then (``x.to(device)`` becomes ``aten.to(x, dtype=float32, device=...)``); in low
    precision it would convert back to float32. Intentional upcasts in a float32 model are
    indistinguishable from these, so they are dropped too: they run in the compute dtype."""
    if node.op != "call_function" or node.target not in _DTYPE_KWARG_CONVERSIONS:
        return False
    source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    dtype = node.kwargs.get("dtype")
    return (isinstance(source, torch.Tensor) and dtype is not None and source.dtype == dtype
            and dtype.is_floating_point)


def cast_of(node: fx.Node) -> fx.Node | None:
    """The ``cast_param`` node of a parameter's get_attr, if the graph has one."""
    casts = [u for u in node.users if osdp_meta(u).role == NodeRole.CAST]
    return casts[0] if casts else None

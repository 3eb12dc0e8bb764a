"""Rewriting pass: split a large linear operator into k sub-linears, each with its own parameter.

Why: a sharded parameter is gathered whole before its operator runs, so the largest weight sets
the transient memory of full_shard. Split into k parts, each part is gathered, used and freed on
its own (only one part's gathered weight is alive at a time), and each part can take its own
strategy: OSDP's fine-grained knob between replicate and full_shard.

Which dimension: **out-features**. ``y = cat_i(x @ W_i^T + b_i)``: every output element is the
same dot product as in the unsplit operator (same summation order, so results match to float
rounding of nothing), the bias splits with the weight, and no partial sums need an extra
output-sized buffer. Splitting in-features would need ``k`` partial outputs summed (extra memory
and a different summation order) for no benefit here. Parts are as even as ``torch.tensor_split``
makes them when k does not divide the out-features.

Patterns (the weight is a parameter read by this operator only, the bias too; either may reach
it through its cast to the compute dtype, ``passes/precision.py``, and each part then gets its
own cast):

* ``F.linear(x, W, b)`` / ``aten.linear(x, W, b)``: W is (out, in), split along dim 0;
* ``aten.addmm(b, x, W)`` (Hugging Face ``Conv1D``): W is (in, out), split along dim 1;
* ``x @ W`` / ``torch.matmul`` / ``aten.matmul`` / ``aten.mm`` with a 2-D parameter W (in, out):
  split along dim 1.

Tied parameters (read by more than one operator, e.g. an embedding shared with the LM head) are
never split: one decision per tied group, and splitting one user would not split the others.

Before (k = 2)::

    fc_weight = self.fc.weight; fc_bias = self.fc.bias
    linear = torch._C._nn.linear(x, fc_weight, fc_bias)

After::

    fc_weight_part0 = self.fc.weight_part0; fc_bias_part0 = self.fc.bias_part0
    linear_part0 = torch._C._nn.linear(x, fc_weight_part0, fc_bias_part0)
    fc_weight_part1 = ...; linear_part1 = torch._C._nn.linear(x, fc_weight_part1, fc_bias_part1)
    cat = torch.cat([linear_part0, linear_part1], -1)
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassResult

from ..core.layout import SplitSpec
from ..core.node_meta import NodeRole, osdp_meta, set_osdp_meta
from ..errors import PlanError
from .capture import Captured, ParamInfo, set_attr
from .pipeline import GraphPass, run_pipeline
from .precision import param_cast_node

log = logging.getLogger(__name__)

_LINEARS = (F.linear, torch._C._nn.linear, torch.ops.aten.linear.default)
_ADDMM = (torch.ops.aten.addmm.default, torch.addmm)
_MATMULS = (torch.matmul, operator.matmul, torch.ops.aten.matmul.default, torch.ops.aten.mm.default)
SPLIT_FACTORS = (2, 4, 8)


@dataclasses.dataclass(frozen=True)
class LinearSite:
    """A linear operator whose weight (and bias) this pass can split."""

    node: fx.Node
    """The linear or addmm node."""
    weight: str
    """Canonical name of the weight parameter."""
    bias: str | None
    """Canonical name of the bias parameter, if it is one read only here."""
    weight_dim: int
    """The weight's out-features dimension."""
    out_features: int
    """Size of that dimension."""


def linear_sites(gm: fx.GraphModule) -> dict[str, LinearSite]:
    """Splittable linear operators of a normalised graph, by weight name. A weight (or bias)
    may reach its operator through its cast to the compute dtype (``passes/precision.py``)."""
    params = {n: osdp_meta(n).param for n in gm.graph.nodes
              if n.op == "get_attr" and osdp_meta(n).role == NodeRole.PARAM}
    sites = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _LINEARS and len(node.args) >= 2 and not node.kwargs:
            weight_node, bias_node, dim = node.args[1], node.args[2] if len(node.args) > 2 else None, 0
        elif node.target in _ADDMM and len(node.args) == 3 and not node.kwargs:
            weight_node, bias_node, dim = node.args[2], node.args[0], 1
        elif node.target in _MATMULS and len(node.args) == 2 and not node.kwargs:
            weight_node, bias_node, dim = node.args[1], None, 1
        else:
            continue
        weight_node = _read_only_here(weight_node)
        if weight_node not in params:
            continue
        if bias_node is not None and (bias_node := _read_only_here(bias_node)) not in params:
            continue
        weight = gm.get_parameter(params[weight_node])
        if weight.dim() != 2 or (bias_node is not None and gm.get_parameter(
                params[bias_node]).shape != (weight.shape[dim],)):
            continue
        sites[params[weight_node]] = LinearSite(
            node, params[weight_node], params[bias_node] if bias_node is not None else None,
            dim, weight.shape[dim])
    return sites


def _read_only_here(arg: object) -> fx.Node | None:
    """The parameter node behind an operator's argument (itself, or the parameter its cast to
    the compute dtype casts) when the operator is its only reader, else None."""
    if not isinstance(arg, fx.Node) or len(arg.users) != 1:
        return None
    if osdp_meta(arg).role == NodeRole.CAST:
        source = arg.args[0]
        return source if isinstance(source, fx.Node) and len(source.users) == 1 else None
    return arg


def split_specs(gm: fx.GraphModule, splits: Mapping[str, int]) -> list[SplitSpec]:
    """The parameter splits that splitting the linears of ``splits`` (weight name -> k) makes."""
    sites = linear_sites(gm)
    specs = []
    for weight, k in splits.items():
        if k == 1:
            continue
        site = sites.get(weight)
        if site is None:
            raise PlanError(
                f"cannot split {weight!r}: only the weight of a linear operator (F.linear, "
                "aten.linear, or addmm as in Hugging Face Conv1D) that no other operator reads "
                "(not tied) can be split; remove it from \"splits\"")
        if not 2 <= k <= site.out_features:
            raise PlanError(f"cannot split {weight!r} into {k} parts: it has "
                            f"{site.out_features} output features; use 2..{site.out_features}")
        sizes = tuple(len(c) for c in torch.arange(site.out_features).tensor_split(k))
        specs.append(SplitSpec(weight, site.weight_dim,
                               tuple(f"{weight}_part{i}" for i in range(k)), sizes))
        if site.bias is not None:
            specs.append(SplitSpec(site.bias, 0,
                                   tuple(f"{site.bias}_part{i}" for i in range(k)), sizes,
                                   bias_of=weight))
    return specs


def split_linear_pass(gm: fx.GraphModule, *, splits: Mapping[str, int]) -> PassResult:
    """Split the linears whose weights ``splits`` names into k sub-linears (module docstring)."""
    specs = {s.name: s for s in split_specs(gm, splits)}
    if not specs:
        return PassResult(gm, False)
    sites = linear_sites(gm)
    graph = gm.graph
    n_linears = n_parts = 0
    for weight, site in sites.items():
        if weight not in specs:
            continue
        node = site.node
        # the compute dtype of a weight or bias that reaches the operator through its cast
        cast_to = {osdp_meta(a).param: a.args[1] for a in node.all_input_nodes
                   if osdp_meta(a).role == NodeRole.CAST}
        part_params = {}
        for name in (site.weight, site.bias):
            if name is None:
                continue
            spec = specs[name]
            full = gm.get_parameter(name)
            for part_name, part in zip(spec.parts, full.detach().split(spec.sizes, dim=spec.dim)):
                set_attr(gm, part_name, nn.Parameter(part.clone(), requires_grad=full.requires_grad))
            _delete_param(gm, name)
            part_params[name] = spec.parts
        outputs = []
        traced = {k: v for k, v in node.meta.items()
                  if k in ("nn_module_stack", "stack_trace", "source_fn_stack")}
        for i in range(len(specs[weight].parts)):
            with graph.inserting_before(node):
                w = _part_node(graph, part_params[weight][i], cast_to.get(weight))
                b = None
                if site.bias is not None:
                    b = _part_node(graph, part_params[site.bias][i], cast_to.get(site.bias))
                if node.target in _LINEARS:
                    args = (node.args[0], w, b)
                elif node.target in _ADDMM:
                    args = (b, node.args[1], w)
                else:
                    args = (node.args[0], w)
                part = graph.call_function(node.target, args)
                part.meta.update(traced)
                outputs.append(part)
        with graph.inserting_before(node):
            cat = graph.call_function(torch.cat, (outputs, -1))
        cat.meta.update(traced)  # in the linear's module: its region (regions.py) stays whole
        old_inputs = [a for a in node.all_input_nodes
                      if a.op == "get_attr" or osdp_meta(a).role == NodeRole.CAST]
        node.replace_all_uses_with(cat)
        graph.erase_node(node)
        for a in old_inputs:  # a cast first, then the parameter it casts
            sources = [a.args[0]] if osdp_meta(a).role == NodeRole.CAST else []
            for p in (a, *sources):
                if not p.users:
                    graph.erase_node(p)
        n_linears += 1
        n_parts += len(outputs)
    graph.lint()
    gm.recompile()
    log.info("split %d linears into %d", n_linears, n_parts)
    return PassResult(gm, True)


@dataclasses.dataclass(frozen=True)
class SplitLinear(GraphPass, name="split_linear", requires={"normalized"}, ensures={"split"},
                  invalidates={"profiled", "slowest_rank_times"}):
    """The pipeline's ``split_linear`` (``passes/pipeline.py``): :func:`split_linear_pass`."""

    splits: Mapping[str, int]

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        return split_linear_pass(graph_module, splits=self.splits)


def _part_node(graph: fx.Graph, name: str, dtype: torch.dtype | None) -> fx.Node:
    """The node of parameter part ``name`` (inserted at the graph's insertion point), cast to
    ``dtype`` when the whole parameter was: the nodes ``cast_params_pass`` makes for it."""
    param = graph.get_attr(name)
    set_osdp_meta(param, role=NodeRole.PARAM, param=name)
    return param if dtype is None else param_cast_node(graph, param, dtype)


def apply_splits(captured: Captured, splits: Mapping[str, int]) -> list[SplitSpec]:
    """Split ``captured``'s graph and record the parts as its parameter groups (weights
    already split are left as they are). A bias named beside its weight (as plans saved by
    osdp-fx 0.2.0.dev0 before this was fixed name them) follows its weight."""
    biases = {site.bias for w, site in linear_sites(captured.gm).items() if w in splits}
    splits = {n: k for n, k in splits.items() if n not in captured.splits and n not in biases}
    specs = split_specs(captured.gm, splits)
    if not specs:
        return []
    run_pipeline(captured.gm, [SplitLinear(splits)])
    params: dict[str, ParamInfo] = {}
    by_name = {s.name: s for s in specs}
    for name, info in captured.params.items():
        spec = by_name.get(name)
        if spec is None:
            params[name] = info
            continue
        for part, size in zip(spec.parts, spec.sizes):
            shape = list(info.shape)
            shape[spec.dim] = size
            params[part] = dataclasses.replace(info, name=part, shape=tuple(shape))
    captured.params = params
    captured.splits.update(by_name)
    return specs


def weight_splits(captured: Captured) -> dict[str, int]:
    """The splits of ``captured`` as a plan records them: each split weight and its number of
    parts (a split bias follows its weight)."""
    return {n: len(s.parts) for n, s in captured.splits.items() if s.bias_of is None}


def _delete_param(gm: fx.GraphModule, name: str) -> None:
    *path, leaf = name.split(".")
    module = gm.get_submodule(".".join(path)) if path else gm
    del module._parameters[leaf]

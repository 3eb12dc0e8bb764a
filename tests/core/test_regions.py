"""Regions and recompute policies (osdp_fx/core/regions.py): a region is the contiguous run of
operators of an indexed submodule, read from ``nn_module_stack``; parameters and casts stay
outside it; ``selective`` keeps the matrix products and attention; a policy is one of three."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from osdp_fx.core.node_meta import NodeRole, osdp_meta, set_osdp_meta
from osdp_fx.core.regions import (
    POLICIES,
    Recompute,
    check_policy,
    find_regions,
    kept_by_selective,
    op_name,
    region_of,
)
from osdp_fx.errors import PlanError
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.passes.capture import capture


def _stack(*paths: str) -> dict[str, tuple[str, type]]:
    """An ``nn_module_stack`` as torch writes it: outermost first, (path, class) per module."""
    return {f"k{i}": (path, torch.nn.Module) for i, path in enumerate(paths)}


def _graph(ops: list[tuple[str | None, object]]) -> tuple[fx.Graph, list[fx.Node]]:
    """A chain of operators, each traced in the module path given (None: at the top level);
    ``"param"`` instead of a target reads a parameter in between."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = []
    for path, target in ops:
        if target == "param":
            node = graph.get_attr("w")
            set_osdp_meta(node, role=NodeRole.PARAM, param="w")
        else:
            node = graph.call_function(target, (x, x))
            x = node
        if path is not None:
            node.meta["nn_module_stack"] = _stack("model", path, path + ".attn")
        nodes.append(node)
    graph.output(x)
    return graph, nodes


def test_region_is_the_outermost_indexed_module():
    graph, (add, mul) = _graph([("model.blocks.3", operator.add), (None, operator.mul)])
    assert region_of(add) == "model.blocks.3"  # not model.blocks.3.attn, and not model
    assert region_of(mul) is None
    add.meta["nn_module_stack"] = {"a": "model", "b": "model.layers.12"}  # plain strings
    assert region_of(add) == "model.layers.12"
    add.meta["nn_module_stack"] = _stack("model", "model.layers.12x", "model.norm")
    assert region_of(add) is None  # no path ends in an index


def test_regions_are_contiguous_runs_of_more_than_one_operator():
    graph, nodes = _graph([
        ("m.blocks.0", operator.add), ("m.blocks.0", "param"), ("m.blocks.0", operator.mul),
        ("m.blocks.1", operator.add), ("m.blocks.1", operator.mul),
        ("m.blocks.2", operator.add),  # a single operator: not a region
        ("m.blocks.3", operator.add), (None, operator.mul), ("m.blocks.3", operator.sub),
    ])
    regions = find_regions(graph)
    assert list(regions) == ["m.blocks.0", "m.blocks.1"]  # blocks.3 is interleaved: left out
    assert regions["m.blocks.0"] == [nodes[0], nodes[2]]  # the parameter between stays outside
    assert regions["m.blocks.1"] == nodes[3:5]


def test_a_region_with_a_call_module_is_left_out():
    graph, nodes = _graph([("m.blocks.0", operator.add), ("m.blocks.0", operator.mul)])
    with graph.inserting_after(nodes[1]):
        leaf = graph.call_module("m.blocks.0.norm", (nodes[1],))
    leaf.meta["nn_module_stack"] = _stack("m", "m.blocks.0")
    assert find_regions(graph) == {}


def test_selective_keeps_matrix_products_and_attention_by_name():
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = {
        "linear": graph.call_function(torch.nn.functional.linear, (x, x)),
        "mm": graph.call_function(torch.ops.aten.mm.default, (x, x)),
        "sdpa": graph.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
                                    .default, (x, x, x)),
        "matmul": graph.call_method("matmul", (x, x)),
        "relu": graph.call_function(torch.relu, (x,)),
        "softmax": graph.call_function(torch.ops.aten._softmax.default, (x, -1, False)),
        "add": graph.call_function(operator.add, (x, x)),
    }
    assert op_name(nodes["mm"]) == "mm" and op_name(nodes["linear"]) == "linear"
    assert op_name(nodes["matmul"]) == "matmul" and op_name(nodes["add"]) == "add"
    assert {k for k, n in nodes.items() if kept_by_selective(n)} == {"linear", "mm", "sdpa",
                                                                     "matmul"}
    assert not kept_by_selective(x)


def test_regions_are_the_blocks_and_selective_keeps_matmuls():
    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=64, dim=32, depth=3, heads=4, max_seq=16))
    captured = capture(model, (torch.randint(0, 64, (2, 16)),))
    regions = find_regions(captured.gm.graph)
    assert list(regions) == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    ops = regions["model.blocks.1"]
    assert not any(osdp_meta(n).role == NodeRole.PARAM for n in ops)
    kept = [n.name for n in ops if kept_by_selective(n)]
    assert len(kept) == 5  # qkv, attention, proj, fc, out


def test_a_policy_is_one_of_three_and_an_unknown_one_names_them():
    assert POLICIES == (Recompute.SAVE, Recompute.SELECTIVE, Recompute.FULL)
    assert check_policy("selective", where="plan") is Recompute.SELECTIVE
    assert str(Recompute.FULL) == "full" and Recompute("save") == "save"
    with pytest.raises(PlanError, match="blocks.1: recompute policy 'sometimes' is unknown; use "
                                        "one of save, selective, full"):
        check_policy("sometimes", where="blocks.1")

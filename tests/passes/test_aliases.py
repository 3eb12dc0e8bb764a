"""The alias analysis pass (osdp_fx/passes/aliases.py): which nodes are views of parameters.

The pass runs the captured graph once and writes ``osdp_meta(node).aliases``: the parameters
whose storage the node's output shares (``W.t()``, ``W[0]``, ``W.view(-1)``, a slice of that view,
each output of ``broadcast_tensors``). Results that are new tensors (``W * 2``, ``x @ W``) and views
of buffers are not annotated. The pass never changes the graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from harness import property_cases as pc
from torch import fx, nn

from osdp_fx.core.node_meta import osdp_meta
from osdp_fx.passes.aliases import annotate_aliases_pass
from osdp_fx.passes.capture import capture


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.b = nn.Parameter(torch.randn(6))
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wt = self.w.t()
        row = self.w[0]
        flat = self.w.view(-1)
        doubled = self.w * 2
        bw, bb = torch.broadcast_tensors(self.w, self.b)
        h = x @ self.w + self.b
        s = self.scale.view(1, 6)
        return h * s + row + flat[:6] + doubled.sum() + wt.sum() + (bw * bb).sum()


class ViewsExported(Views):
    """The same model, behind a shape test symbolic_trace cannot follow: captured by export."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * 1.0
        return super().forward(x)


# Expected annotations by node name (every other node: none).
SYMBOLIC = {"w": {"w"}, "b": {"b"}, "t": {"w"}, "getitem": {"w"}, "view": {"w"},
            "broadcast_tensors": {"w", "b"}, "getitem_1": {"w"}, "getitem_2": {"b"},
            "getitem_3": {"w"}}
EXPORTED = {"w": {"w"}, "b": {"b"}, "t": {"w"}, "select": {"w"}, "view": {"w"},
            "broadcast_tensors": {"w", "b"}, "getitem": {"w"}, "getitem_1": {"b"},
            "slice_1": {"w"}}


def annotations(gm: fx.GraphModule) -> dict[str, set[str]]:
    return {n.name: set(osdp_meta(n).aliases) for n in gm.graph.nodes if osdp_meta(n).aliases}


@pytest.mark.parametrize("model_cls,method,expected", [
    (Views, "symbolic_trace", SYMBOLIC),
    (ViewsExported, "export", EXPORTED),
])
def test_views_of_parameters_are_annotated(model_cls, method, expected):
    torch.manual_seed(0)
    model, x = model_cls(), torch.randn(3, 4)
    cap = capture(model, (x,))
    assert cap.method == method
    assert annotations(cap.gm) == {}
    code, n_nodes = cap.gm.code, len(cap.gm.graph.nodes)

    result = annotate_aliases_pass(cap.gm, (x,))

    assert result.graph_module is cap.gm and not result.modified
    assert cap.gm.code == code and len(cap.gm.graph.nodes) == n_nodes
    assert annotations(cap.gm) == expected, cap.gm.graph
    with torch.no_grad():
        torch.testing.assert_close(cap.gm(x), model(x), atol=0, rtol=0)


def test_only_view_ops_are_annotated_in_an_aten_graph():
    """In an export graph the annotated nodes are exactly the view ops applied to parameters."""
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    cap = capture(ViewsExported(), (x,))
    annotate_aliases_pass(cap.gm, (x,))
    ops = {str(n.target) for n in cap.gm.graph.nodes
           if n.op == "call_function" and osdp_meta(n).aliases}
    assert ops == {"aten.t.default", "aten.select.int", "aten.view.default", "aten.slice.Tensor",
                   "aten.broadcast_tensors.default", "<built-in function getitem>"}


def test_tied_parameter_is_one_annotated_node():
    model, inputs = pc.tiny_gpt()
    cap = capture(model, inputs)
    annotate_aliases_pass(cap.gm, inputs)
    params = {n.name: {n.target} for n in cap.gm.graph.nodes
              if n.op == "get_attr" and osdp_meta(n).role == "param"}
    # TinyGPT never views a parameter: only the get_attr nodes alias one.
    assert annotations(cap.gm) == params
    assert params["tok_weight"] == {"tok.weight"} and "head.weight" not in str(annotations(cap.gm))


def test_pass_leaves_buffers_alone():
    model, x = pc.batch_norm_model()
    cap = capture(model, (x,))
    buffers = pc.snapshot(cap.gm.named_buffers())
    annotate_aliases_pass(cap.gm, (x,))
    pc.assert_unchanged(buffers, pc.snapshot(cap.gm.named_buffers()))


def test_pass_works_on_a_copy_without_touching_the_original():
    torch.manual_seed(0)
    model, x = Views(), torch.randn(3, 4)
    cap = capture(model, (x,))
    clone = copy.deepcopy(cap.gm)
    annotate_aliases_pass(clone, (x,))
    assert annotations(clone) == SYMBOLIC and annotations(cap.gm) == {}

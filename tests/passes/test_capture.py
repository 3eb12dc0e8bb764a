"""Capture and normalisation (osdp_fx/passes/capture.py): one get_attr node per parameter group.

For an MLP and TinyGPT (torch.fx.symbolic_trace) and a tiny Hugging Face GPT-2 (torch.export):
every parameter group is read by exactly one get_attr node, targeting its canonical name, whose
users are call_function nodes; the graph computes what the model computes; the graph module owns
exactly the model's canonical parameters (the same tensors) and buffers.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from harness import property_cases as pc
from torch import fx, nn

from osdp_fx.core.node_meta import osdp_meta
from osdp_fx.passes.capture import Captured, _normalize, capture

MODELS = pc.PASS_MODELS


@pytest.fixture(scope="module", params=sorted(MODELS))
def captured(request) -> tuple[str, nn.Module, tuple[Any, ...], Captured]:
    builder = MODELS[request.param][0]
    model, inputs = builder()
    return request.param, model, inputs, capture(model, inputs)


def param_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "get_attr" and osdp_meta(n).role == "param"]


def test_capture_method(captured):
    name, _, _, cap = captured
    assert cap.method == MODELS[name][1]


def test_one_get_attr_per_parameter_group(captured):
    _, model, _, cap = captured
    canonical = [n for n, _ in model.named_parameters()]
    nodes = param_nodes(cap.gm)
    assert sorted(n.target for n in nodes) == sorted(canonical)
    for node in nodes:
        assert osdp_meta(node).param == node.target
        assert node.users, node.format_node()
        for user in node.users:
            assert user.op == "call_function", user.format_node()
    # No other get_attr reads a parameter under any name.
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    other = [n for n in cap.gm.graph.nodes if n.op == "get_attr" and n not in nodes]
    assert not [n.format_node() for n in other if n.target in all_names]
    # Parameter-owning modules are traced through, never called as modules.
    owners = {m for m, mod in model.named_modules()
              if next(mod.parameters(recurse=False), None) is not None}
    assert not [n.format_node() for n in cap.gm.graph.nodes
                if n.op == "call_module" and n.target in owners]


def test_tied_parameters_are_one_node_with_two_users(captured):
    name, model, _, cap = captured
    ties = MODELS[name][2]
    for alias, canon in ties.items():
        assert model.get_parameter(alias) is model.get_parameter(canon)
        assert cap.alias_to_name[alias] == canon
        assert cap.params[canon].aliases == (alias,)
        (node,) = [n for n in param_nodes(cap.gm) if n.target == canon]
        assert len(node.users) == 2, [u.format_node() for u in node.users]
    assert {a for p in cap.params.values() for a in p.aliases} == set(ties)


def test_graph_outputs_equal_the_model(captured):
    _, model, inputs, cap = captured
    with torch.no_grad():
        torch.testing.assert_close(pc.logits(cap.gm(*inputs)), pc.logits(model(*inputs)),
                                   atol=0, rtol=0)


def test_graph_module_owns_exactly_the_models_parameters(captured):
    _, model, _, cap = captured
    owned = dict(cap.gm.named_parameters(remove_duplicate=False))
    assert set(owned) == {n for n, _ in model.named_parameters()}
    for name, p in owned.items():
        assert p is model.get_parameter(name), name
    assert {n for n, _ in cap.gm.named_buffers()} == {n for n, _ in model.named_buffers()}
    assert list(cap.params) == [n for n, _ in model.named_parameters()]
    assert cap.state_keys == tuple(model.state_dict())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_capture_leaves_the_model_alone(name):
    model, inputs = MODELS[name][0]()
    params = dict(model.named_parameters(remove_duplicate=False))
    state = pc.snapshot(model.state_dict())
    capture(model, inputs)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == params.keys()
    assert all(after[n] is p for n, p in params.items())
    pc.assert_unchanged(state, pc.snapshot(model.state_dict()))


def test_normalisation_merges_tied_get_attrs():
    """Before: torch.export reads tok.weight and head.weight with two get_attr nodes and the
    exported module owns both names; after: one node, one parameter, same outputs."""
    model, inputs = pc.tiny_gpt()
    raw = torch.export.export(model, inputs, strict=False).module()
    before = collections.Counter(n.target for n in raw.graph.nodes if n.op == "get_attr")
    assert before["tok.weight"] == 1 and before["head.weight"] == 1
    assert "head.weight" in dict(raw.named_parameters(remove_duplicate=False))

    cap = _normalize(model, raw, "export")
    after = collections.Counter(n.target for n in param_nodes(cap.gm))
    assert "head.weight" not in after and after["tok.weight"] == 1
    assert sum(after.values()) == sum(before.values()) - 1
    (tok,) = [n for n in param_nodes(cap.gm) if n.target == "tok.weight"]
    assert len(tok.users) == 2
    assert "head.weight" not in dict(cap.gm.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        torch.testing.assert_close(cap.gm(*inputs), model(*inputs), atol=0, rtol=0)


def test_frozen_and_integer_parameters_are_recorded():
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.fc.bias.requires_grad_(False)
            self.steps = nn.Parameter(torch.arange(3), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + self.steps

    cap = capture(Mixed(), (torch.randn(2, 3),))
    assert cap.params["fc.weight"].trainable
    assert not cap.params["fc.bias"].trainable and not cap.params["fc.bias"].requires_grad
    assert not cap.params["steps"].trainable and cap.params["steps"].dtype == torch.int64
    assert sorted(n.target for n in param_nodes(cap.gm)) == ["fc.bias", "fc.weight", "steps"]


class ScaledByBuffer(nn.Module):
    """Reads its buffer through an expression (``scale * 2``), which symbolic_trace evaluates."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * (self.scale * 2)


def test_buffer_expressions_stay_in_the_graph():
    torch.manual_seed(0)
    model, x = ScaledByBuffer(), torch.randn(2, 3)
    cap = capture(model, (x,))
    assert cap.method == "symbolic_trace"
    with torch.no_grad():
        model.scale.fill_(5.0)  # the graph module holds this very buffer
        torch.testing.assert_close(cap.gm(x), model(x))
    assert not [n.target for n in cap.gm.graph.nodes
                if n.op == "get_attr" and n.target.startswith("_tensor_constant")]


def test_capture_leaves_batch_norm_statistics_alone():
    model, x = pc.batch_norm_model()
    state = pc.snapshot(model.state_dict())
    capture(model, (x,))
    pc.assert_unchanged(state, pc.snapshot(model.state_dict()))

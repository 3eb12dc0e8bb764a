"""Node metadata (osdp_fx/core/node_meta.py): ``node.meta["osdp"]`` is created empty on first
read, replaced field by field, and a node's profile of zero cost is zero in every figure."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import fx

from osdp_fx.core.node_meta import (
    META_KEY,
    NodeProfile,
    NodeRole,
    OSDPNodeMeta,
    osdp_meta,
    set_osdp_meta,
)


def _node() -> fx.Node:
    graph = fx.Graph()
    return graph.call_function(torch.relu, (graph.placeholder("x"),))


def test_the_meta_is_created_empty_on_first_read_and_kept():
    node = _node()
    assert META_KEY not in node.meta
    meta = osdp_meta(node)
    assert meta == OSDPNodeMeta(role=NodeRole.OP, param=None, aliases=frozenset(), profile=None)
    assert node.meta[META_KEY] is meta and osdp_meta(node) is meta


def test_set_replaces_only_the_fields_given():
    node = _node()
    set_osdp_meta(node, param="w", aliases=frozenset({"w"}))
    before = osdp_meta(node)
    after = set_osdp_meta(node, role=NodeRole.ALL_GATHER)
    assert after is osdp_meta(node) and after is not before  # a new record, not a mutation
    assert (after.role, after.param, after.aliases) == (NodeRole.ALL_GATHER, "w", frozenset({"w"}))
    assert before.role == NodeRole.OP
    with pytest.raises(TypeError):
        set_osdp_meta(node, colour="red")


def test_roles_compare_and_print_as_their_names():
    assert NodeRole("param") is NodeRole.PARAM and NodeRole.PARAM == "param"
    assert str(NodeRole.RECOMPUTE) == "recompute"
    assert len({r.value for r in NodeRole}) == len(NodeRole) == 10


def test_a_zero_profile_costs_nothing():
    timed = NodeProfile.zero(output_bytes=64, param_bytes=32, output_is_view=True)
    assert (timed.fwd_flops, timed.bwd_flops, timed.saved_bytes, timed.grad_input_bytes) == (
        0, 0, 0, 0)
    assert (timed.output_bytes, timed.param_bytes, timed.output_is_view) == (64, 32, True)
    assert (timed.fwd_time_s, timed.bwd_time_s) == (0.0, 0.0)
    fake = NodeProfile.zero(timed=False)
    assert (fake.fwd_time_s, fake.bwd_time_s) == (None, None)
    assert fake == dataclasses.replace(timed, output_bytes=0, param_bytes=0,
                                       output_is_view=False, fwd_time_s=None, bwd_time_s=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fake.fwd_flops = 1  # type: ignore[misc]

"""The strategies and their table (osdp_fx/core/strategies.py): each row says what the module
docstring's table says, names and members look the same rows up, and the derived tuples and
the searched strategies follow the table."""

from __future__ import annotations

import json

import pytest

from osdp_fx.core.strategies import (
    FREED_AFTER_FORWARD,
    MESH_STRATEGIES,
    SHARDED,
    STRATEGIES,
    TRAITS,
    Strategy,
    searched_strategies,
    traits,
)

# strategy -> (shard over, kept gathered, freed after forward, needs the mesh, chunk order,
#              gather stages, reduce stages): the table of the module docstring
EXPECTED = {
    "replicate": ("none", False, False, False, "rank", (), (("all_reduce", "world", "full"),)),
    "shard_grad_op": ("world", True, False, False, "rank", (("world", "full"),),
                      (("reduce_scatter", "world", "full"),)),
    "full_shard": ("world", False, True, False, "rank", (("world", "full"),),
                   (("reduce_scatter", "world", "full"),)),
    "hybrid_shard": ("node", False, True, True, "local", (("intra", "full"),),
                     (("reduce_scatter", "intra", "full"), ("all_reduce", "inter", "block"))),
    "hierarchical": ("world", False, True, True, "local_major",
                     (("inter", "block"), ("intra", "full")),
                     (("reduce_scatter", "intra", "full"), ("reduce_scatter", "inter", "block"))),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_row_is_the_documented_one(name):
    row = traits(name)
    assert (row.shard_over, row.keeps_gathered, row.freed_after_forward, row.needs_mesh,
            row.chunk_order, row.gather_stages, row.reduce_stages) == EXPECTED[name]
    assert row.sharded == (name != "replicate")
    assert not (row.keeps_gathered and row.freed_after_forward)
    assert row is TRAITS[Strategy(name)] is traits(Strategy(name))


def test_names_are_the_values_plans_and_json_keep():
    assert [s.value for s in STRATEGIES] == list(EXPECTED)
    assert set(TRAITS) == set(Strategy)
    assert Strategy("full_shard") == "full_shard" and str(Strategy.HYBRID_SHARD) == "hybrid_shard"
    assert json.dumps({"p": Strategy.SHARD_GRAD_OP}) == '{"p": "shard_grad_op"}'


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="'zero3'"):
        traits("zero3")


def test_derived_tuples_follow_the_table():
    assert SHARDED == (Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD, Strategy.HYBRID_SHARD,
                       Strategy.HIERARCHICAL)
    assert MESH_STRATEGIES == (Strategy.HYBRID_SHARD, Strategy.HIERARCHICAL)
    assert FREED_AFTER_FORWARD == (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD,
                                   Strategy.HIERARCHICAL)


def test_the_mesh_strategies_are_searched_only_on_several_nodes():
    assert searched_strategies(1) == ["replicate", "shard_grad_op", "full_shard"]
    assert searched_strategies(2) == list(STRATEGIES)

"""Shard arithmetic (osdp_fx/core/layout.py): chunk sizes padded to whole rows, how many chunks
each strategy cuts, which chunk a rank holds on a mesh of nodes x ranks, and the collective
stages of one step, with single-rank stages left out."""

from __future__ import annotations

import pytest

from osdp_fx.core.layout import (
    WORLD,
    ShardLayout,
    Stage,
    collective_stages,
    mesh_group_name,
    mesh_shape,
    row_numel,
    shard_count,
    shard_layout,
    shard_numel,
)

NUMEL = 1001  # 126 elements per rank of a node of 8 (1008 padded), 63 per rank of 16


def stages(strategy, world=16, per_node=8, regathered=True):
    return collective_stages(strategy, NUMEL, 4, world_size=world, ranks_per_node=per_node,
                             regathered=regathered)


def test_chunks_are_whole_rows_padded_to_equal_size():
    assert [row_numel(s) for s in ((), (7,), (5, 3), (4, 3, 2))] == [1, 1, 3, 6]
    assert shard_numel(10, 4) == 3 and shard_numel(12, 4) == 3 and shard_numel(1, 8) == 1
    # 5 rows of 3 over 4 chunks: 2 rows (6 elements) each, the last chunks padding
    assert shard_numel(15, 4, row=3) == 6
    assert shard_numel(15, 1, row=3) == 15
    assert shard_numel(0, 4, row=3) == 0


def test_shard_counts():
    assert [shard_count(s, 16, 8) for s in ("replicate", "shard_grad_op", "full_shard",
                                             "hybrid_shard", "hierarchical")] == [1, 16, 16, 8, 16]
    assert shard_count("hybrid_shard", 16, None) == 16  # one node: full_shard


def test_mesh_shape_and_group_names():
    assert mesh_shape(16, 8) == (2, 8)
    assert mesh_shape(16, None) == (1, 16)
    assert mesh_group_name("hybrid_shard", 8, 4) == "hybrid_shard/2x4"
    assert mesh_group_name("hierarchical", 4, None) == "hierarchical/1x4"


def test_which_chunk_each_rank_holds_on_two_nodes_of_four():
    """The chunk orders of the module docstring: rank r (node r // 4, local r % 4)."""
    def layouts(strategy):
        return [shard_layout(strategy, world_size=8, ranks_per_node=4, rank=r) for r in range(8)]

    assert [x.index for x in layouts("full_shard")] == list(range(8))
    assert [x.index for x in layouts("hybrid_shard")] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [x.index for x in layouts("hierarchical")] == [0, 2, 4, 6, 1, 3, 5, 7]
    assert [x.index for x in layouts("replicate")] == [0] * 8
    assert layouts("full_shard")[5] == ShardLayout(WORLD, 8, 5, 1)
    assert layouts("hybrid_shard")[5] == ShardLayout("hybrid_shard/2x4", 4, 1, 2)
    assert layouts("hierarchical")[5] == ShardLayout("hierarchical/2x4", 8, 3, 1)
    assert layouts("replicate")[5] == ShardLayout(WORLD, 1, 0, 8)
    assert shard_layout("full_shard", world_size=2, ranks_per_node=None, rank=1,
                        flat_group="sub").group == "sub"


def test_hierarchical_order_is_a_permutation_that_the_two_stage_gather_undoes():
    """Gathering across nodes (one rank per local index, node order), then inside the node
    (local order), yields the chunks in flat order."""
    nodes, per_node = 3, 4
    index = {r: shard_layout("hierarchical", world_size=12, ranks_per_node=per_node, rank=r).index
             for r in range(12)}
    assert sorted(index.values()) == list(range(12))
    gathered = [index[node * per_node + local] for local in range(per_node)
                for node in range(nodes)]
    assert gathered == list(range(12))


def test_hybrid_shard_stages():
    padded = 1008 * 4
    gather = Stage("all_gather", padded, 8, "intra")
    assert stages("hybrid_shard") == (
        [gather],
        [gather, Stage("reduce_scatter", padded, 8, "intra"),
         Stage("all_reduce", padded // 8, 2, "inter")])
    assert stages("hybrid_shard", regathered=False)[1][0].collective == "reduce_scatter"


def test_hierarchical_stages_carry_an_eighth_across_nodes():
    padded = 1008 * 4
    inter, intra = Stage("all_gather", padded // 8, 2, "inter"), Stage("all_gather", padded, 8,
                                                                        "intra")
    assert stages("hierarchical") == (
        [inter, intra],
        [inter, intra, Stage("reduce_scatter", padded, 8, "intra"),
         Stage("reduce_scatter", padded // 8, 2, "inter")])
    # full_shard's single stage moves the whole parameter over the world's (inter-node) ring
    assert stages("full_shard")[0] == [Stage("all_gather", padded, 16, "world")]
    assert Stage("all_gather", padded, 16, "world").spans_nodes(2)
    assert not Stage("all_gather", padded, 16, "world").spans_nodes(1)


def test_flat_strategies_frozen_groups_and_mixed_precision():
    # replicate: the unpadded gradient all-reduced, nothing gathered
    assert stages("replicate", world=4, per_node=None) == (
        [], [Stage("all_reduce", NUMEL * 4, 4, "world")])
    # shard_grad_op keeps the gathered parameter: no re-gather in backward
    assert stages("shard_grad_op", world=4, per_node=None) == (
        [Stage("all_gather", 1004 * 4, 4, "world")],
        [Stage("reduce_scatter", 1004 * 4, 4, "world")])
    # a frozen group only gathers; replicated and frozen, nothing at all
    frozen = collective_stages("full_shard", NUMEL, 4, world_size=4, trainable=False)
    assert frozen == ([Stage("all_gather", 1004 * 4, 4, "world")],
                      [Stage("all_gather", 1004 * 4, 4, "world")])
    assert collective_stages("replicate", NUMEL, 4, world_size=4, trainable=False) == ([], [])
    # gathered in bf16, reduced in fp32; 101 rows of 10 padded to 4 chunks of 26 rows
    fwd, bwd = collective_stages("full_shard", 1010, 4, world_size=4, gather_element_size=2,
                                 reduce_element_size=4, row=10)
    assert fwd == [Stage("all_gather", 1040 * 2, 4, "world")]
    assert bwd == [Stage("all_gather", 1040 * 2, 4, "world"),
                   Stage("reduce_scatter", 1040 * 4, 4, "world")]


def test_degenerate_meshes_drop_single_rank_stages():
    # one node: hybrid_shard and hierarchical are full_shard over the node
    for strategy in ("hybrid_shard", "hierarchical"):
        fwd, bwd = stages(strategy, world=8, per_node=None)
        assert [(s.collective, s.nbytes, s.ranks) for s in fwd + bwd] == [
            (s.collective, s.nbytes, s.ranks) for s in sum(stages("full_shard", 8, None), [])]
    # one rank per node: hybrid_shard all-reduces the whole (unsharded) gradient across nodes
    assert stages("hybrid_shard", world=4, per_node=1) == (
        [], [Stage("all_reduce", NUMEL * 4, 4, "inter")])
    assert stages("hierarchical", world=1, per_node=None) == ([], [])


@pytest.mark.parametrize(("stage", "text"), [
    (Stage("all_gather", 1536, 8, "world"), "all_gather 1.5 KiB"),
    (Stage("reduce_scatter", 3 * 2**20, 2, "inter"), "reduce_scatter[inter] 3.0 MiB"),
])
def test_a_stage_prints_its_collective_scope_and_size(stage, text):
    assert str(stage) == text

"""Cost models of hybrid_shard and hierarchical on a mesh of nodes x ranks: closed forms (their
collective stages and shard counts: tests/core/test_layout.py)."""

from __future__ import annotations

import pytest

from osdp_fx.core.devices import Devices
from osdp_fx.cost_models.communication import all_gather_time_s, all_reduce_time_s
from osdp_fx.cost_models.graph_facts import ParamState
from osdp_fx.cost_models.memory import param_memory, persistent_bytes
from osdp_fx.cost_models.overlap import gather_s, reduce_at_wait_s, reduce_s
from osdp_fx.cost_models.step import REDUCER_PASSES, SPLIT_GRADIENT_PASSES, group_cost

# 2 nodes x 8 ranks; intra-node links 80x faster than inter-node ones
DEVICES = Devices(world_size=16, ranks_per_node=8, memory_bandwidth_bytes_per_s=1e12,
                  intra_node_bandwidth_bytes_per_s=1e11, intra_node_latency_s=1e-5,
                  inter_node_bandwidth_bytes_per_s=1.25e9, inter_node_latency_s=5e-5)
INTRA = {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-5}
INTER = {"bandwidth_bytes_per_s": 1.25e9, "latency_s": 5e-5}
NUMEL = 1001  # 126 elements per rank of a node (1008 padded), 63 per rank of the world
PAD_COPY_S = (4 * NUMEL + 4 * 1008) / 1e12
"""Padding the gradient to 1008 elements before its reduce-scatter: read it, write the padded
buffer (``step.scatter_input_copy_s``)."""


def test_step_cost_closed_form():
    padded = 1008 * 4
    state = ParamState(numel=NUMEL, element_size=4, strategy="hybrid_shard", trainable=True)
    cost = group_cost(state, regathered=True, compute_s=0.0, devices=DEVICES, optimizer="sgd")
    expected = (3 * all_gather_time_s(padded, 8, **INTRA)  # gather, re-gather, reduce-scatter
                + all_reduce_time_s(padded / 8, 2, **INTER) + PAD_COPY_S)
    assert cost.comm_s == pytest.approx(expected, rel=1e-12)
    assert cost.comm_bytes == 3 * padded + padded // 8
    assert cost.persistent_bytes == 2 * 126 * 4  # shard + its gradient (SGD: no state)
    assert cost.transient_bytes == 2 * padded

    state = ParamState(numel=NUMEL, element_size=4, strategy="hierarchical", trainable=True)
    cost = group_cost(state, regathered=True, compute_s=0.0, devices=DEVICES, optimizer="sgd")
    expected = 3 * (all_gather_time_s(padded / 8, 2, **INTER)
                    + all_gather_time_s(padded, 8, **INTRA)) + PAD_COPY_S
    assert cost.comm_s == pytest.approx(expected, rel=1e-12)
    assert cost.persistent_bytes == 2 * 63 * 4

    full = group_cost(ParamState(NUMEL, 4, "full_shard", True), regathered=True, compute_s=0.0,
                      devices=DEVICES, optimizer="sgd")
    # full_shard's ring through all 16 ranks: the two crossings spread over a node's 8 network
    # links, one of its 15 steps across nodes ([Note: rings across nodes])
    ring = {"bandwidth_bytes_per_s": min(INTRA["bandwidth_bytes_per_s"],
                                         8 * INTER["bandwidth_bytes_per_s"]),
            "latency_s": (14 * INTRA["latency_s"] + INTER["latency_s"]) / 15}
    assert full.comm_s == pytest.approx(3 * all_gather_time_s(padded, 16, **ring) + PAD_COPY_S,
                                        rel=1e-12)


def test_a_replicated_gradient_pays_its_bucket_share_and_the_reducers_passes():
    """A replicated group all-reduces its gradient in a bucket of the schedule's size: the
    bucket's bytes over the ring, its share of the bucket's latency, and the reducer's three
    passes over it (pack, average, copy back), each a read and a write at memory bandwidth."""
    nbytes, bucket = 4 * NUMEL, 4 * 4 * NUMEL
    state = ParamState(numel=NUMEL, element_size=4, strategy="replicate", trainable=True)
    cost = group_cost(state, regathered=False, compute_s=0.0, devices=DEVICES, optimizer="sgd",
                      reduce_bucket_bytes=bucket)
    ring = {"bandwidth_bytes_per_s": min(INTRA["bandwidth_bytes_per_s"],
                                         8 * INTER["bandwidth_bytes_per_s"]),
            "latency_s": (14 * INTRA["latency_s"] + INTER["latency_s"]) / 15}
    whole = all_reduce_time_s(bucket, 16, **ring)
    latency = all_reduce_time_s(0, 16, **ring)
    expected = ((whole - latency) * nbytes / bucket + latency / 4
                + REDUCER_PASSES * 2 * nbytes / DEVICES.memory_bandwidth_bytes_per_s)
    assert REDUCER_PASSES == 3
    assert cost.comm_s == pytest.approx(expected, rel=1e-9)


def test_a_split_weights_part_pays_its_share_of_joining_the_gradient():
    """A part of a split weight costs what assembling the weight's one gradient moves: its
    view of the zero-filled gradient written, and its own gradient added into it (two reads and
    a write), per byte of its local gradient (its shard's when sharded); a frozen part
    nothing."""
    per_byte = SPLIT_GRADIENT_PASSES / DEVICES.memory_bandwidth_bytes_per_s
    assert SPLIT_GRADIENT_PASSES == 4
    for strategy, local_bytes in (("replicate", 4 * NUMEL), ("full_shard", 4 * 63),
                                  ("hybrid_shard", 4 * 126)):
        for trainable in (True, False):
            state = ParamState(numel=NUMEL, element_size=4, strategy=strategy,
                               trainable=trainable)
            whole, part = (group_cost(state, regathered=True, compute_s=0.0, devices=DEVICES,
                                      optimizer="sgd", split_part=split)
                           for split in (False, True))
            extra = per_byte * local_bytes if trainable else 0.0
            assert part.comm_s - whole.comm_s == pytest.approx(extra, rel=1e-9)
            assert part.host_s == whole.host_s
            assert part.persistent_bytes == whole.persistent_bytes


def test_the_stages_after_the_first_run_when_waited_for():
    """A two-stage collective starts its first stage and runs the others when waited for
    (``runtime/hierarchy.py``): the step model keeps their seconds apart, which cannot hide."""
    padded = 1008 * 4
    state = ParamState(numel=NUMEL, element_size=4, strategy="hierarchical", trainable=True)
    gathered = gather_s(state, DEVICES, regathered=True)
    intra = all_gather_time_s(padded, 8, **INTRA)  # the node's stage, after the one across
    assert gathered.forward_at_wait_s == gathered.backward_at_wait_s == pytest.approx(intra)
    assert gathered.forward_s == pytest.approx(intra + all_gather_time_s(padded / 8, 2, **INTER))
    # its reduce-scatter across nodes follows the node's
    assert reduce_at_wait_s(state, DEVICES) == pytest.approx(
        reduce_s(state, DEVICES) - all_gather_time_s(padded, 8, **INTRA))

    hybrid = ParamState(numel=NUMEL, element_size=4, strategy="hybrid_shard", trainable=True)
    assert gather_s(hybrid, DEVICES, regathered=True).forward_at_wait_s == 0.0  # one stage
    assert reduce_at_wait_s(hybrid, DEVICES) == pytest.approx(
        all_reduce_time_s(padded / 8, 2, **INTER))  # the shard's all-reduce across nodes

    full = ParamState(NUMEL, 4, "full_shard", True)
    assert gather_s(full, DEVICES, regathered=True).forward_at_wait_s == 0.0
    assert reduce_at_wait_s(full, DEVICES) == 0.0
    assert reduce_at_wait_s(ParamState(NUMEL, 4, "hybrid_shard", False), DEVICES) == 0.0


def test_memory_closed_form():
    p = NUMEL * 4
    for optimizer, states, step in (("sgd", 0, 0), ("adamw", 2, 4)):
        # hybrid: one node's shard, 126 elements, of parameter, gradient and fp32 state (and
        # Adam's step counter)
        assert persistent_bytes(NUMEL, strategy="hybrid_shard", world_size=16, ranks_per_node=8,
                                optimizer=optimizer) == 126 * 4 * (2 + states) + step
        assert persistent_bytes(NUMEL, strategy="hierarchical", world_size=16, ranks_per_node=8,
                                optimizer=optimizer) == 63 * 4 * (2 + states) + step
    hybrid = param_memory(NUMEL, strategy="hybrid_shard", world_size=16, ranks_per_node=8)
    assert hybrid.gathered_bytes == 1008 * 4 >= p
    assert param_memory(NUMEL, strategy="hybrid_shard", world_size=16) == param_memory(
        NUMEL, strategy="full_shard", world_size=16)


def test_a_mesh_bucket_member_saves_each_stage_latency():
    """A member of a gather bucket after its first rides in the bucket's collectives: under a
    mesh strategy it saves the latency of each of its stages (at the stage's group and links),
    its re-gather's too when backward re-gathers the bucket together."""
    from osdp_fx.cost_models.communication import reduce_scatter_time_s
    from osdp_fx.cost_models.step import bucket_latencies_s

    def ag(ranks, link):
        return all_gather_time_s(0, ranks, **link)

    gathers, reduces = bucket_latencies_s("hybrid_shard", DEVICES, again=True)
    assert gathers == pytest.approx(2 * ag(8, INTRA), rel=1e-12)
    assert reduces == pytest.approx(reduce_scatter_time_s(0, 8, **INTRA)
                                    + all_reduce_time_s(0, 2, **INTER), rel=1e-12)
    gathers, reduces = bucket_latencies_s("hierarchical", DEVICES, again=False)
    assert gathers == pytest.approx(ag(2, INTER) + ag(8, INTRA), rel=1e-12)
    assert reduces == pytest.approx(reduce_scatter_time_s(0, 8, **INTRA)
                                    + reduce_scatter_time_s(0, 2, **INTER), rel=1e-12)
    flat = Devices(world_size=16, intra_node_bandwidth_bytes_per_s=1e11,
                   intra_node_latency_s=1e-5)
    assert bucket_latencies_s("full_shard", flat, again=True) == pytest.approx(
        (2 * ag(16, INTRA), reduce_scatter_time_s(0, 16, **INTRA)), rel=1e-12)

"""Memory behaviour of the strategies on a real 2-rank world, measured by a live-tensor tracker.

The model is 4 bias-free Linear(512, 512) layers; one gathered weight is W = 1 MiB. The first
layer's input needs no grad, so autograd saves only the 3 later weights. Plans prefetch one
all-gather ahead unless ``prefetch=0``.
"""

from __future__ import annotations

import pytest
from harness import cases

W = 512 * 512 * 4


@pytest.fixture(scope="module")
def profiles(worlds):
    world = worlds(2)
    out = {plan: world.run(cases.memory_profile, plan=plan)
           for plan in ("replicate", "shard_grad_op", "full_shard")}
    out["full_shard, prefetch 0"] = world.run(cases.memory_profile, plan="full_shard", prefetch=0)
    return out


def test_full_shard_keeps_no_gathered_weight_between_forward_and_backward(profiles):
    for rank_profile in profiles["full_shard"]:
        assert rank_profile["after_forward"] < W / 2, rank_profile


def test_full_shard_without_prefetch_gathers_one_weight_at_a_time_in_forward(profiles):
    for rank_profile in profiles["full_shard, prefetch 0"]:
        assert W <= rank_profile["forward_peak"] < 1.5 * W, rank_profile


def test_full_shard_prefetching_one_ahead_holds_two_weights_in_forward(profiles):
    for rank_profile in profiles["full_shard"]:
        assert 2 * W <= rank_profile["forward_peak"] < 2.5 * W, rank_profile


def test_shard_grad_op_keeps_gathered_weights_for_backward(profiles):
    for rank_profile in profiles["shard_grad_op"]:
        assert rank_profile["after_forward"] >= 3 * W, rank_profile


def test_replicate_allocates_no_weights_in_forward(profiles):
    for rank_profile in profiles["replicate"]:
        assert rank_profile["forward_peak"] < W / 2, rank_profile

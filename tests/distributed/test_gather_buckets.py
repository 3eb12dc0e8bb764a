"""Gather buckets of any size (a whole block in one all-gather; a run of small parameters, the
whole test GPT, in one): training equals single-process training, and backward re-gathers a
bucket's saved members in one all-gather (world 2, gloo)."""

from __future__ import annotations

import json

import pytest
from harness import cases, recompute_cases


def _plan(path, strategy: str, bucket_bytes: int, recompute: dict[str, str],
          **extra: object) -> str:
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": strategy,
                                "params": {}, "gather_bucket_bytes": bucket_bytes,
                                **({"recompute": recompute} if recompute else {}), **extra}))
    return str(path)


@pytest.mark.parametrize("recompute", [{}, {"blocks.0": "full", "blocks.1": "selective"}])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_one_bucket_trains_like_one_process_and_is_regathered_once(worlds, tmp_path, strategy,
                                                                     recompute):
    plan = _plan(tmp_path / "plan.json", strategy, 2**30, recompute)
    results = worlds(2).run(recompute_cases.train, model="gpt", plan=plan)
    cases.assert_matches_single_process(results, "gpt", 2)
    # every parameter is small (at most 64 KiB): one run, one bucket across the blocks
    assert results[0]["code"].count("all_gather_params(") == 1
    for forward, backward in results[0]["gathers"]:
        # every parameter gathered once, in one collective
        assert forward.pop("collectives") == 1 and set(forward.values()) == {1}
        assert len(forward) == len(results[0]["plan"]["params"])
        # full_shard: the members backward saved, re-gathered once each in one all-gather;
        # shard_grad_op keeps them
        if strategy == "full_shard":
            assert backward.pop("collectives") == 1 and set(backward.values()) == {1}
        else:
            assert backward == {}


def test_a_bucket_holds_a_large_parameter_with_small_ones(worlds, tmp_path):
    """wide_mlp's 83 KiB weight rides with its 2 KiB bias in a bucket of up to 100 KiB; the
    small parameters of the layers before and after it, each layer an indexed submodule
    (``layers.0``), get buckets of their own: a bucket with a parameter that is not small never
    spans two."""
    plan = _plan(tmp_path / "plan.json", "full_shard", 100 * 1024, {})
    results = worlds(2).run(recompute_cases.train, model="wide_mlp", plan=plan)
    cases.assert_matches_single_process(results, "wide_mlp", 2)
    code = results[0]["code"]
    assert code.count("all_gather_params(") == 3 and code.count("all_gather_param(") == 0
    for forward, backward in results[0]["gathers"]:
        assert forward.pop("collectives") == 3 and set(forward.values()) == {1}
        # layers.0's weight is not saved (its input needs no gradient): 2 buckets re-gathered
        assert backward.pop("collectives") == 2 and set(backward.values()) == {1}


@pytest.mark.parametrize("strategy", ["hybrid_shard", "hierarchical"])
def test_a_mesh_strategy_gathers_a_bucket_in_its_two_level_collectives(worlds, tmp_path,
                                                                       strategy):
    """World 4 as 2 nodes x 2 ranks: the two-level all-gather brings a bucket's chunks in chunk
    order as a flat one does, so the test GPT's parameters ride in one bucket under hybrid_shard
    and hierarchical too, and training equals single-process training."""
    from osdp_fx import Devices

    plan = _plan(tmp_path / "plan.json", strategy, 2**30, {}, ranks_per_node=2)
    results = worlds(4).run(recompute_cases.train, model="gpt", plan=plan,
                            devices=Devices(world_size=4, ranks_per_node=2))
    cases.assert_matches_single_process(results, "gpt", 4)
    assert results[0]["code"].count("all_gather_params(") == 1
    assert results[0]["code"].count("all_gather_param(") == 0
    for forward, backward in results[0]["gathers"]:
        assert forward.pop("collectives") == 1 and set(forward.values()) == {1}
        assert backward.pop("collectives") == 1 and set(backward.values()) == {1}

"""A world of 4 gloo ranks treated as 2 nodes x 2 ranks: hybrid_shard and hierarchical train like
one process on the global batch, alone and mixed with the other strategies, searched or given;
their two-level collectives reassemble the flat order; the mesh also comes from torchrun's
LOCAL_WORLD_SIZE; a mesh that does not divide the world is an InputError on every rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import cases
from harness import hierarchy_cases as hc

from osdp_fx import Devices

MESH = Devices(world_size=4, ranks_per_node=2)
EVERY_STRATEGY = ["hybrid_shard", "hierarchical", "full_shard", "replicate", "shard_grad_op"]


@pytest.mark.parametrize("numel", [12, 13])
def test_two_level_collectives_reassemble_the_flat_order(worlds, numel):
    results = worlds(4).run(hc.two_level_collectives, ranks_per_node=2, numel=numel)
    for rank, r in enumerate(results):
        node, local_index = divmod(rank, 2)
        hybrid, hier = r["hybrid_shard"], r["hierarchical"]
        assert (hybrid["layout"].chunks, hybrid["layout"].index) == (2, local_index)
        assert (hier["layout"].chunks, hier["layout"].index) == (4, local_index * 2 + node)
        for name, strategy in (("hybrid", hybrid), ("hierarchical", hier)):
            padded = strategy["gathered"].numel()
            assert padded == strategy["layout"].chunks * strategy["shard"].numel()
            torch.testing.assert_close(strategy["gathered"][:numel], torch.arange(float(numel)),
                                       rtol=0, atol=0, msg=name)
            # sum over the 4 ranks of (rank + 1) * arange, this rank's chunk of it
            n = strategy["shard"].numel()
            i = strategy["layout"].index
            expected = 10 * torch.arange(float(padded))[i * n:(i + 1) * n]
            torch.testing.assert_close(strategy["reduced"], expected, rtol=0, atol=0, msg=name)
            # handed over, the same results, and both buffers released on the CPU
            torch.testing.assert_close(strategy["gathered_given"], strategy["gathered"],
                                       rtol=0, atol=0, msg=name)
            torch.testing.assert_close(strategy["reduced_given"], expected, rtol=0, atol=0,
                                       msg=name)
            assert strategy["given_released"] == (0, 0), name
        # hierarchical's inter-node stage brings a contiguous block of the parameter: the chunks
        # of every node at this local index, so each byte crosses to a node once
        n = hier["shard"].numel()
        padded = torch.zeros(4 * n)
        padded[:numel] = torch.arange(float(numel))
        block = padded[local_index * 2 * n:(local_index + 1) * 2 * n]
        torch.testing.assert_close(hier["inter_block"], block, rtol=0, atol=0)


PLANS = ["hybrid_shard", "hierarchical", "mixed"]


@pytest.mark.parametrize("model", ["mlp", "gpt", "hf_gpt2"])
@pytest.mark.parametrize("plan", PLANS)
def test_training_matches_single_process(worlds, tmp_path, model, plan):
    plan_arg = (cases.mixed_plan_file(model, tmp_path / "mixed.json", EVERY_STRATEGY)
                if plan == "mixed" else plan)
    results = worlds(4).run(cases.train, model=model, plan=plan_arg, devices=MESH)
    cases.assert_matches_single_process(results, model, 4)
    plan_dict = results[0]["plan"]
    assert plan_dict["ranks_per_node"] == 2
    strategies = {p["strategy"] for p in plan_dict["params"].values()}
    assert strategies == (set(EVERY_STRATEGY) if plan == "mixed" else {plan})
    shapes = {name: p["shape"] for name, p in plan_dict["params"].items()}
    for name, p in plan_dict["params"].items():  # 1/2 of a hybrid parameter, 1/4 hierarchical
        rows, row = shapes[name][0], torch.Size(shapes[name][1:]).numel()  # whole rows
        chunks = {"hybrid_shard": 2, "hierarchical": 4}.get(p["strategy"])
        if chunks:
            assert results[0]["local_numel"][name] == -(-rows // chunks) * row, name


def test_mesh_from_local_world_size(worlds):
    """Devices that name no ranks per node: torchrun's LOCAL_WORLD_SIZE=2 makes the world 2
    nodes x 2 ranks. (Given, not measured: ``test_detect.py`` measures a 2 x 2 world.)"""
    results = worlds(4).run(hc.with_env, env={"LOCAL_WORLD_SIZE": "2"}, case=cases.train,
                            model="gpt", plan="hierarchical", devices=Devices())
    assert results[0]["plan"]["ranks_per_node"] == 2
    cases.assert_matches_single_process(results, "gpt", 4)


def test_searched_plan_on_two_nodes_with_slow_links(worlds):
    """On 2 nodes whose inter-node links are 1000x slower than intra-node ones, under a memory
    limit all-replicate exceeds, the search picks hybrid_shard, and the plan trains like one
    process. (At 100x, sharding this small model's parameters over the world in one bucket,
    one all-gather and one reduce-scatter a step, is predicted faster.)"""
    slow = Devices(world_size=4, ranks_per_node=2, inter_node_bandwidth_bytes_per_s=5e6,
                   inter_node_latency_s=1e-4, intra_node_bandwidth_bytes_per_s=5e9)
    peaks = {plan: hc.predicted_peak_bytes("gpt", plan, slow)
             for plan in ("replicate", "hybrid_shard")}
    assert peaks["hybrid_shard"] < peaks["replicate"]
    limit = (peaks["replicate"] + peaks["hybrid_shard"]) // 2
    results = worlds(4).run(cases.train, model="gpt", plan=None,
                            devices=dataclasses.replace(slow, memory_bytes=limit))
    plan = results[0]["plan"]
    strategies = [p["strategy"] for p in plan["params"].values()]
    assert "hybrid_shard" in strategies, strategies
    assert plan["predicted"]["peak_memory_bytes"] <= limit
    cases.assert_matches_single_process(results, "gpt", 4)


@pytest.mark.parametrize("plan", ["hybrid_shard", "hierarchical"])
def test_load_full_state_dict_and_export(worlds, plan):
    results = worlds(4).run(hc.load_and_export, model="gpt", plan=plan, devices=MESH)
    for r in results:
        assert list(r["state"]) == list(r["expected_state"])
        for key, expected in r["expected_state"].items():
            torch.testing.assert_close(r["state"][key], expected, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(r["out"], r["expected_out"], rtol=1e-6, atol=1e-6)
    table = results[0]["table"]
    assert "world size 4 = 2 nodes x 2 ranks" in table
    assert "across nodes" in table and "[inter]" in table


def test_local_world_size_that_does_not_divide_the_world(worlds):
    errors = worlds(4).run_expecting_error(hc.with_env, env={"LOCAL_WORLD_SIZE": "3"},
                                           case=cases.train, model="mlp", plan="hybrid_shard")
    for report in errors.values():
        assert report["type"] == "InputError"
        assert "LOCAL_WORLD_SIZE='3' does not divide the world size 4" in report["error"]
        assert "Devices(world_size=..., ranks_per_node=...)" in report["error"]
    worlds(4).run(cases.train, model="mlp", plan="hybrid_shard", devices=MESH, steps=1)

"""Offline planning (no process group): search, batch-size search, predictions as functions of b;
on 2 nodes x 8 GPUs with slow inter-node links, the search picks hybrid_shard (and hierarchical
when memory is tight), never offers either on one node, and the plan table shows each stage."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from osdp_fx.core.devices import Devices
from osdp_fx.core.setting import StepSetting
from osdp_fx.core.strategies import MESH_STRATEGIES
from osdp_fx.cost_models.timeline import BATCH
from osdp_fx.errors import PlanError
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.passes.capture import capture
from osdp_fx.plan.request import build_plan, resolve_plan
from osdp_fx.planner.analysis import MEMORY_MARGIN, plannable_bytes
from osdp_fx.planner.make import SearchOptions, param_specs, plan_model, predict
from osdp_fx.planner.search import search_batch_size, search_strategies

MIB = 2**20


def profiled_gpt(devices, vocab=512):
    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=vocab, dim=64, depth=2, heads=4, max_seq=32))
    inputs = (torch.randint(0, vocab, (4, 32)),)
    captured = capture(model, inputs)
    planned = plan_model(captured, inputs, "replicate", StepSetting(devices, optimizer="adamw"))
    analysis = planned.analysis
    return captured, inputs, analysis, devices


@pytest.fixture(scope="module")
def planned():
    return profiled_gpt(Devices(world_size=8, memory_bytes=64 * MIB))


def uniform(analysis, captured, devices, name, batch=None):
    """``analysis`` predicted under ``name`` for every group, or under a strategy per group."""
    specs = param_specs(captured)
    plan = (resolve_plan(name, specs, world_size=devices.world_size,
                         ranks_per_node=devices.ranks_per_node) if isinstance(name, str)
            else build_plan(name, specs, world_size=devices.world_size,
                            ranks_per_node=devices.ranks_per_node))
    return predict(analysis, plan, StepSetting(devices, optimizer="adamw", batch_size=batch))


def test_search_beats_uniform_plans_that_fit(planned):
    captured, inputs, analysis, devices = planned
    ddp = uniform(analysis, captured, devices, "replicate")
    fsdp = uniform(analysis, captured, devices, "full_shard")
    limit = (ddp.peak_memory_bytes + fsdp.peak_memory_bytes) // 2
    limited = Devices(world_size=8, memory_bytes=limit)
    strategies = search_strategies(analysis, StepSetting(limited, optimizer="adamw"), limit)
    plan = predict(analysis, build_plan(strategies, param_specs(captured), world_size=8),
                   StepSetting(limited, optimizer="adamw"))
    assert plan.peak_memory_bytes <= limit < ddp.peak_memory_bytes
    assert plan.step_time_s <= fsdp.step_time_s * (1 + 1e-9)
    assert plan.counts()["replicate"] < len(plan.params)


def test_batch_size_search_picks_the_fastest_batch_that_fits(planned):
    captured, inputs, analysis, devices = planned
    limit = uniform(analysis, captured, devices, "full_shard", batch=16).peak_memory_bytes
    candidates = [1, 2, 4, 8, 16, 32, 64]
    limited = Devices(world_size=8, memory_bytes=limit)
    found = search_batch_size(analysis, candidates, StepSetting(limited, optimizer="adamw"),
                              limit)
    chosen, strategies = found.batch_size, found.strategies
    plan = predict(analysis, build_plan(strategies, param_specs(captured), world_size=8),
                   StepSetting(limited, optimizer="adamw", batch_size=chosen))
    assert plan.peak_memory_bytes <= limit
    best = plan.prediction.batch_size * 8 / plan.step_time_s
    for b in candidates:
        other = uniform(analysis, captured, devices, "full_shard", batch=b)
        if other.peak_memory_bytes <= plannable_bytes(limit):  # what the search plans for
            assert b * 8 / other.step_time_s <= best * (1 + 1e-9), (b, chosen)
    assert chosen in candidates
    # 64 does not fit even fully sharded, so it cannot have been chosen
    assert uniform(analysis, captured, devices, "full_shard", batch=64).peak_memory_bytes > limit
    assert chosen < 64


def test_nothing_fits_at_any_batch_size(planned):
    captured, inputs, _, _ = planned
    tiny = 64 * 1024
    with pytest.raises(PlanError, match="at any of the batch sizes"):
        plan_model(captured, inputs, None,
                   StepSetting(Devices(world_size=8, memory_bytes=tiny), optimizer="adamw"),
                   SearchOptions(batch_sizes=(1, 2)))


def test_predictions_are_functions_of_the_batch_size(planned):
    captured, _, analysis, devices = planned
    base = uniform(analysis, captured, devices, "shard_grad_op")
    for b in (1, 3, 4, 9):
        at_b = uniform(analysis, captured, devices, "shard_grad_op", batch=b)
        assert int(base.prediction.peak_memory_expr.subs(BATCH, b)) == at_b.peak_memory_bytes
        assert float(base.prediction.step_time_expr.subs(BATCH, b)) == pytest.approx(
            at_b.step_time_s)
    assert uniform(analysis, captured, devices, "shard_grad_op", batch=8).peak_memory_bytes > \
        base.peak_memory_bytes


TWO_NODES = Devices(world_size=16, ranks_per_node=8, memory_bytes="1GiB",
                    compute_flops_per_s=1e14, memory_bandwidth_bytes_per_s=1e12,
                    intra_node_bandwidth_bytes_per_s=1e11, intra_node_latency_s=1e-5,
                    inter_node_bandwidth_bytes_per_s=1.25e7, inter_node_latency_s=5e-5)
"""2 nodes x 8 GPUs; a ring across both nodes, its crossings spread over a node's 8 network
links, 1000x slower than one inside a node ([Note: rings across nodes])."""


@pytest.fixture(scope="module")
def two_nodes():
    captured, _, analysis, _ = profiled_gpt(TWO_NODES, vocab=1024)
    return analysis, captured


def search(analysis, devices):
    return search_strategies(analysis, StepSetting(devices, optimizer="adamw"),
                             devices.memory_bytes)


def test_search_picks_hybrid_shard_when_inter_node_links_are_slow(two_nodes):
    analysis, captured = two_nodes
    plan = uniform(analysis, captured, TWO_NODES, search(analysis, TWO_NODES))
    # the largest groups (tied embedding, MLP weights) go hybrid: their gradients cross nodes as
    # one all-reduce of a 1/8 shard instead of the whole tensor
    largest = max(plan.params, key=lambda p: p.numel)
    assert largest.strategy == "hybrid_shard", plan
    for name in ("replicate", "full_shard", "shard_grad_op", "hierarchical"):
        other = uniform(analysis, captured, TWO_NODES, name)
        assert plan.prediction.comm_s < other.prediction.comm_s, name


def test_search_picks_hierarchical_when_memory_is_tight(two_nodes):
    analysis, captured = two_nodes
    peaks = {s: uniform(analysis, captured, TWO_NODES, s).peak_memory_bytes
             for s in ("hybrid_shard", "hierarchical")}
    assert peaks["hierarchical"] < peaks["hybrid_shard"]
    # the search plans for (1 - MEMORY_MARGIN) of the limit: that is halfway between the two
    tight = dataclasses.replace(
        TWO_NODES, memory_bytes=math.ceil(sum(peaks.values()) / 2 / (1 - MEMORY_MARGIN)))
    plan = uniform(analysis, captured, tight, search(analysis, tight))
    assert plan.peak_memory_bytes <= tight.memory_bytes
    assert plan.counts()["hierarchical"] > 0, plan
    # hierarchical holds as little as full_shard and sends less across nodes
    assert plan.counts()["full_shard"] == 0, plan


def test_one_node_never_offers_the_mesh_strategies(two_nodes):
    analysis, captured = two_nodes
    one_node = dataclasses.replace(TWO_NODES, ranks_per_node=None)
    tight = sum(uniform(analysis, captured, one_node, s).peak_memory_bytes
                for s in ("full_shard", "replicate")) // 2
    for limit in (one_node.memory_bytes, tight):
        strategies = set(search(analysis, dataclasses.replace(one_node, memory_bytes=limit))
                         .values())
        assert not strategies & set(MESH_STRATEGIES)
    assert strategies != {"replicate"}  # the tight limit made it shard something


def test_plan_table_shows_each_stage_and_the_bytes_across_nodes(two_nodes):
    analysis, captured = two_nodes
    text = str(uniform(analysis, captured, TWO_NODES, "hierarchical"))
    assert "Plan for world size 16 = 2 nodes x 8 ranks" in text
    # tok.weight: 1024 x 64 fp32 = 256 KiB, 16 KiB per rank; the inter stage gathers 1/8 of it
    row = next(line for line in text.splitlines() if line.startswith("model.tok.weight"))
    assert "16.0 KiB" in row
    assert "all_gather[inter] 32.0 KiB, all_gather[intra] 256.0 KiB" in row
    assert "reduce_scatter[intra] 256.0 KiB, reduce_scatter[inter] 32.0 KiB" in row
    assert "across nodes" in text


def test_plan_command_plans_a_hugging_face_model_built_on_meta(capsys):
    """`python -m osdp_fx plan` on a Hugging Face GPT-2 from its configuration, on the meta
    device: nothing is allocated, the searched plan fits and is no slower than FSDP's."""
    pytest.importorskip("transformers")
    from osdp_fx.cli import main

    assert main(["plan", "osdp_fx/examples.py:hf_gpt2_meta", "--world-size", "8",
                 "--memory", "1GiB", "--fake"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()
            if line.startswith(("searched", "all "))}
    searched, fsdp = rows["searched (osdp-fx)"], rows["all full_shard (FSDP)"]
    assert searched[-1] == "yes" and float(searched[2]) <= float(fsdp[3]) * (1 + 1e-6)
    assert "names under model.transformer." in out
    assert any(line.startswith("wte.weight") for line in out.splitlines())


def test_plan_command_compares_with_fsdp_and_ddp_checkpointed_where_they_do_not_fit(capsys):
    """A uniform plan that does not fit is also shown as its users would run it, every block
    checkpointed; the searched plan is no slower than such a row that fits."""
    from osdp_fx.cli import main

    assert main(["plan", "osdp_fx/examples.py:hf_gpt2_meta", "--world-size", "8",
                 "--memory", "450MiB", "--fake"]) == 0
    out = capsys.readouterr().out
    rows = {line[:line.index("  ")]: line[line.index("  "):].split() for line in out.splitlines()
            if line.startswith(("searched", "all "))}
    assert rows["all full_shard (FSDP)"][-1] == "NO"  # 532 MiB predicted
    checkpointed = rows["all full_shard (FSDP) + checkpointing every block"]
    assert checkpointed[-1] == "yes"
    searched = rows["searched (osdp-fx)"]
    assert searched[-1] == "yes" and float(searched[0]) <= float(checkpointed[0]) * (1 + 1e-6)
    assert "all replicate (DDP) + checkpointing every block" in rows


def test_the_same_graph_and_shapes_are_profiled_once():
    """Compiling the same model twice gives the same plan: its measured times are reused (as
    Devices are detected once); another batch shape is measured anew."""
    from osdp_fx.core.node_meta import osdp_meta
    from osdp_fx.planner.analysis import analyze

    def times(inputs):
        torch.manual_seed(0)
        model = GPTWithLoss(TinyGPT(vocab=128, dim=32, depth=1, heads=2, max_seq=16))
        captured = capture(model, inputs)
        analyze(captured, inputs)
        return {n.name: osdp_meta(n).profile for n in captured.gm.graph.nodes}

    first = times((torch.randint(0, 128, (4, 16)),))
    again = times((torch.randint(0, 128, (4, 16)),))
    other = times((torch.randint(0, 128, (2, 16)),))
    timed = [n for n, p in first.items() if p.fwd_time_s is not None]
    assert timed and all(again[n] is first[n] for n in first)
    assert all(other[n] is not first[n] for n in timed)

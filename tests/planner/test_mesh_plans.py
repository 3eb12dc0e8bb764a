"""Plans on a mesh of nodes x ranks per node, without a process group: where the mesh comes from,
the plan's JSON and hash, and the errors a mesh that does not fit the world raises."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from harness import property_cases as pc

from osdp_fx import Devices
from osdp_fx.errors import InputError, PlanError
from osdp_fx.passes.aliases import annotate_aliases_pass
from osdp_fx.passes.capture import capture
from osdp_fx.passes.shard import shard_parameters_pass
from osdp_fx.plan.request import resolve_plan
from osdp_fx.planner.make import param_specs
from osdp_fx.runtime.hierarchy import ranks_per_node_for, shard_layout


@pytest.fixture
def specs():
    return param_specs(capture(pc.small_mlp(), (torch.randn(2, 4),)))


def test_mesh_comes_from_devices_then_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_node_for(None, 8) is None
    assert ranks_per_node_for(Devices(world_size=8, ranks_per_node=2), 8) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert ranks_per_node_for(None, 8) == 4
    assert ranks_per_node_for(Devices(world_size=8), 8) == 4
    assert ranks_per_node_for(Devices(world_size=8, ranks_per_node=2), 8) == 2  # given wins
    assert ranks_per_node_for(None, 1) is None
    for bad in ("3", "zero"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(InputError, match=f"LOCAL_WORLD_SIZE='{bad}' does not divide the "
                                             "world size 8.*--nproc-per-node"):
            ranks_per_node_for(None, 8)


def test_json_records_the_mesh_and_the_hash_depends_on_it(specs, tmp_path):
    plan = resolve_plan("hybrid_shard", specs, world_size=4, ranks_per_node=2)
    one_node = resolve_plan("hybrid_shard", specs, world_size=4)
    assert plan.to_dict()["ranks_per_node"] == 2 and plan.num_nodes == 2
    assert "ranks_per_node" not in one_node.to_dict() and one_node.num_nodes == 1
    assert resolve_plan("hybrid_shard", specs, world_size=4, ranks_per_node=4) == one_node
    assert plan.hash() != one_node.hash()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert resolve_plan(str(path), specs, world_size=4, ranks_per_node=2).hash() == plan.hash()
    with pytest.raises(PlanError, match="made for 2 ranks per node but this world is 4 ranks on "
                                        r"one node.*Devices\(world_size=\.\.\., ranks_per_node=2\)"):
        resolve_plan(str(path), specs, world_size=4)
    # the file without its "ranks_per_node" runs on any mesh
    data = json.loads(path.read_text())
    del data["ranks_per_node"], data["world_size"]
    path.write_text(json.dumps(data))
    assert resolve_plan(str(path), specs, world_size=8, ranks_per_node=4).ranks_per_node == 4


def test_plan_object_for_another_mesh(specs):
    plan = resolve_plan("hierarchical", specs, world_size=8, ranks_per_node=4)
    with pytest.raises(PlanError, match="made for 2 nodes x 4 ranks but this world is 4 nodes "
                                        r"x 2 ranks.*Devices\(world_size=\.\.\., ranks_per_node"):
        resolve_plan(plan, specs, world_size=8, ranks_per_node=2)
    replicated = resolve_plan("replicate", specs, world_size=8, ranks_per_node=4)
    assert resolve_plan(replicated, specs, world_size=8, ranks_per_node=2).ranks_per_node == 2
    with pytest.raises(PlanError, match="ranks_per_node=3 does not divide the world size 8"):
        resolve_plan("hybrid_shard", specs, world_size=8, ranks_per_node=3)
    with pytest.raises(PlanError, match="ranks_per_node=3 does not divide"):
        dataclasses.replace(plan, ranks_per_node=3)


@pytest.mark.parametrize("strategy,chunks", [("hybrid_shard", 2), ("hierarchical", 4)])
def test_shard_pass_cuts_each_rank_its_chunk(strategy, chunks):
    """World 4 as 2 nodes x 2 ranks, run for every rank: each holds the chunk of its layout,
    hybrid_shard's chunks repeat on every node, hierarchical's cover the parameter once."""
    model = pc.small_mlp()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    held: dict[str, dict[int, torch.Tensor]] = {n: {} for n in full}
    for rank in range(4):
        captured = capture(pc.small_mlp(), (torch.randn(2, 4),))
        annotate_aliases_pass(captured.gm, (torch.randn(2, 4),))
        plan = resolve_plan(strategy, param_specs(captured), world_size=4, ranks_per_node=2)
        gm = shard_parameters_pass(captured.gm, plan=plan, world_size=4, rank=rank).graph_module
        layout = shard_layout(strategy, world_size=4, ranks_per_node=2, rank=rank)
        assert layout.chunks == chunks and layout.copies == 4 // chunks
        assert f"'{strategy}', '{strategy}/2x2'" in gm.code
        for name in full:
            shard = gm.get_parameter(name).detach()
            assert held[name].setdefault(layout.index, shard).equal(shard), (name, rank)
    for name, value in full.items():
        assert sorted(held[name]) == list(range(chunks))
        flat = torch.cat([held[name][i] for i in range(chunks)])
        torch.testing.assert_close(flat[:value.numel()], value.reshape(-1), rtol=0, atol=0)
        assert not flat[value.numel():].any()


@pytest.mark.parametrize("strategy", ["hybrid_shard", "hierarchical"])
def test_one_process_computes_what_the_model_computes(strategy):
    """World size 1 (no process group): the mesh is 1 x 1 and both strategies are exact."""
    from osdp_fx import compile_osdp
    from osdp_fx.examples import TinyGPT, lm_loss

    torch.manual_seed(0)
    model = TinyGPT(vocab=11, dim=8, depth=1, heads=2, max_seq=4)
    reference = copy.deepcopy(model)
    x = torch.randint(0, 11, (2, 4))
    compiled = compile_osdp(model, (x,), plan=strategy)
    assert f"'{strategy}', '{strategy}/1x1'" in compiled.code
    lm_loss(compiled(x), x).backward()
    lm_loss(reference(x), x).backward()
    torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    grads = compiled.full_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-7, msg=name)

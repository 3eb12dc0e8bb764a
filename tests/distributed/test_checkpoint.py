"""save_checkpoint / load_checkpoint on real gloo worlds: exact resumption, resharding across
world sizes and plans, errors, and a failed save that leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from harness import checkpoint_cases as cc


def plan_file(tmp_path, name: str, contents: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, **contents}))
    return str(path)


def mixed_plan(tmp_path, model: str) -> str:
    net, _ = cc.build(model)
    strategies = ["full_shard", "replicate", "shard_grad_op"]
    return plan_file(tmp_path, f"{model}-mixed", {"params": {
        n: strategies[i % 3] for i, (n, _) in enumerate(net.named_parameters())}})


@pytest.mark.parametrize("model,plan", [("mlp", "full_shard"), ("gpt", "mixed"),
                                        ("mlp", "split")])
def test_resume_at_the_same_world_size_is_bitwise_exact(worlds, tmp_path, model, plan):
    if plan == "mixed":
        plan = mixed_plan(tmp_path, model)
    elif plan == "split":  # part parameters are checkpointed under their own names
        plan = plan_file(tmp_path, "split", {"splits": {"mlp.layers.1.weight": 3},
                                             "default": "full_shard",
                                             "params": {"mlp.layers.1.weight_part1": "replicate"}})
    results = worlds(2).run(cc.resume_same_world, model=model, plan=plan,
                            path=str(tmp_path / "ckpt"))
    for r in results:
        assert r["state_equal"], "loaded parameters and buffers differ from the saved ones"
        assert r["extra"] == {"step": 3}
        assert r["resumed"] == r["after"], (r["resumed"], r["after"])  # bitwise
    assert results[0]["after"] != results[1]["after"]  # the ranks saw different data
    assert ".metadata" in results[0]["files"] and "plan.json" in results[0]["files"]


def test_resharding_from_2_to_4_to_1_ranks_continues_the_same_run(worlds, tmp_path):
    a, b = str(tmp_path / "at-step-3"), str(tmp_path / "at-step-6")
    seg = dict(model="mlp", plan="full_shard", steps=3)
    w2 = worlds(2).run(cc.train_segment, start=0, load=None, save=a, **seg)
    w4 = worlds(4).run(cc.train_segment, start=3, load=a, save=b, **seg)
    w1 = worlds(1).run(cc.train_segment, start=6, load=b, save=None, **seg)
    ref = cc.reference("mlp", steps=9)

    # every rank of the 4-rank world holds a shard of each weight; the 3-element bias has no
    # element on rank 3
    assert [r["local_numel"]["mlp.layers.2.bias"] for r in w4] == [1, 1, 1, 1]
    for segment, saved in ((w4, w2), (w1, w4)):  # loading restores the saved state exactly
        for r in segment:
            for key, value in saved[0]["end"].items():
                torch.testing.assert_close(r["at_start"][key], value, rtol=0, atol=0, msg=key)
    # the loss of a global batch is the mean of the ranks' losses (equal local batches)
    got = torch.cat([torch.tensor([r["losses"] for r in world], dtype=torch.float64).mean(0)
                     for world in (w2, w4, w1)])
    want = torch.tensor(ref["losses"], dtype=torch.float64)
    print("resharding: max |loss - reference| =", (got - want).abs().max().item())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("target", ["replicate", "mixed"])
def test_a_full_shard_checkpoint_loads_under_another_plan(worlds, tmp_path, target):
    a = str(tmp_path / "full-shard")
    w2 = worlds(2).run(cc.train_segment, model="gpt", plan="full_shard", start=0, steps=2,
                       load=None, save=a)
    plan = mixed_plan(tmp_path, "gpt") if target == "mixed" else target
    for world in (2, 4):
        results = worlds(world).run(cc.train_segment, model="gpt", plan=plan, start=2, steps=2,
                                    load=a, save=None)
        ref = cc.reference("gpt", steps=4)
        for r in results:
            for key, value in w2[0]["end"].items():
                torch.testing.assert_close(r["at_start"][key], value, rtol=0, atol=0, msg=key)
            assert set(r["strategies"].values()) == (
                {"replicate"} if target == "replicate"
                else {"replicate", "full_shard", "shard_grad_op"})
        got = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
        # float32 losses near 4 are 4.8e-7 apart: a few of them, the parity tests' bound
        torch.testing.assert_close(got, torch.tensor(ref["losses"][2:], dtype=torch.float64),
                                   rtol=0, atol=1e-5)


def test_a_checkpoint_loads_under_other_splits_at_any_world_size(worlds, tmp_path):
    """Saved at world 2 from a plan that splits two linears (one part replicated, the others
    sharded); loaded without splits and under other splits, at world 1 and 2: the state is
    restored exactly and training goes on like one process, AdamW's state included."""
    a = str(tmp_path / "split")
    split = plan_file(tmp_path, "split", {
        "splits": {"mlp.layers.0.weight": 2, "mlp.layers.1.weight": 3}, "default": "full_shard",
        "params": {"mlp.layers.1.weight_part1": "replicate"}})
    other = plan_file(tmp_path, "other", {"splits": {"mlp.layers.1.weight": 2},
                                          "default": "shard_grad_op"})
    saved = worlds(2).run(cc.train_segment, model="mlp", plan=split, start=0, steps=2,
                          load=None, save=a)
    assert "mlp.layers.1.weight_part2" in saved[0]["strategies"]
    ref = cc.reference("mlp", steps=4)
    for world, plan in ((1, "full_shard"), (2, "replicate"), (2, other), (1, other)):
        results = worlds(world).run(cc.train_segment, model="mlp", plan=plan, start=2, steps=2,
                                    load=a, save=None)
        for r in results:
            for key, value in saved[0]["end"].items():
                torch.testing.assert_close(r["at_start"][key], value, rtol=0, atol=0, msg=key)
        got = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
        torch.testing.assert_close(got, torch.tensor(ref["losses"][2:], dtype=torch.float64),
                                   rtol=0, atol=1e-5)


def test_mesh_strategies_reshard_through_checkpoints(worlds, tmp_path):
    """World 4 as 2 nodes x 2 ranks: hybrid_shard (each node holds every chunk) saves,
    hierarchical (chunks in two-stage order) loads and saves, full_shard on 2 ranks loads: each
    load restores the saved state and optimizer exactly, and the run continues like one process."""
    from osdp_fx import Devices

    mesh = Devices(world_size=4, ranks_per_node=2)
    a, b = str(tmp_path / "hybrid"), str(tmp_path / "hierarchical")
    seg = dict(model="gpt", steps=2)
    hybrid = worlds(4).run(cc.train_segment, plan="hybrid_shard", start=0, load=None, save=a,
                           devices=mesh, **seg)
    hier = worlds(4).run(cc.train_segment, plan="hierarchical", start=2, load=a, save=b,
                         devices=mesh, **seg)
    flat = worlds(2).run(cc.train_segment, plan="full_shard", start=4, load=b, save=None, **seg)
    assert set(hybrid[0]["strategies"].values()) == {"hybrid_shard"}
    assert set(hier[0]["strategies"].values()) == {"hierarchical"}
    for segment, saved in ((hier, hybrid), (flat, hier)):
        for r in segment:
            for key, value in saved[0]["end"].items():
                torch.testing.assert_close(r["at_start"][key], value, rtol=0, atol=0, msg=key)
    got = torch.cat([torch.tensor([r["losses"] for r in world], dtype=torch.float64).mean(0)
                     for world in (hybrid, hier, flat)])
    want = torch.tensor(cc.reference("gpt", steps=6)["losses"], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_errors_name_the_problem_and_the_fix(worlds, tmp_path):
    path = str(tmp_path / "mlp")
    worlds(2).run(cc.train_segment, model="mlp", plan="full_shard", start=0, steps=1,
                  load=None, save=path)
    split = plan_file(tmp_path, "split", {"splits": {"mlp.layers.0.weight": 2},
                                          "default": "full_shard"})
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    results = worlds(2).run(cc.checkpoint_errors, path=path, missing=str(tmp_path / "nothing"),
                            split_plan=split, not_checkpoint=str(tmp_path / "notes"))
    for r in results:
        assert r["missing"].startswith("CheckpointError") and "no checkpoint at" in r["missing"]
        assert "save_checkpoint wrote" in r["missing"]
        assert "does not fit this model" in r["other_model"]
        assert "mlp.layers.0.weight" in r["other_model"], r["other_model"]
        assert r["other_splits"] == "", r["other_splits"]  # loads under other splits
        assert "same param groups" in r["other_groups"]
        assert "InputError" in r["not_a_module"] and "compile_osdp returned" in r["not_a_module"]
        assert r["loaded_steps"] == "[1.0]"
        assert "no optimizer state" in r["no_optimizer_state"]
        assert "optimizer=None" in r["no_optimizer_state"]
        assert "is not a checkpoint" in r["not_checkpoint"] and "new path" in r["not_checkpoint"]
    assert results[0] == results[1]  # every rank raised, with the same message
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_a_failed_save_leaves_the_previous_checkpoint_intact(worlds, tmp_path):
    path = str(tmp_path / "ckpt")
    for r in worlds(2).run(cc.failed_saves, path=path):
        stray, unsaveable = r["errors"]["stray_param"], r["errors"]["unsaveable_state"]
        assert stray.startswith("CheckpointError") and "rank(s) [1]" in stray
        assert "not parameters of the compiled model" in stray and "compiled.parameters()" in stray
        assert unsaveable.startswith("CheckpointError") and "previous checkpoint is unchanged" \
            in unsaveable
        assert "meta tensor" in unsaveable, unsaveable
        assert r["leftovers"] == ["ckpt"], "the temporary directory was not removed"
        assert r["extra"] == "first" and r["state_equal"]


DATA = pathlib.Path(__file__).parent.parent / "data" / "checkpoint_v2"


@pytest.mark.parametrize("world,plan", [(2, "full_shard"), (1, "replicate")])
def test_a_version_2_checkpoint_loads_and_resumes(worlds, world, plan):
    """Version 2 (before shards were whole rows) saved every tensor flat, here from a model
    split and sharded at world 2: it loads without the splits, at world 1 and 2, and training
    resumes as it did after the save."""
    expected = torch.load(DATA / "expected.pt")
    results = worlds(world).run(cc.load_version_2, path=str(DATA), plan=plan)
    for r in results:
        assert r["extra"] == {"step": 2}
        for key, value in expected["full"].items():
            assert torch.equal(r["full"][key], value), key
    mean = torch.tensor([r["after"] for r in results]).mean(0)
    saved = torch.tensor(expected["after"]).mean(0)  # the two ranks' losses after the save
    torch.testing.assert_close(mean, saved, atol=1e-6, rtol=0)

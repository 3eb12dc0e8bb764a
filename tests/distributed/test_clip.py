"""clip_grad_norm_ on real gloo worlds equals torch's clipping in one process on the full batch
(in one process at world size 1: tests/training/test_clip.py)."""

from __future__ import annotations

import math

import pytest
import torch
from harness import clip_cases as cc

from osdp_fx import Devices

INF = math.inf
MAX_NORM = {2.0: 0.1, INF: 0.02}  # below every step's norm (asserted), so clipping happens
PLANS = ["replicate", "full_shard", "shard_grad_op", "mixed"]


def check_against_reference(results, model, world_size, norm_type):
    max_norm = MAX_NORM[norm_type]
    ref = cc.reference_train_clipped(model, world=world_size, max_norm=max_norm,
                                     norm_type=norm_type)
    assert (ref["norms"] > max_norm).all(), "max_norm too large: nothing was clipped"

    for r in results:  # the same norm on every rank, equal to torch's
        torch.testing.assert_close(r["norms"], results[0]["norms"], rtol=0, atol=0)
    torch.testing.assert_close(results[0]["norms"], ref["norms"], rtol=1e-6, atol=1e-7)

    got = results[0]
    for step, (grads, expected) in enumerate(zip(got["grads"], ref["grads"])):
        for name, g in grads.items():  # canonical names; tied weights appear once
            want = expected[name]
            if want is None:
                assert g is None, f"step {step}: {name} has a gradient but is frozen"
                continue
            torch.testing.assert_close(g, want, rtol=0, atol=1e-6, msg=f"step {step}: {name}")
        clipped = torch.linalg.vector_norm(
            torch.cat([g.reshape(-1) for g in grads.values() if g is not None]), norm_type)
        assert clipped <= max_norm * (1 + 1e-5)
    assert list(got["state"]) == list(ref["state"])
    for key, want in ref["state"].items():
        torch.testing.assert_close(got["state"][key], want, rtol=0, atol=1e-5, msg=key)


# World 2: every plan x model x norm. World 4 (4 processes on the CI's 2 cores, slow): every plan
# with every norm, each model taking each plan once and each norm twice.
CASES = [(plan, model, 2, norm) for plan in PLANS for model in ("gpt", "mlp")
         for norm in (2.0, INF)] + [
    ("replicate", "gpt", 4, 2.0), ("replicate", "mlp", 4, INF),
    ("full_shard", "mlp", 4, 2.0), ("full_shard", "gpt", 4, INF),
    ("shard_grad_op", "gpt", 4, 2.0), ("shard_grad_op", "mlp", 4, INF),
    ("mixed", "mlp", 4, 2.0), ("mixed", "gpt", 4, INF),
]


@pytest.mark.parametrize(("plan", "model", "world_size", "norm_type"), CASES,
                         ids=[f"{p}-{m}-{w}-{'inf' if n == INF else 'l2'}" for p, m, w, n in CASES])
def test_clipped_training_matches_single_process(worlds, tmp_path, plan, model, world_size,
                                                 norm_type):
    plan_arg = cc.write_mixed_plan(model, str(tmp_path / "mixed.json")) if plan == "mixed" else plan
    results = worlds(world_size).run(cc.train_clipped, model=model, plan=plan_arg,
                                     max_norm=MAX_NORM[norm_type], norm_type=norm_type)
    expected = ["full_shard", "replicate", "shard_grad_op"] if plan == "mixed" else [plan]
    assert results[0]["strategies"] == expected
    check_against_reference(results, model, world_size, norm_type)


MESH_CASES = [("hybrid_shard", "gpt", 2.0), ("hybrid_shard", "mlp", INF),
              ("hierarchical", "mlp", 2.0), ("hierarchical", "gpt", INF),
              ("mixed", "gpt", 2.0), ("mixed", "mlp", INF)]
EVERY_STRATEGY = ["hybrid_shard", "hierarchical", "full_shard", "replicate", "shard_grad_op"]


@pytest.mark.parametrize(("plan", "model", "norm_type"), MESH_CASES,
                         ids=[f"{p}-{m}-{'inf' if n == INF else 'l2'}" for p, m, n in MESH_CASES])
def test_two_node_mesh(worlds, tmp_path, plan, model, norm_type):
    """World 4 as 2 nodes x 2 ranks: a hybrid_shard gradient lives on one rank of each node and
    counts once; hierarchical chunks are spread over the ranks in two-stage order."""
    plan_arg = (cc.write_mixed_plan(model, str(tmp_path / "mixed.json"), EVERY_STRATEGY)
                if plan == "mixed" else plan)
    results = worlds(4).run(cc.train_clipped, model=model, plan=plan_arg,
                            max_norm=MAX_NORM[norm_type], norm_type=norm_type,
                            devices=Devices(world_size=4, ranks_per_node=2))
    assert results[0]["strategies"] == (sorted(EVERY_STRATEGY) if plan == "mixed" else [plan])
    check_against_reference(results, model, 4, norm_type)


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
def test_split_linear_parts(worlds, tmp_path, norm_type):
    """A plan that splits a linear: its parts (uneven, one per strategy) each count once, and
    full_grads() concatenates them back under the original names."""
    plan = cc.write_split_plan(str(tmp_path / "split.json"))
    results = worlds(2).run(cc.train_clipped, model="mlp", plan=plan,
                            max_norm=MAX_NORM[norm_type], norm_type=norm_type)
    assert results[0]["strategies"] == ["full_shard", "replicate", "shard_grad_op"]
    assert "layers.1.weight_part2" in results[0]["params"]
    check_against_reference(results, "mlp", 2, norm_type)


@pytest.mark.parametrize("plan", ["full_shard", "mixed"])
def test_frozen_parameters_are_skipped(worlds, tmp_path, plan):
    plan_arg = (cc.write_mixed_plan("mlp_frozen", str(tmp_path / "mixed.json"))
                if plan == "mixed" else plan)
    results = worlds(2).run(cc.train_clipped, model="mlp_frozen", plan=plan_arg,
                            max_norm=MAX_NORM[2.0], norm_type=2.0)
    assert results[0]["grads"][0]["layers.0.weight"] is None
    check_against_reference(results, "mlp_frozen", 2, 2.0)


@pytest.mark.parametrize("norm_type", [2.0, INF], ids=["l2", "inf"])
@pytest.mark.parametrize("plan", ["full_shard", "replicate"])
def test_nonfinite_gradient_on_one_rank(worlds, plan, norm_type):
    results = worlds(2).run(cc.nonfinite, plan=plan, norm_type=norm_type)
    for r in results:  # every rank raised, and every rank saw nan without the flag
        assert "non-finite" in r["error"] and "error_if_nonfinite=False" in r["error"]
        assert "unexpected" not in r
        assert torch.isnan(r["norm"])

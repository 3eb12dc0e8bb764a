"""Real multi-process gloo worlds train like single-process training on the full batch."""

from __future__ import annotations

import json

import pytest
from harness import cases

MODELS = ["mlp", "gpt", "hf_gpt2"]
PLANS = ["replicate", "full_shard", "shard_grad_op", "mixed", "split"]
SPLITS = {
    "mlp": {"layers.0.weight": 3, "layers.1.weight": 2},
    "gpt": {"blocks.0.fc.weight": 4, "blocks.1.qkv.weight": 3},
    "hf_gpt2": {"transformer.h.0.mlp.c_fc.weight": 4, "transformer.h.1.attn.c_attn.weight": 3},
}


def mixed_plan_file(model: str, tmp_path) -> str:
    """A hand-written plan file cycling through the three strategies parameter by parameter."""
    return cases.mixed_plan_file(model, tmp_path / f"{model}-mixed.json",
                                 ["full_shard", "replicate", "shard_grad_op"])


def split_plan_file(model: str, tmp_path) -> str:
    """Some linears split (unevenly where k does not divide), their parts on mixed strategies."""
    params = {}
    for weight in SPLITS[model]:
        params[f"{weight}_part0"] = "replicate"
        params[f"{weight}_part1"] = "shard_grad_op"
    path = tmp_path / f"{model}-split.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "splits": SPLITS[model],
                                "default": "full_shard", "params": params}))
    return str(path)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("plan", PLANS)
def test_training_matches_single_process(worlds, tmp_path, model, plan, world_size):
    plan_arg = {"mixed": mixed_plan_file, "split": split_plan_file}.get(plan)
    plan_arg = plan_arg(model, tmp_path) if plan_arg else plan
    results = worlds(world_size).run(cases.train, model=model, plan=plan_arg)
    cases.assert_matches_single_process(results, model, world_size)

    strategies = {p["strategy"] for p in results[0]["plan"]["params"].values()}
    if plan in ("mixed", "split"):
        assert strategies == {"replicate", "full_shard", "shard_grad_op"}
    else:
        assert strategies == {plan}
    assert results[0]["plan"].get("splits", {}) == (SPLITS[model] if plan == "split" else {})

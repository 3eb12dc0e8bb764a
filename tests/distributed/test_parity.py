"""Real multi-process gloo worlds train like single-process training on the full batch."""

from __future__ import annotations

import json

import pytest
import torch

from harness import cases
from harness.models import build

MODELS = ["mlp", "gpt", "hf_gpt2"]
PLANS = ["replicate", "full_shard", "shard_grad_op", "mixed", "split"]
SPLITS = {
    "mlp": {"layers.0.weight": 3, "layers.1.weight": 2},
    "gpt": {"blocks.0.fc.weight": 4, "blocks.1.qkv.weight": 3},
    "hf_gpt2": {"transformer.h.0.mlp.c_fc.weight": 4, "transformer.h.1.attn.c_attn.weight": 3},
}


def mixed_plan_file(model: str, tmp_path) -> str:
    """A hand-written plan file cycling through the three strategies parameter by parameter."""
    net, _ = build(model)
    strategies = ["full_shard", "replicate", "shard_grad_op"]
    params = {name: strategies[i % 3] for i, (name, _) in enumerate(net.named_parameters())}
    path = tmp_path / f"{model}-mixed.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "params": params}))
    return str(path)


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
    ref = cases.reference_train(model, world=world_size)

    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"]), atol=1e-5, rtol=0)

    for rank_result in results:
        state = rank_result["state"]
        assert list(state) == list(ref["state"]), "full_state_dict keys differ from the model's"
        for key, expected in ref["state"].items():
            torch.testing.assert_close(state[key], expected, atol=1e-4, rtol=0, msg=key)

    strategies = {p["strategy"] for p in results[0]["plan"]["params"].values()}
    if plan in ("mixed", "split"):
        assert strategies == {"replicate", "full_shard", "shard_grad_op"}
    else:
        assert strategies == {plan}
    assert results[0]["plan"].get("splits", {}) == (SPLITS[model] if plan == "split" else {})

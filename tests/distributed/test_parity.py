"""Real multi-process gloo worlds train like single-process training on the full batch."""

from __future__ import annotations

import json

import pytest
import torch

from harness import cases
from harness.models import build

MODELS = ["mlp", "gpt", "hf_gpt2"]
PLANS = ["replicate", "full_shard", "shard_grad_op", "mixed"]


def mixed_plan_file(model: str, tmp_path) -> str:
    """A hand-written plan file cycling through the three strategies parameter by parameter."""
    net, _ = build(model)
    strategies = ["full_shard", "replicate", "shard_grad_op"]
    params = {name: strategies[i % 3] for i, (name, _) in enumerate(net.named_parameters())}
    path = tmp_path / f"{model}-mixed.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "params": params}))
    return str(path)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("plan", PLANS)
def test_training_matches_single_process(worlds, tmp_path, model, plan, world_size):
    plan_arg = mixed_plan_file(model, tmp_path) if plan == "mixed" else plan
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
    if plan == "mixed":
        assert strategies == {"replicate", "full_shard", "shard_grad_op"}
    else:
        assert strategies == {plan}

"""The predicted peak memory of a step matches a live-tensor tracker within 10% (world 2)."""

from __future__ import annotations

import pytest

from harness import cases


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("plan", ["replicate", "shard_grad_op", "full_shard"])
@pytest.mark.parametrize("model", ["mlp", "gpt", "hf_gpt2"])
def test_predicted_peak_memory_within_ten_percent(worlds, model, plan, optimizer):
    results = worlds(2).run(cases.memory_prediction, model=model, plan=plan, optimizer=optimizer)
    for rank, r in enumerate(results):
        error = r["predicted"] / r["measured"] - 1
        assert abs(error) <= 0.10, (
            f"rank {rank}: predicted {r['predicted']} B (peak at {r['peak_at']}), measured "
            f"{r['measured']} B ({error:+.1%})")

"""Any batch size and sequence length, and keyword inputs, at world 2 (gloo): one compiled
module trains on batch 1, a smaller last batch, shorter and longer sequences than its example,
like one process on the global batches (loss 1e-5, parameters 1e-4); a Hugging Face Llama
(captured by torch.export) is called with input_ids, a padded attention_mask and labels and
returns its ModelOutput; a shape over the memory limit raises on every rank before any
collective, and training goes on."""

from __future__ import annotations

import math

import pytest
import torch
from harness import shape_cases


@pytest.mark.parametrize("plan", ["full_shard", "mixed"])
@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_every_shape_trains_like_one_process(worlds, model, plan):
    results = worlds(2).run(shape_cases.train_shapes, model=model, plan=plan)
    assert results[0]["captured_by"] == ("export" if model == "llama" else "symbolic_trace")
    ref = shape_cases.reference_shapes(model, world=2)
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
    for rank_result in results:
        assert list(rank_result["state"]) == list(ref["state"])
        for key, expected in ref["state"].items():
            torch.testing.assert_close(rank_result["state"][key], expected, atol=1e-4, rtol=0,
                                       msg=key)


@pytest.mark.parametrize("model", ["llama", "gpt"])
def test_a_shape_over_the_memory_limit_raises_before_it_runs(worlds, model):
    results = worlds(2).run(shape_cases.over_limit, model=model)
    for r in results:
        assert r["seq_len"] == shape_cases.EXAMPLE[1] and "s" in r["expr"]
        assert r["big_predicted"] > r["limit"]
        assert r["error"] is not None, "the over-limit shape ran"
        assert "batch 16 x sequence 16" in r["error"] and "over the memory limit" in r["error"]
        assert math.isfinite(r["after"])  # the next step ran on every rank: no hang

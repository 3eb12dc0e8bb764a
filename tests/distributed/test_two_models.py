"""Two compiled models whose forwards and backwards interleave train like one process: each
compiled module keeps its own reduce-scatters, all-reduce buckets and re-gathers."""

from __future__ import annotations

import pytest
import torch
from harness import two_models_cases


@pytest.mark.parametrize("two_backwards", [False, True], ids=["one_backward", "two_backwards"])
@pytest.mark.parametrize("plan", ["full_shard", "shard_grad_op", "mixed"])
def test_interleaved_models_train_like_one_process(worlds, plan, two_backwards):
    """Forward A, forward B on A's output, forward B on other data; one backward of both
    losses, or a backward of each (B's gradients accumulate over two backwards)."""
    results = worlds(2).run(two_models_cases.train_two, plan=plan, two_backwards=two_backwards)
    ref = two_models_cases.reference_two(world=2)
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    assert torch.allclose(mean, torch.tensor(ref["losses"]), atol=1e-5), (mean, ref["losses"])
    for r in results:
        for part in ("a", "b"):
            for key, value in ref[part].items():
                assert torch.allclose(r[part][key], value, atol=1e-4), (part, key)

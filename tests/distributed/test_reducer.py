"""Replicated gradients are all-reduced in buckets started during backward (overlapped), in
bucket order, and average the ranks' gradients exactly as an all-reduce at the end would."""

from __future__ import annotations

import torch

from harness import reducer_cases


def test_buckets_start_during_backward_and_average_the_ranks_gradients(worlds):
    results = worlds(2).run(reducer_cases.overlapped_buckets)
    expected = {n: (g0 + g1) / 2 for (n, g0), g1 in zip(
        reducer_cases.local_grads(0).items(), reducer_cases.local_grads(1).values())}
    for r in results:
        assert r["buckets"] == 4
        # when backward reaches layer 0's output, layers 3, 2 and 1 (buckets 0-2) have their
        # gradients and their all-reduces have started; layer 0's (bucket 3) has not
        assert r["started_at_first_layer"] == [3, 3]
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7)

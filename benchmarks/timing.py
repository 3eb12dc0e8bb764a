"""The median wall time of a callable, as the small benchmarks here take it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_s(fn: Callable[[], Any], device: torch.device, *, runs: int = 15, warmup: int = 3,
             before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``fn`` over ``runs`` runs after ``warmup`` untimed ones, each run
    after ``before`` (untimed; a barrier, say), synchronized on a GPU."""
    times = []
    for i in range(warmup + runs):
        if before is not None:
            before()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)

"""Which timed plan autotuning keeps (``autotune.keep_index``): the measured fastest only when
the timing can tell it from the predicted best."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch import nn

from osdp_fx.core.buckets import Schedule
from osdp_fx.plan.request import ParamSpec, build_plan
from osdp_fx.planner.autotune import (
    NOISE_SIGMAS,
    autotune_plans,
    keep_index,
    median_error_s,
)


def noisy(mean: float, spread: float, n: int, seed: int) -> list[float]:
    """``n`` step times around ``mean``, off by up to ``spread`` (relative) either way, with one
    slow outlier, as a loaded machine gives."""
    rng = random.Random(seed)
    times = [mean * (1 + rng.uniform(-spread, spread)) for _ in range(n - 1)]
    return times + [mean * 1.6]


def test_a_clearly_faster_plan_replaces_the_predicted_best() -> None:
    predicted_best = noisy(0.250, 0.02, 8, seed=0)
    faster = noisy(0.200, 0.02, 8, seed=1)
    assert keep_index([predicted_best, faster, noisy(0.300, 0.02, 8, seed=2)]) == 1


def test_a_difference_within_the_noise_keeps_the_predicted_best() -> None:
    # 3 % apart with steps varying by ±15 %: 8 steps cannot tell them apart
    predicted_best = noisy(0.250, 0.15, 8, seed=3)
    other = noisy(0.2425, 0.15, 8, seed=4)
    assert sorted(other)[3] < sorted(predicted_best)[3]  # measured faster, by the median
    assert keep_index([predicted_best, other]) == 0
    # the same 3 % with steps varying by ±0.5 % (a quiet GPU) is told apart
    assert keep_index([noisy(0.250, 0.005, 8, seed=3), noisy(0.2425, 0.005, 8, seed=4)]) == 1


def test_the_threshold_is_the_medians_standard_errors() -> None:
    a, b = [1.0, 1.1, 0.9, 1.0, 1.05], [0.5, 0.55, 0.45, 0.5, 0.52]
    assert median_error_s(a) > 0 and median_error_s([1.0]) == 0.0
    gap = (median_error_s(a) ** 2 + median_error_s(b) ** 2) ** 0.5 * NOISE_SIGMAS
    assert keep_index([a, b]) == 1 and 0.5 > gap
    within = [t + 0.5 - gap * 0.9 for t in b]  # median 1.0 - 0.9 gap: within the noise
    beyond = [t + 0.5 - gap * 1.1 for t in b]
    assert keep_index([a, within]) == 0 and keep_index([a, beyond]) == 1
    assert keep_index([[0.3], [0.2]]) == 1  # one step each: no spread to go by


def test_a_plan_measured_over_the_limit_is_never_kept() -> None:
    slow, fast, faster = noisy(0.300, 0.01, 8, 5), noisy(0.250, 0.01, 8, 6), noisy(0.2, 0.01, 8, 7)
    assert keep_index([slow, fast, faster], [True, True, False]) == 1
    # the predicted best measured over: the next in predicted order is the reference
    assert keep_index([fast, slow], [False, True]) == 1
    assert keep_index([faster, slow, fast], [False, True, True]) == 2
    assert keep_index([fast, faster], [False, False]) == 0  # none fits: the predicted best


class _Paced(nn.Module):
    """A module whose training step takes at least ``seconds``: a plan of known speed."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return (self.w * x).sum()


@pytest.mark.parametrize("fastest", [0, 1])
def test_overruling_the_prediction_times_the_two_plans_again_in_the_reverse_order(fastest):
    spec = ParamSpec(name="w", shape=(4,), dtype="float32", element_size=4, aliases=(),
                     trainable=True, frozen=False)
    plans = [build_plan({"w": "replicate"}, [spec], world_size=1, schedule=Schedule(d))
             for d in (1, 0, 2)]  # the predicted best first
    hashes = [p.hash() for p in plans]
    seconds = [0.02, 0.02, 0.03]
    seconds[fastest] = 0.004
    built = []

    def build(plan):
        built.append(hashes.index(plan.hash()))
        return _Paced(seconds[built[-1]])

    kept = autotune_plans(plans, build, (torch.ones(4),), optimizer="sgd", limit_bytes=None)
    assert kept.hash() == hashes[fastest]
    # each plan once; a challenger that beats the prediction, then the prediction, once more
    assert built == ([0, 1, 2, 1, 0] if fastest else [0, 1, 2])
    assert [t.role for t in kept.measured if t.hash == hashes[0]] == ["predicted best"]

"""Hypothesis: splitting linears into sub-linears changes nothing a user can observe.

Draws an MLP (widths that rarely divide the world size or the number of parts), a number of
parts k for each linear (uneven parts when k does not divide the out-features), a strategy for
each weight part (how many parts are sharded), and a world size; the compiled model's outputs
and its full gradients (mapped back to the original parameter names) must equal the original's.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from test_equivalence import STRATEGIES, check_equivalence, mlp_specs


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[dict[str, Any], tuple[Any, ...]]:
    spec = draw(mlp_specs())
    default = draw(st.sampled_from(STRATEGIES))
    splits: dict[str, int] = {}
    params: dict[str, str] = {}
    expected: dict[str, str] = {}
    for i, (fan_in, fan_out) in enumerate(zip(spec["sizes"][:-1], spec["sizes"][1:])):
        weight, bias = f"layers.{i}.weight", f"layers.{i}.bias"
        k = draw(st.integers(1, min(fan_out, 5)))
        names = [weight] + ([bias] if spec["bias"] else [])
        if k == 1:
            expected.update({n: default for n in names})
            continue
        splits[weight] = k
        for part in range(k):
            expected[f"{weight}_part{part}"] = params[f"{weight}_part{part}"] = draw(
                st.sampled_from(STRATEGIES))
            if spec["bias"]:
                expected[f"{bias}_part{part}"] = default
    return spec, (params, default, expected, splits)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_split_mlp_compiled_equals_original(worlds, tmp_path, world_size):
    @seed(100 + world_size)
    @settings(max_examples=8, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=split_cases())
    def prop(case: tuple[dict[str, Any], tuple[Any, ...]]) -> None:
        check_equivalence(worlds, tmp_path, world_size, case)

    prop()

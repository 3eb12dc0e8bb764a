"""Memory cost model: persistent bytes per rank of each strategy, optimizer state, transients."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from osdp_fx.cost_models.memory import (
    gathered_param_bytes,
    optimizer_state_bytes,
    param_memory,
    persistent_bytes,
    shard_numel,
    unsharded_grad_bytes,
)
from osdp_fx.errors import InputError, PlanError


def test_shards_are_padded_to_equal_size() -> None:
    assert shard_numel(10, 4) == 3
    assert shard_numel(12, 4) == 3
    assert shard_numel(1, 8) == 1
    assert gathered_param_bytes(10, element_size=4, world_size=4) == 4 * 3 * 4
    assert unsharded_grad_bytes(10, element_size=2, world_size=4) == 4 * 3 * 2


@pytest.mark.parametrize(("optimizer", "states"),
                         [("sgd", 0), ("sgd_momentum", 1), ("adam", 2), ("adamw", 2)])
def test_optimizer_state_is_fp32(optimizer: str, states: int) -> None:
    step = 4 if optimizer in ("adam", "adamw") else 0  # Adam's step counter, a float32 scalar
    assert optimizer_state_bytes(1000, optimizer=optimizer) == states * 1000 * 4 + step


def test_strategies_closed_form() -> None:
    numel, n = 1001, 4  # shard = 251 elements
    p = g = numel * 2  # fp16 parameter and gradient
    o = 2 * numel * 4 + 4  # Adam: two fp32 states and the step counter
    shard = 251
    assert persistent_bytes(numel, element_size=2, strategy="replicate", world_size=n,
                            optimizer="adam") == p + g + o
    assert persistent_bytes(numel, element_size=2, strategy="shard_grad_op", world_size=n,
                            optimizer="adam") == p + shard * 2 + 2 * shard * 4 + 4
    assert persistent_bytes(numel, element_size=2, strategy="full_shard", world_size=n,
                            optimizer="adam") == shard * 2 + shard * 2 + 2 * shard * 4 + 4
    full = param_memory(numel, element_size=2, strategy="full_shard", world_size=n,
                        optimizer="sgd")
    assert (full.param_bytes, full.grad_bytes, full.optimizer_bytes) == (502, 502, 0)
    assert full.gathered_bytes == 4 * shard * 2
    assert param_memory(numel, strategy="replicate", world_size=n).gathered_bytes == 0


@given(numel=st.integers(0, 10**7), world_size=st.integers(1, 256),
       optimizer=st.sampled_from(["sgd", "sgd_momentum", "adam"]))
def test_sharding_never_costs_more(numel: int, world_size: int, optimizer: str) -> None:
    sizes = [persistent_bytes(numel, strategy=s, world_size=world_size, optimizer=optimizer)
             for s in ("full_shard", "shard_grad_op", "replicate")]
    assert sizes == sorted(sizes)
    if world_size == 1:
        assert len(set(sizes)) == 1


def test_bad_inputs_are_user_errors() -> None:
    with pytest.raises(PlanError, match="unknown strategy 'zero4'"):
        persistent_bytes(10, strategy="zero4", world_size=2)
    with pytest.raises(InputError, match="unknown optimizer kind 'lion'"):
        optimizer_state_bytes(10, optimizer="lion")
    with pytest.raises(InputError, match="world_size"):
        shard_numel(10, 0)

"""Offline planning for gradient accumulation (``grad_accumulation=k``): the predicted peak holds
the sharded parameters' full gradients, the prediction records k without changing the plan,
the search plans under the limit for k micro-batches, and a bad k is an InputError."""

from __future__ import annotations

import pytest
import torch
from test_make import MIB, profiled_gpt

from osdp_fx import compile_osdp
from osdp_fx.core.devices import Devices
from osdp_fx.core.layout import row_numel, shard_numel
from osdp_fx.core.setting import StepSetting
from osdp_fx.errors import InputError
from osdp_fx.plan.request import build_plan, resolve_plan
from osdp_fx.planner.analysis import MEMORY_MARGIN
from osdp_fx.planner.make import param_specs, predict
from osdp_fx.planner.search import search_strategies

WORLD = 8


@pytest.fixture(scope="module")
def planned():
    return profiled_gpt(Devices(world_size=WORLD, memory_bytes=64 * MIB))


def _predict(planned, plan, k):
    _, _, analysis, devices = planned
    return predict(analysis, plan, StepSetting(devices, optimizer="adamw", grad_accumulation=k))


@pytest.mark.parametrize("strategy", ["shard_grad_op", "full_shard"])
def test_sharded_plans_hold_full_gradients_between_micro_batches(planned, strategy):
    captured = planned[0]
    plan = resolve_plan(strategy, param_specs(captured), world_size=WORLD)
    one, two, three = (_predict(planned, plan, k) for k in (1, 2, 3))
    full_grads = sum(WORLD * shard_numel(p.numel, WORLD, row_numel(p.shape)) * 4  # padded, fp32
                     for p in plan.params)
    # this GPT peaks at the start of backward, where no gradient exists without accumulation
    assert three.peak_memory_bytes - one.peak_memory_bytes == full_grads
    assert one.peak_memory_bytes < two.peak_memory_bytes <= three.peak_memory_bytes
    assert "no_sync" in three.prediction.peak_at
    assert dict(three.prediction.peak_by_category)["gradients"] >= full_grads
    assert three.prediction.grad_accumulation == 3
    assert three.to_dict()["predicted"]["grad_accumulation"] == 3
    assert three.hash() == one.hash() == plan.hash()  # no collective changes
    # the timeline shows a no_sync micro-batch before the synchronised one
    assert any(p.t < 0 and "no_sync" in p.where for p in three.prediction.memory_timeline)


def test_the_search_plans_for_the_micro_batches(planned):
    captured, _, analysis, _ = planned
    specs = param_specs(captured)
    low = _predict(planned, resolve_plan("full_shard", specs, world_size=WORLD), 3)
    high = _predict(planned, resolve_plan("replicate", specs, world_size=WORLD), 1)
    limit = (low.peak_memory_bytes + high.peak_memory_bytes) // 2
    devices = Devices(world_size=WORLD, memory_bytes=limit)
    plans = {}
    for k in (1, 3):
        strategies = search_strategies(
            analysis, StepSetting(devices, optimizer="adamw", grad_accumulation=k), limit)
        plans[k] = build_plan(strategies, specs, world_size=WORLD)
    planned_for_3 = _predict(planned, plans[3], 3).peak_memory_bytes
    assert planned_for_3 <= limit * (1 - MEMORY_MARGIN) + 1
    # a plan searched without accumulation would not fit when accumulating
    assert _predict(planned, plans[1], 3).peak_memory_bytes > limit
    assert plans[3].counts()["full_shard"] > plans[1].counts()["full_shard"]


@pytest.mark.parametrize("value", [0, -2, 2.5, "3", True, None])
def test_grad_accumulation_must_be_a_positive_int(value):
    with pytest.raises(InputError, match=r"grad_accumulation=.*int >= 1"):
        compile_osdp(torch.nn.Linear(4, 4), (torch.randn(2, 4),), plan="replicate",
                     grad_accumulation=value)

"""Offline planning (no process group): search, batch-size search, predictions as functions of b."""

from __future__ import annotations

import pytest
import torch

from osdp_fx.capture import capture
from osdp_fx.cost_models.timeline import BATCH
from osdp_fx.devices import Devices
from osdp_fx.errors import PlanError
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.plan import build_plan, resolve_plan
from osdp_fx.planner import (
    make_plan,
    param_specs,
    predict,
    search_batch_size,
    search_strategies,
)

MIB = 2**20


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=512, dim=64, depth=2, heads=4, max_seq=32))
    inputs = (torch.randint(0, 512, (4, 32)),)
    captured = capture(model, inputs)
    devices = Devices(world_size=8, memory_bytes=64 * MIB)
    plan, analysis = make_plan(captured, inputs, plan="replicate", devices=devices,
                               memory_limit_bytes=None, optimizer="adamw")
    return captured, inputs, analysis, devices


def uniform(analysis, captured, devices, name, batch=None):
    plan = resolve_plan(name, param_specs(captured), world_size=devices.world_size)
    return predict(analysis, plan, devices=devices, optimizer="adamw", batch_size=batch)


def test_search_beats_uniform_plans_that_fit(planned):
    captured, inputs, analysis, devices = planned
    ddp = uniform(analysis, captured, devices, "replicate")
    fsdp = uniform(analysis, captured, devices, "full_shard")
    limit = (ddp.peak_memory_bytes + fsdp.peak_memory_bytes) // 2
    limited = Devices(world_size=8, memory_bytes=limit)
    strategies = search_strategies(analysis, devices=limited, memory_limit_bytes=limit,
                                   optimizer="adamw")
    plan = predict(analysis, build_plan(strategies, param_specs(captured), world_size=8),
                   devices=limited, optimizer="adamw")
    assert plan.peak_memory_bytes <= limit < ddp.peak_memory_bytes
    assert plan.step_time_s <= fsdp.step_time_s * (1 + 1e-9)
    assert plan.counts()["replicate"] < len(plan.params)


def test_batch_size_search_picks_the_fastest_batch_that_fits(planned):
    captured, inputs, analysis, devices = planned
    limit = uniform(analysis, captured, devices, "full_shard", batch=16).peak_memory_bytes
    candidates = [1, 2, 4, 8, 16, 32, 64]
    limited = Devices(world_size=8, memory_bytes=limit)
    chosen, strategies = search_batch_size(analysis, candidates, devices=limited,
                                           memory_limit_bytes=limit, optimizer="adamw")
    plan = predict(analysis, build_plan(strategies, param_specs(captured), world_size=8),
                   devices=limited, optimizer="adamw", batch_size=chosen)
    assert plan.peak_memory_bytes <= limit
    best = plan.prediction.batch_size * 8 / plan.step_time_s
    for b in candidates:
        other = uniform(analysis, captured, devices, "full_shard", batch=b)
        if other.peak_memory_bytes <= limit:
            assert b * 8 / other.step_time_s <= best * (1 + 1e-9), (b, chosen)
    assert chosen in candidates
    # 64 does not fit even fully sharded, so it cannot have been chosen
    assert uniform(analysis, captured, devices, "full_shard", batch=64).peak_memory_bytes > limit
    assert chosen < 64


def test_nothing_fits_at_any_batch_size(planned):
    captured, inputs, _, _ = planned
    tiny = 64 * 1024
    with pytest.raises(PlanError, match="at any of the batch sizes"):
        make_plan(captured, inputs, plan=None, devices=Devices(world_size=8, memory_bytes=tiny),
                  memory_limit_bytes=tiny, optimizer="adamw", batch_sizes=[1, 2])


def test_predictions_are_functions_of_the_batch_size(planned):
    captured, _, analysis, devices = planned
    base = uniform(analysis, captured, devices, "shard_grad_op")
    for b in (1, 3, 4, 9):
        at_b = uniform(analysis, captured, devices, "shard_grad_op", batch=b)
        assert int(base.prediction.peak_memory_expr.subs(BATCH, b)) == at_b.peak_memory_bytes
        assert float(base.prediction.step_time_expr.subs(BATCH, b)) == pytest.approx(
            at_b.step_time_s)
    assert uniform(analysis, captured, devices, "shard_grad_op", batch=8).peak_memory_bytes > \
        base.peak_memory_bytes

"""The host lane of the step model ([Note: the host lane] in ``cost_models/step.py``): the
runtime's measured host time per parameter group, the optimizer's per-tensor time over sharded
parameters, and the step's critical path through the lanes, checked against figures worked by
hand."""

from __future__ import annotations

import dataclasses
import math

import pytest
import sympy
import torch

from osdp_fx import Devices
from osdp_fx.core.buckets import Schedule
from osdp_fx.core.setting import StepSetting
from osdp_fx.cost_models.step import StepTime, lanes_s, optimizer_time_s
from osdp_fx.errors import InputError
from osdp_fx.examples import MLP
from osdp_fx.passes.capture import capture
from osdp_fx.planner.make import plan_model

DEVICES = Devices(world_size=2, memory_bytes=2**30, compute_flops_per_s=1e9,
                  memory_bandwidth_bytes_per_s=1e10)


def _planned(plan: str, devices: Devices):
    torch.manual_seed(0)
    model, x = MLP((64, 128, 128, 64)), torch.randn(8, 64)
    return plan_model(capture(model, (x,)), (x,), plan, StepSetting(devices, optimizer="sgd"))


def test_one_lane_adds_every_host_second_and_two_lanes_take_the_longer() -> None:
    # the CPU: compute 3 + communication 2 + optimizer 1 + host 5
    assert lanes_s(3.0, 2.0, 1.0, 5.0, host_overlaps_device=False) == 11.0
    # a GPU: the host lane (5) outlasts the device's (3 + 2); the optimizer follows both
    assert lanes_s(3.0, 2.0, 1.0, 5.0, host_overlaps_device=True) == 6.0
    # ... and a device lane (3 + 2) that outlasts a short host lane (1)
    assert lanes_s(3.0, 2.0, 1.0, 1.0, host_overlaps_device=True) == 6.0
    assert lanes_s(3.0, 2.5, 1.0, 1.0, host_overlaps_device=True) == 6.5
    # the operators' dispatch (a GPU's profile) joins the host lane; on the CPU it is their
    # compute, counted once
    assert lanes_s(3.0, 2.0, 1.0, 1.0, dispatch_s=4.5, host_overlaps_device=True) == 6.5
    assert lanes_s(3.0, 2.0, 1.0, 1.0, dispatch_s=4.5, host_overlaps_device=False) == 7.0
    step = StepTime(compute_s=3.0, comm_s=2.0, optim_s=1.0, step_time_expr=sympy.Float(0),
                    host_s=1.0, dispatch_s=4.5, host_overlaps_device=True)
    assert step.step_s == 6.5  # host-bound: dispatch 4.5 + runtime 1 > compute 3 + comm 2
    assert step.at_scale(2.0) == 9.0  # device-bound at twice the batch: 6 + 2 + optimizer 1
    b = sympy.Symbol("b", positive=True)
    expr = lanes_s(3 * b, sympy.Float(2), sympy.Float(1), sympy.Float(5), host_overlaps_device=True)
    assert float(expr.subs(b, 1)) == 6.0  # host-bound at a small batch
    assert float(expr.subs(b, 4)) == 15.0  # device-bound at a large one


def test_the_optimizer_over_sharded_parameters_takes_its_own_per_tensor_time() -> None:
    devices = Devices(optimizer_element_time_s={"sgd": 1e-9},
                      optimizer_tensor_time_s={"sgd": 2e-6},
                      optimizer_sharded_tensor_time_s={"sgd": 30e-6})
    assert optimizer_time_s("sgd", 1000, devices) == pytest.approx(2e-6 + 1e-6)
    assert optimizer_time_s("sgd", 1000, devices, sharded=True) == pytest.approx(30e-6 + 1e-6)
    # a kind not measured over sharded parameters keeps the plain per-tensor time
    plain = Devices(optimizer_element_time_s={"sgd": 1e-9}, optimizer_tensor_time_s={"sgd": 2e-6})
    assert optimizer_time_s("sgd", 1000, plain, sharded=True) == pytest.approx(3e-6)


def test_replicated_groups_among_sharded_ones_step_at_the_dtensor_rate(tmp_path) -> None:
    """Where a plan shards a group, the optimizer steps each replicated group as a
    ``Replicate()`` DTensor: at ``optimizer_sharded_tensor_time_s``, where a plan replicating
    every group steps plain tensors at ``optimizer_tensor_time_s``."""
    plain, dtensor = 2e-6, 30e-6
    devices = Devices(**_fields(DEVICES), optimizer_tensor_time_s={"sgd": plain},
                      optimizer_sharded_tensor_time_s={"sgd": dtensor})
    mixed = tmp_path / "mixed.json"
    mixed.write_text('{"format": "osdp-fx-plan", "version": 1, "default": "replicate", '
                     '"params": {"layers.0.weight": "full_shard"}}')
    base = _planned("replicate", DEVICES).plan.prediction
    everything = _planned("replicate", devices).plan.prediction
    assert everything.optim_s == pytest.approx(base.optim_s + 6 * plain)
    reference = _planned(str(mixed), DEVICES).plan.prediction
    one_sharded = _planned(str(mixed), devices).plan.prediction
    # all six groups, the five replicated among them, at the DTensor rate
    assert one_sharded.optim_s == pytest.approx(reference.optim_s + 6 * dtensor)


def test_replicated_groups_among_sharded_ones_pay_the_replicas_host_time(tmp_path) -> None:
    """Where a plan shards a group, each replicated group is a ``Replicate()`` DTensor read as
    a leaf, and pays ``replica_host_time_s`` beyond its strategy's host time; where it
    replicates every group, none does."""
    extra = 50e-6
    devices = Devices(**_fields(DEVICES), replica_host_time_s=extra)
    mixed = tmp_path / "mixed.json"
    mixed.write_text('{"format": "osdp-fx-plan", "version": 1, "default": "replicate", '
                     '"params": {"layers.0.weight": "full_shard"}}')
    assert (_planned("replicate", devices).plan.prediction.host_s
            == _planned("replicate", DEVICES).plan.prediction.host_s)
    reference = _planned(str(mixed), DEVICES).plan
    one_sharded = _planned(str(mixed), devices).plan
    # the five replicated groups, not the sharded one
    assert one_sharded.prediction.host_s == pytest.approx(reference.prediction.host_s
                                                          + 5 * extra)
    assert one_sharded.step_time_s == pytest.approx(reference.step_time_s + 5 * extra)


@pytest.mark.parametrize("strategy", ["replicate", "shard_grad_op", "full_shard"])
def test_each_group_pays_its_strategys_host_time_once_per_step(strategy: str) -> None:
    base = _planned(strategy, DEVICES).plan
    per_group = {"replicate": 1e-4, "shard_grad_op": 2e-4, "full_shard": 3e-4}
    host = _planned(strategy, Devices(**{**_fields(DEVICES),
                                         "param_host_time_s": per_group})).plan
    groups = len(base.params)
    assert groups == 6  # three linears, weight and bias
    assert host.prediction.host_s == pytest.approx(groups * per_group[strategy])
    # one lane: the step grows by exactly that, nothing else changes
    assert host.step_time_s == pytest.approx(base.step_time_s + groups * per_group[strategy])
    assert host.prediction.compute_s == pytest.approx(base.prediction.compute_s)
    assert host.prediction.comm_s == pytest.approx(base.prediction.comm_s)
    assert host.peak_memory_bytes == base.peak_memory_bytes


def test_a_gather_bucket_pays_its_host_time_once() -> None:
    """In gather buckets of 1 MiB the MLP's 6 groups (130 KiB) are one bucket: its first member
    pays the bucket's host time, the other 5 ride in it; a figure for another strategy is not
    charged."""
    plan = dataclasses.replace(_planned("full_shard", DEVICES).plan,
                               schedule=Schedule(gather_bucket_bytes=2**20))

    def planned(devices: Devices):
        torch.manual_seed(0)
        model, x = MLP((64, 128, 128, 64)), torch.randn(8, 64)
        return plan_model(capture(model, (x,)), (x,), plan,
                          StepSetting(devices, optimizer="sgd")).plan

    base = planned(DEVICES)
    host = planned(Devices(**_fields(DEVICES), bucket_host_time_s={"full_shard": 1e-3}))
    assert host.prediction.host_s == pytest.approx(base.prediction.host_s + 1e-3)
    assert host.step_time_s == pytest.approx(base.step_time_s + 1e-3)
    assert host.prediction.comm_s == pytest.approx(base.prediction.comm_s)
    other = planned(Devices(**_fields(DEVICES), bucket_host_time_s={"shard_grad_op": 1.0}))
    assert other.step_time_s == pytest.approx(base.step_time_s)


def test_a_host_lane_beside_the_device_counts_only_where_it_is_the_longer() -> None:
    fields = _fields(DEVICES)
    base = _planned("full_shard", Devices(**fields, host_overlaps_device=True)).plan.prediction
    device_lane = base.compute_s + base.comm_s
    short = _planned("full_shard", Devices(**fields, host_overlaps_device=True,
                                           param_host_time_s={"full_shard": 1e-9})).plan
    assert short.step_time_s == pytest.approx(base.step_time_s)  # hidden behind the device
    long = _planned("full_shard", Devices(**fields, host_overlaps_device=True,
                                          param_host_time_s={"full_shard": 1.0})).plan
    assert long.prediction.host_s == pytest.approx(6.0)
    assert long.step_time_s == pytest.approx(6.0 + base.optim_s)  # the host lane is the step
    assert long.step_time_s > device_lane + base.optim_s


def test_host_figures_are_checked() -> None:
    with pytest.raises(InputError, match="param_host_time_s.*strategies"):
        Devices(param_host_time_s={"fsdp": 1e-4})
    with pytest.raises(InputError, match="bucket_host_time_s.*strategies"):
        Devices(bucket_host_time_s={"zero3": 1e-4})
    with pytest.raises(InputError, match="optimizer_sharded_tensor_time_s"):
        Devices(optimizer_sharded_tensor_time_s={"sgd": -1.0})
    with pytest.raises(InputError, match="host_overlaps_device"):
        Devices(host_overlaps_device="yes")  # type: ignore[arg-type]
    assert Devices(param_host_time_s={"full_shard": 1e-4}).figures == "given"


def test_detect_devices_measures_the_host_figures_in_one_process() -> None:
    from osdp_fx import detect_devices

    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    devices = detect_devices()
    assert torch.equal(torch.rand(3), expected)  # the caller's random stream is untouched
    assert set(devices.param_host_time_s) == {"replicate", "shard_grad_op", "full_shard",
                                              "hybrid_shard", "hierarchical"}
    assert all(0 <= t < 0.1 and math.isfinite(t) for t in devices.param_host_time_s.values())
    # per gather bucket: the sharded strategies' (one process: its collectives are copies)
    assert set(devices.bucket_host_time_s) == {"shard_grad_op", "full_shard", "hybrid_shard",
                                               "hierarchical"}
    assert all(0 <= t < 0.1 and math.isfinite(t) for t in devices.bucket_host_time_s.values())
    assert set(devices.optimizer_sharded_tensor_time_s) == {"sgd", "sgd_momentum", "adam",
                                                            "adamw"}
    # one rank shards nothing: no replicas among sharded groups, no ranks to wait for
    assert devices.replica_host_time_s == 0.0 and devices.sync_wait_s == 0.0
    assert devices.host_overlaps_device is False  # this CPU


def _fields(devices: Devices) -> dict:
    return {"world_size": devices.world_size, "memory_bytes": devices.memory_bytes,
            "compute_flops_per_s": devices.compute_flops_per_s,
            "memory_bandwidth_bytes_per_s": devices.memory_bandwidth_bytes_per_s}


def test_a_plan_charges_each_split_part_its_share_of_joining_the_gradient(tmp_path) -> None:
    """In one process the replicated plan has no communication; split in two, every part of
    the weight and of its bias pays ``SPLIT_GRADIENT_PASSES`` bytes of memory traffic per
    byte of its gradient (``step.split_gradient_s``), and the plan's step that much more."""
    import json

    from osdp_fx.cost_models.step import SPLIT_GRADIENT_PASSES

    devices = dataclasses.replace(DEVICES, world_size=1)
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": "replicate",
                                "splits": {"layers.1.weight": 2}, "params": {}}))
    whole, split = (_planned(plan, devices).plan for plan in ("replicate", str(path)))
    assert whole.prediction.comm_s == 0.0
    joined = (128 * 128 + 128) * 4  # the weight's and the bias's gradients, float32
    assert split.prediction.comm_s == pytest.approx(
        SPLIT_GRADIENT_PASSES * joined / devices.memory_bandwidth_bytes_per_s, rel=1e-9)
    parts = [p for p in split.params if "_part" in p.name]
    assert len(parts) == 4 and all(p.comm_s > 0 for p in parts)

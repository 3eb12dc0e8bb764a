"""Compute cost model: measured times where profiled, roofline where not."""

from __future__ import annotations

import dataclasses

import pytest

from osdp_fx.core.devices import Devices
from osdp_fx.cost_models.compute import (
    backward_bytes,
    forward_bytes,
    node_compute_time_s,
    roofline_time_s,
    total_compute_time_s,
)
from osdp_fx.errors import InputError
from osdp_fx.passes.profile import NodeProfile

DEVICES = Devices(compute_flops_per_s=1e12, memory_bandwidth_bytes_per_s=1e11)
LINEAR = NodeProfile(fwd_flops=2 * 10**9, bwd_flops=4 * 10**9, input_bytes=10**6,
                     output_bytes=2 * 10**6, output_is_view=False, saved_bytes=10**6,
                     saved_inputs=("x",), grad_input_bytes=10**6, param_bytes=0,
                     fwd_time_s=None, bwd_time_s=None)


def test_roofline_adds_arithmetic_and_memory_traffic() -> None:
    assert roofline_time_s(1e12, 1e3, DEVICES) == pytest.approx(1.0)  # far from the ridge
    assert roofline_time_s(1e3, 1e11, DEVICES) == pytest.approx(1.0)
    # at the ridge point (10 FLOPs per byte here) each term is 1 s: the operator takes 2
    assert roofline_time_s(1e12, 1e11, DEVICES) == pytest.approx(2.0)


def test_unmeasured_node_uses_roofline() -> None:
    t = node_compute_time_s(LINEAR, DEVICES)
    assert not t.measured
    assert t.fwd_s == pytest.approx(2e9 / 1e12 + 3e6 / 1e11)  # arithmetic + traffic
    assert t.bwd_s == pytest.approx(4e9 / 1e12 + 4e6 / 1e11)
    assert forward_bytes(LINEAR) == 3 * 10**6
    assert backward_bytes(LINEAR) == 4 * 10**6
    relu = dataclasses.replace(LINEAR, fwd_flops=0, bwd_flops=0)
    assert node_compute_time_s(relu, DEVICES).fwd_s == pytest.approx(3e6 / 1e11)


def test_measured_node_uses_measurement() -> None:
    measured = dataclasses.replace(LINEAR, fwd_time_s=0.25, bwd_time_s=0.5)
    t = node_compute_time_s(measured, DEVICES)
    assert (t.fwd_s, t.bwd_s, t.measured, t.step_s) == (0.25, 0.5, True, 0.75)


def test_views_cost_nothing() -> None:
    view = NodeProfile.zero(output_bytes=10**6, output_is_view=True, timed=False)
    assert node_compute_time_s(view, DEVICES).step_s == 0.0


def test_total_sums_nodes() -> None:
    measured = dataclasses.replace(LINEAR, fwd_time_s=0.25, bwd_time_s=0.5)
    total = total_compute_time_s([LINEAR, measured], DEVICES)
    assert total.fwd_s == pytest.approx(0.25 + 2e-3 + 3e-5)
    assert not total.measured


def test_missing_profile_and_bad_devices_are_user_errors() -> None:
    with pytest.raises(InputError, match="profile_graph_pass"):
        node_compute_time_s(None, DEVICES)
    with pytest.raises(InputError, match="compute_flops_per_s"):
        roofline_time_s(1.0, 1.0, Devices(compute_flops_per_s=0.0))


def test_optimizer_time_uses_measured_figures_else_the_memory_bound() -> None:
    from osdp_fx.cost_models.step import OPTIMIZER_BYTES_PER_ELEMENT, optimizer_time_s

    plain = Devices(memory_bandwidth_bytes_per_s=1e10)
    assert optimizer_time_s("adamw", 10**6, plain) == pytest.approx(
        OPTIMIZER_BYTES_PER_ELEMENT["adamw"] * 10**6 / 1e10)
    measured = Devices(memory_bandwidth_bytes_per_s=1e10,
                       optimizer_element_time_s={"adamw": 4e-9},
                       optimizer_tensor_time_s={"adamw": 25e-6})
    assert optimizer_time_s("adamw", 10**6, measured) == pytest.approx(25e-6 + 4e-3)
    # a kind without measurements keeps the memory-bound model and no per-tensor time
    assert optimizer_time_s("sgd", 10**6, measured) == optimizer_time_s("sgd", 10**6, plain)


def test_a_fused_attention_node_is_estimated_at_its_share_of_the_matmul_rate() -> None:
    attention = dataclasses.replace(LINEAR, attention=True)
    devices = dataclasses.replace(DEVICES, attention_efficiency=0.25)
    t = node_compute_time_s(attention, devices)
    assert t.fwd_s == pytest.approx(2e9 / (0.25 * 1e12) + 3e6 / 1e11)
    assert t.bwd_s == pytest.approx(4e9 / (0.25 * 1e12) + 4e6 / 1e11)
    # other operators, and measured attention, are unchanged
    assert node_compute_time_s(LINEAR, devices).fwd_s == pytest.approx(2e9 / 1e12 + 3e6 / 1e11)
    measured = dataclasses.replace(attention, fwd_time_s=0.25, bwd_time_s=0.5)
    assert node_compute_time_s(measured, devices).step_s == 0.75
    with pytest.raises(InputError, match="attention_efficiency"):
        Devices(attention_efficiency=0.0)
    assert Devices.preset("h100-sxm-8x").attention_efficiency < 1.0


def test_the_profile_marks_fused_attention() -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from osdp_fx.core.node_meta import osdp_meta
    from osdp_fx.passes.capture import capture
    from osdp_fx.passes.profile import profile_graph_pass

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).unbind(2)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    x = torch.randn(2, 8, 16)
    gm = capture(Attend(), (x,)).gm
    profile_graph_pass(gm, (x,))
    marked = {n.name for n in gm.graph.nodes if osdp_meta(n).profile.attention}
    assert len(marked) == 1 and "scaled_dot_product" in next(iter(marked))

"""The memory plot: drawn from a plan's predicted timeline, refused for a plan without one."""

from __future__ import annotations

import pytest
import torch

from osdp_fx import Devices
from osdp_fx.core.setting import StepSetting
from osdp_fx.errors import InputError
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.passes.capture import capture
from osdp_fx.plan.plot import plot_memory_timeline
from osdp_fx.plan.request import resolve_plan
from osdp_fx.planner.make import SearchOptions, plan_model

pytest.importorskip("matplotlib")


def test_plot_of_a_planned_model_and_its_categories(tmp_path):
    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=64, dim=32, depth=2, heads=2, max_seq=16))
    x = torch.randint(0, 64, (2, 16))
    captured = capture(model, (x,))
    plan = plan_model(captured, (x,), "full_shard",
                      StepSetting(Devices(world_size=4, memory_bytes=2**30), optimizer="adamw"),
                      SearchOptions(fake=True)).plan
    pr = plan.prediction
    # the peak's categories add up to the peak, and every point of the timeline is at most it
    assert sum(b for _, b in pr.peak_by_category) == pr.peak_memory_bytes
    assert max(p.total_bytes for p in pr.memory_timeline) == pr.peak_memory_bytes
    assert pr.first_step_peak_bytes < pr.peak_memory_bytes  # no optimizer state yet
    assert "peak memory by category: " in str(plan)
    path = plot_memory_timeline(plan, tmp_path / "memory.png")
    with open(path, "rb") as f:
        assert f.read(4) == b"\x89PNG"


def test_a_plan_without_prediction_is_refused(tmp_path):
    plan = resolve_plan("replicate", [], world_size=2)
    with pytest.raises(InputError, match="no predicted memory timeline"):
        plot_memory_timeline(plan, tmp_path / "x.png")

"""The exact search (``planner/exhaustive.py``) on spaces of many dimensions."""

from __future__ import annotations

import torch

from osdp_fx.core.buckets import Schedule
from osdp_fx.core.devices import Devices
from osdp_fx.core.setting import StepSetting
from osdp_fx.core.strategies import REPLICATE
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.passes.capture import capture
from osdp_fx.planner.analysis import analyze
from osdp_fx.planner.exhaustive import _unravel
from osdp_fx.planner.search import search_plan


def test_unravel_matches_numpy_and_goes_past_64_dimensions():
    import numpy as np

    shape = [3, 1, 2, 4]
    for flat in range(24):
        assert _unravel(flat, shape) == [int(i) for i in np.unravel_index(flat, shape)]
    assert _unravel(5, [1] * 100 + [3, 2]) == [0] * 100 + [2, 1]


def test_search_at_world_one_with_more_than_64_groups():
    """At world 1 every group has one option (replicate) and the space one combination, over
    a dimension per group: 76 groups here (a Hugging Face Llama of 8 layers has 139)."""
    torch.manual_seed(0)
    net = GPTWithLoss(TinyGPT(vocab=64, dim=16, depth=6, heads=2, max_seq=8))
    x = torch.randint(0, 64, (2, 8))
    analysis = analyze(capture(net, (x,)), (x,), fake=True)
    assert len(analysis.captured.params) > 64
    found = search_plan(analysis, StepSetting(Devices(world_size=1), optimizer="adamw",
                                              schedule=Schedule()), 2**30)
    assert set(found.strategies.values()) == {REPLICATE}

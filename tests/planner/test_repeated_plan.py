"""Issue 40's check: a plan searched on the profile that repeated blocks share ([Note: repeated
blocks] in ``passes/repeated.py``) is the plan searched on a profile of every block run."""

from __future__ import annotations

import pytest
import torch

from osdp_fx.core.buckets import DEFAULT_SCHEDULE
from osdp_fx.core.devices import Devices
from osdp_fx.core.node_meta import osdp_meta
from osdp_fx.core.setting import StepSetting
from osdp_fx.passes.capture import capture
from osdp_fx.plan.request import build_plan
from osdp_fx.planner.analysis import analyze, param_specs
from osdp_fx.planner.search import plan_peak_bytes, search_schedules


def test_the_plan_is_that_of_profiling_every_block():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=128, n_layer=6, n_head=4, vocab_size=512,
                                     n_positions=128, use_cache=False, bos_token_id=0,
                                     eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    inputs = (torch.randint(0, 512, (4, 64), device="meta"),)
    devices = Devices.preset("h100-sxm-8x", world_size=16, memory_limit="1GiB")
    setting = StepSetting(devices, optimizer="adamw", grad_accumulation=1,
                          schedule=DEFAULT_SCHEDULE)
    plans, profiles = [], []
    for share in (True, False):
        captured = capture(model, inputs)
        analysis = analyze(captured, inputs, fake=True, share_repeats=share)
        profiles.append({n.name: osdp_meta(n).profile for n in captured.gm.graph.nodes})
        # a limit between the all-sharded and the replicated plan's needs: a mixed plan
        low, high = (plan_peak_bytes(analysis, dict.fromkeys(captured.params, s), {}, setting)
                     for s in ("full_shard", "replicate"))
        limit = low + (high - low) // 4
        found = search_schedules(analysis, setting, limit)[0]
        plans.append(build_plan(found.found.strategies, param_specs(captured), world_size=16,
                                memory_limit_bytes=limit, source="search",
                                schedule=found.schedule, recompute=found.found.recompute))
    assert profiles[0] == profiles[1]
    assert len({p.strategy for p in plans[0].params}) > 1 or plans[0].recompute, plans[0].counts()
    assert plans[0].hash() == plans[1].hash()

"""Hypothesis: the joint search of strategies and recomputation (``search.search_plan``) against
brute force on small instances.

Draws a tiny TinyGPT (1-3 blocks, so 1-3 regions) with 1-3 trainable weight matrices (the
other parameters frozen and fixed replicated, ``search_plan(fixed=...)``, so they have one
option), and a memory limit between the
least and the largest predicted peak of any plan; profiles it fake (``analyze(fake=True)``: no
operator runs). Brute force scores every combination (a strategy per trainable group x a policy
per region, at most 3^3 x 3^3) with the models the search answers to: the timeline's peak
(``cost_models.timeline.predict_step_memory``) and the step time
(``cost_models.step.predict_step_time``), under the default schedule, with the link running
collectives one at a time or side by side (``Devices.concurrent_collective_ratio`` 1 or 0.75,
or by size: ``Devices.concurrent_collective_ratios``, small ones one at a time, 1 MiB at 0.6),
and hiding collectives under computation saving half of their time, none, or, as measured on
a CPU, 0.3 of their time beyond their latencies (``Devices.overlap_efficiency`` 0.5, 0 or 0.3
with ``overlap_hides_latency`` False).
Asserted:

* the exact search's lower bounds (``exhaustive.step_time_bounds``, ``peak_floor_bytes``) are
  below every combination's step time and peak;
* the searched plan fits the plannable share of the limit (``analysis.plannable_bytes``), and
  the search raises only when no combination fits;
* no fitting combination is predicted faster than the searched plan: the search is exact on
  these instances (``planner/exhaustive.py``: spaces of at most ``EXACT_COMBINATIONS`` combinations).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from osdp_fx.core.buckets import Schedule
from osdp_fx.core.devices import Devices
from osdp_fx.core.regions import POLICIES, find_regions
from osdp_fx.core.setting import StepSetting
from osdp_fx.core.strategies import FULL_SHARD, REPLICATE, SHARD_GRAD_OP
from osdp_fx.cost_models.recompute import region_costs
from osdp_fx.cost_models.step import predict_step_time
from osdp_fx.cost_models.timeline import predict_step_memory
from osdp_fx.errors import PlanError
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.passes.capture import capture
from osdp_fx.planner.analysis import analyze, param_states, plannable_bytes
from osdp_fx.planner.exhaustive import peak_floor_bytes, step_time_bounds
from osdp_fx.planner.search import search_plan

OPTIMIZER = "adamw"
SCHEDULE = Schedule()
MATRICES = ("qkv.weight", "proj.weight", "fc.weight", "out.weight")


@st.composite
def instances(draw: st.DrawFn) -> tuple[int, int, int, list[str]]:
    depth = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([16, 32, 48]))
    seq = draw(st.sampled_from([8, 16, 32]))
    names = [f"model.blocks.{b}.{m}" for b in range(depth) for m in MATRICES]
    trainable = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    return depth, dim, seq, trainable


def _analysis(depth: int, dim: int, seq: int, trainable: list[str]):
    torch.manual_seed(0)
    net = GPTWithLoss(TinyGPT(vocab=64, dim=dim, depth=depth, heads=2, max_seq=seq))
    for name, p in net.named_parameters():
        p.requires_grad_(name in trainable)
    x = torch.randint(0, 64, (2, seq))
    return analyze(capture(net, (x,)), (x,), fake=True)


BY_SIZE = {"total_bytes": [2**12, 2**20], "ratios": [1.0, 0.6]}
"""Ratios of collectives together by size: small ones one at a time, 1 MiB at 0.6."""


def _setting(ratio: float | str, overlap: tuple[float, bool]) -> StepSetting:
    together = ({"concurrent_collective_ratio": 0.8, "concurrent_collective_ratios": BY_SIZE}
                if ratio == "by size" else {"concurrent_collective_ratio": ratio})
    return StepSetting(Devices(world_size=2, **together, overlap_efficiency=overlap[0],
                               overlap_hides_latency=overlap[1]),
                       optimizer=OPTIMIZER, schedule=SCHEDULE)


def _scores(analysis, setting):
    """(peak bytes, step seconds, strategies, recompute) of every combination."""
    groups = [n for n, p in analysis.captured.params.items() if p.trainable]
    regions = list(find_regions(analysis.captured.gm.graph))
    out = []
    for strategies in itertools.product((REPLICATE, SHARD_GRAD_OP, FULL_SHARD),
                                        repeat=len(groups)):
        chosen = {n: REPLICATE for n in analysis.captured.params} | dict(zip(groups, strategies))
        states = param_states(analysis, chosen)
        for policies in itertools.product([str(p) for p in POLICIES], repeat=len(regions)):
            recompute = {r: p for r, p in zip(regions, policies) if p != "save"}
            peak = predict_step_memory(
                analysis.captured.gm, states, setting=setting,
                profiled_batch=analysis.batch_size, recompute=recompute).peak_bytes
            step, _ = predict_step_time(analysis.captured.gm, states, analysis.facts,
                                        setting=setting, profiled_batch=analysis.batch_size,
                                        recompute=recompute)
            out.append((peak, step.step_s, chosen, recompute))
    return out


@seed(16)
@settings(max_examples=15, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=instances(), share=st.floats(0.0, 1.0),
       ratio=st.sampled_from([1.0, 0.75, "by size"]),
       overlap=st.sampled_from([(0.5, True), (0.0, True), (0.3, False)]))
def test_joint_search_equals_brute_force(case, share, ratio, overlap):
    analysis = _analysis(*case)
    setting = _setting(ratio, overlap)
    scores = _scores(analysis, setting)
    _check_bounds(analysis, case[3], scores, setting)
    low, high = min(s[0] for s in scores), max(s[0] for s in scores)
    limit = int((low + share * (high - low)) / (1 - 0.03)) + 1
    fitting = [s for s in scores if s[0] <= plannable_bytes(limit)]
    try:
        found = search_plan(analysis, setting, limit, fixed={
            n: REPLICATE for n, p in analysis.captured.params.items() if not p.trainable})
        strategies, recompute = found.strategies, found.recompute
    except PlanError:
        assert not fitting, (min(fitting, key=lambda s: s[1])[:2], limit)
        return
    found = next(s for s in scores if s[2] == strategies and s[3] == recompute)
    assert found[0] <= plannable_bytes(limit), (found, limit)
    best = min(fitting, key=lambda s: s[1])
    assert found[1] <= best[1] * (1 + 1e-9), (found, best, limit)


def _check_bounds(analysis, groups, scores, setting):
    """Every combination's step time and peak are at least the exact search's lower bounds."""
    options = {n: [REPLICATE, SHARD_GRAD_OP, FULL_SHARD] if n in groups else [REPLICATE]
               for n in analysis.captured.params}
    regions = region_costs(analysis.facts, setting.devices)
    bounds = step_time_bounds(analysis, options, regions, setting, scale=1.0)
    floors = peak_floor_bytes(analysis, options, regions, setting)
    shape = [len(o) for o in options.values()] + [len(o) for o in regions.values()]
    for peak, seconds, strategies, recompute in scores:
        index = [options[n].index(strategies[n]) for n in options] + [
            [o.policy for o in opts].index(recompute.get(r, "save"))
            for r, opts in regions.items()]
        bound = bounds[np.ravel_multi_index(index, shape)]
        assert bound <= seconds * (1 + 1e-9), (strategies, recompute, bound, seconds)
        floor = floors[np.ravel_multi_index(index, shape)]
        assert floor <= peak, (strategies, recompute, floor, peak)

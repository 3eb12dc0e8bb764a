"""Hypothesis: the joint search of strategies and recomputation (``search.search_plan``) against
brute force on small instances.

Draws a tiny TinyGPT (1-3 blocks, so 1-3 regions) with 1-3 trainable weight matrices (the
other parameters frozen, so they have one option, replicate), and a memory limit between the
least and the largest predicted peak of any plan; profiles it fake (``analyze(fake=True)``: no
operator runs). Brute force scores every combination (a strategy per trainable group x a policy
per region, at most 3^3 x 3^3) with the models the search answers to: the timeline's peak
(``cost_models.timeline.predict_step_memory``) and the step time
(``cost_models.step.predict_step_time``), under the default schedule. Asserted:

* the searched plan fits the plannable share of the limit (``analysis.plannable_bytes``);
* when the most frugal plan (every group full_shard, every region ``full``) fits, the search
  finds a plan;
* no fitting combination is predicted faster than the searched plan by more than
  ``SLOWDOWN``.

The search is **not exact** against brute force, and these are the reasons (measured over 150
instances, 5 limits each of 30 models, in ``docs/recomputation.md``: 35 exact, most within 10 %,
the worst 2.58x; 14 limits where only a plan other than the most frugal one fits, the search
raised): it optimises a separable model (each row's time, persistent and transient bytes,
``solver.py``) while the step time is not separable (a replicated gradient's share of its
all-reduce bucket's latency assumes a full bucket; prefetching's overlap credit depends on
neighbouring groups), and its base memory is the most frugal plan's peak, which on models this
small is not the least (full recomputation and full_shard's gathered copies can cost more than
they save); when the timeline and the separable model disagree the limit is tightened, and
after 8 tightenings the search returns the most frugal plan.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from osdp_fx.analysis import analyze, param_states, plannable_bytes
from osdp_fx.buckets import Schedule
from osdp_fx.capture import capture
from osdp_fx.cost_models.step import predict_step_time
from osdp_fx.cost_models.timeline import predict_step_memory
from osdp_fx.devices import Devices
from osdp_fx.errors import PlanError
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.regions import POLICIES, find_regions
from osdp_fx.schedule import schedule_memory_kwargs
from osdp_fx.search import search_plan
from osdp_fx.strategies import FULL_SHARD, REPLICATE, SHARD_GRAD_OP

SLOWDOWN = 3.0
"""How many times the brute-force best's predicted step time the searched plan's may be (the
worst measured: 2.58)."""
OPTIMIZER = "adamw"
DEVICES = Devices(world_size=2)
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


def _scores(analysis):
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
                analysis.captured.gm, states, world_size=DEVICES.world_size, optimizer=OPTIMIZER,
                profiled_batch=analysis.batch_size, recompute=recompute,
                **schedule_memory_kwargs(SCHEDULE)).peak_bytes
            step, _ = predict_step_time(analysis.captured.gm, states, analysis.facts,
                                        devices=DEVICES, optimizer=OPTIMIZER,
                                        profiled_batch=analysis.batch_size, recompute=recompute,
                                        schedule=SCHEDULE)
            out.append((peak, step.step_s, chosen, recompute))
    return out


@seed(16)
@settings(max_examples=15, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=instances(), share=st.floats(0.0, 1.0))
def test_joint_search_equals_brute_force(case, share):
    analysis = _analysis(*case)
    scores = _scores(analysis)
    low, high = min(s[0] for s in scores), max(s[0] for s in scores)
    limit = int((low + share * (high - low)) / (1 - 0.03)) + 1
    fitting = [s for s in scores if s[0] <= plannable_bytes(limit)]
    frugal = next(s for s in scores if len(s[3]) == case[0] and set(s[3].values()) == {"full"}
                  and all(s[2][n] == FULL_SHARD for n in case[3]))
    try:
        strategies, recompute = search_plan(analysis, devices=DEVICES, memory_limit_bytes=limit,
                                            optimizer=OPTIMIZER, schedule=SCHEDULE)
    except PlanError:
        assert frugal[0] > plannable_bytes(limit), (frugal[:2], limit)
        return
    found = next(s for s in scores if s[2] == strategies and s[3] == recompute)
    assert found[0] <= plannable_bytes(limit), (found, limit)
    best = min(fitting, key=lambda s: s[1])
    assert found[1] <= best[1] * SLOWDOWN, (found, best, limit)

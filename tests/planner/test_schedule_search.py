"""The schedule (prefetch distance, gather and all-reduce bucket sizes): searched with the plan,
its memory charged, its overlap credited, recorded in the plan file and honoured by the
runtime."""

from __future__ import annotations

import copy
import dataclasses
import json
import random

import pytest
import torch
from torch import nn

from osdp_fx import Devices, compile_osdp
from osdp_fx.core.buckets import (
    DEFAULT_BUCKET_BYTES,
    SMALL_PARAM_BYTES,
    Schedule,
    block_of,
    candidate_schedules,
)
from osdp_fx.cost_models.graph_facts import (
    ParamState,
    regathered_together,
    sharded_gather_buckets,
)
from osdp_fx.core.setting import StepSetting
from osdp_fx.cost_models.communication import collective_time_s
from osdp_fx.cost_models.overlap import (
    GatherWindow,
    TimedGather,
    TimedReduce,
    exposed_backward_s,
    exposed_gather_s,
    gather_s,
    hidden_share_s,
    timed_gathers,
)
from osdp_fx.cost_models.step import bucket_copy_s, scatter_input_copy_s
from osdp_fx.errors import PlanError
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.passes.capture import capture
from osdp_fx.plan.request import build_plan
from osdp_fx.planner.make import (
    SearchOptions,
    analyze,
    param_specs,
    param_states,
    plan_model,
    predict,
)
from osdp_fx.planner.schedule_search import rank_schedules
from osdp_fx.planner.search import block_gather_bytes, search_schedules


def _replay_step_by_step(compute_s, gathers):
    """The two-lane replay written step by step: every step's computation added to the clock
    in turn, the gathers used and issued at it handled before."""
    used, issued = {}, {}
    for i, (issue, use, _) in enumerate(gathers):
        used.setdefault(use, []).append(i)
        issued.setdefault(issue, []).append(i)
    done, now, link_free, waited = {}, 0.0, 0.0, 0.0
    for step, seconds in enumerate(compute_s):
        for group, wait in ((used.get(step, []), True), (issued.get(step, []), False)):
            for i in group:
                if i not in done:
                    link_free = done[i] = max(now, link_free) + gathers[i][2]
                if wait and done[i] > now:
                    waited += done[i] - now
                    now = done[i]
        now += seconds
    return waited


def _random_lane(rnd: random.Random, steps: int, gathers: int):
    """A lane of up to ``steps`` computation steps and up to ``gathers`` (issued at, used at,
    seconds) gathers in issue order, some used past the last step (never waited for)."""
    n = rnd.randint(0, steps)
    compute = [rnd.random() * 1e-3 for _ in range(n)]
    timed = []
    for _ in range(rnd.randint(0, gathers)):
        use = rnd.randint(0, n + 2)
        timed.append((rnd.randint(0, use), use, rnd.random() * 2e-3))
    timed.sort(key=lambda g: (g[0], g[1]))
    return compute, timed


def test_exposed_gather_time_equals_the_step_by_step_replay_to_the_bit():
    rnd = random.Random(0)
    for _ in range(500):
        compute, gathers = _random_lane(rnd, 40, 12)
        assert exposed_gather_s(compute, _timed(gathers)) == _replay_step_by_step(compute,
                                                                                  gathers)


def _timed(gathers):
    """(issued at, used at, seconds) triples as the replay's records."""
    return [TimedGather(*g) for g in gathers]


def test_exposed_gather_time_of_a_two_lane_replay():
    compute = [1.0, 1.0, 1.0]
    # at its use: the computation waits for all of each gather
    assert exposed_gather_s(compute, _timed([(0, 0, 0.5), (1, 1, 0.5), (2, 2, 0.5)])) == 1.5
    # started one step ahead: the first waits, the others hide under a step of compute
    assert exposed_gather_s(compute, _timed([(0, 0, 0.5), (0, 1, 0.5), (1, 2, 0.5)])) == 0.5
    # a gather longer than the compute in between is hidden only in part
    assert exposed_gather_s(compute, _timed([(0, 0, 0.5), (0, 1, 2.0)])) == 0.5 + 1.0
    # one link: two gathers started together run one after the other
    assert exposed_gather_s(compute, _timed([(0, 0, 0.5), (0, 2, 1.5), (0, 2, 1.5)])) == 0.5 + 1.0


def test_backward_waits_for_its_gradient_collectives_by_hand():
    """Backward's lane with gradient collectives (``overlap.exposed_backward_s``): a collective
    starts after the computation of its step once the link is free; starting one more of a
    kind than ``in_flight`` first waits for the oldest; backward ends when all have completed."""
    compute = [1.0, 1.0, 1.0]

    def rs(ready_at, seconds, kind="reduce_scatter"):
        return TimedReduce(ready_at, seconds, kind)

    # the last step's collective runs after all computation: all of it is waited for
    assert exposed_backward_s(compute, [], [rs(2, 0.5)], in_flight=2) == 0.5
    # one after the first step hides under the two steps after it, up to their 2 s
    assert exposed_backward_s(compute, [], [rs(0, 1.5)], in_flight=2) == 0.0
    assert exposed_backward_s(compute, [], [rs(0, 2.5)], in_flight=2) == 0.5
    # one link: two started after the first step run one after the other (1.5 + 1.5 from
    # t = 1, done at t = 4, one second after the computation ends at t = 3)
    assert exposed_backward_s(compute, [], [rs(0, 1.5), rs(0, 1.5)], in_flight=2) == 1.0
    # one in flight: starting the second waits for the first (t = 1 to 2.5), whose
    # computation then ends at 4.5; the second runs from 2.5 to 4, hidden
    assert exposed_backward_s(compute, [], [rs(0, 1.5), rs(0, 1.5)], in_flight=1) == 1.5
    # a kind's window does not hold the other kind's collectives
    assert exposed_backward_s(compute, [], [rs(0, 1.5), rs(0, 1.5, "all_reduce")],
                              in_flight=1) == 1.0
    # a re-gather shares the link: used at step 2, issued at step 1 behind a collective
    # started after step 0 (link busy until t = 2.5), it completes at 3.0, waited 1.0 at t = 2
    assert exposed_backward_s(compute, [TimedGather(1, 2, 0.5)], [rs(0, 1.5)],
                              in_flight=2) == 1.0


def test_collectives_in_flight_together_run_at_the_devices_ratio_by_hand():
    """[Note: collectives together]: one started while the link is busy runs beside what is
    in flight, and for as long as both run the link does their work in ``ratio`` of the time:
    two equal ones started together end at ``ratio`` of their time one after the other."""
    compute = [1.0, 1.0, 1.0]
    gathers = _timed([(0, 0, 0.5), (0, 2, 1.5), (0, 2, 1.5)])
    # one at a time: the third ends at 0.5 + 3.0 = 3.5, waited 1.0 at t = 2.5
    assert exposed_gather_s(compute, gathers, ratio=1.0) == 0.5 + 1.0
    # together from t = 0.5: 0.75 of 3.0 s, ends at 2.75, waited 0.25
    assert exposed_gather_s(compute, gathers, ratio=0.75) == 0.5 + 0.25

    def rs(ready_at, seconds):
        return TimedReduce(ready_at, seconds, "reduce_scatter")

    # two from t = 1 (3.0 s one after the other, ending at 4): together they end at 3.25
    assert exposed_backward_s(compute, [], [rs(0, 1.5), rs(0, 1.5)], in_flight=2,
                              ratio=0.75) == 0.25
    # a short one beside a long one saves 2 (1 - ratio) of its own time: it ends at
    # 3 + 0.25 - 0.125, where one after the other it ends at 3.25
    assert exposed_backward_s(compute, [], [rs(0, 2.0), rs(0, 0.25)], in_flight=2,
                              ratio=0.75) == 0.125
    assert exposed_backward_s(compute, [], [rs(0, 2.0), rs(0, 0.25)], in_flight=2) == 0.25
    # at 1/2, two started together run in the time of one
    assert exposed_backward_s(compute, [], [rs(0, 1.5), rs(0, 1.5)], in_flight=2,
                              ratio=0.5) == 0.0


def test_each_collective_runs_beside_others_at_the_ratio_of_its_size_by_hand():
    """[Note: collectives together], ratios by size (``Devices.concurrent_collective_ratios``):
    with ``ratio=None`` a collective started beside those in flight runs at its own ratio
    (``TimedGather.ratio``, ``TimedReduce.ratio``)."""
    compute = [1.0, 1.0, 1.0]

    def rs(ready_at, seconds, ratio):
        return TimedReduce(ready_at, seconds, "reduce_scatter", ratio=ratio)

    # the second started at its own 0.75: as the devices' 0.75 for both (ends at 3.25)
    assert exposed_backward_s(compute, [], [rs(0, 1.5, 1.0), rs(0, 1.5, 0.75)], in_flight=2,
                              ratio=None) == 0.25
    # the second at its own 1.0 (a small collective): one after the other, ends at 4
    assert exposed_backward_s(compute, [], [rs(0, 1.5, 0.5), rs(0, 1.5, 1.0)], in_flight=2,
                              ratio=None) == 1.0
    # a forced ratio overrides each one's own
    assert exposed_backward_s(compute, [], [rs(0, 1.5, 0.5), rs(0, 1.5, 1.0)], in_flight=2,
                              ratio=0.75) == 0.25
    # gathers alike: the third, started beside the second at 0.75 of its time
    gathers = [TimedGather(0, 0, 0.5), TimedGather(0, 2, 1.5, ratio=1.0),
               TimedGather(0, 2, 1.5, ratio=0.75)]
    assert exposed_gather_s(compute, gathers, ratio=None) == 0.5 + 0.25
    assert exposed_gather_s(compute, [*gathers[:2], dataclasses.replace(gathers[2], ratio=1.0)],
                            ratio=None) == 0.5 + 1.0


def test_the_all_reduce_runs_alone_by_hand():
    """[Note: the all-reduce runs alone]: the replicated gradients' all-reduce runs after the
    reduce-scatter in flight, and a reduce-scatter started while it is in flight runs after it,
    whatever the ratio; two reduce-scatters still run together at it."""
    compute = [1.0, 1.0, 1.0]

    def reduce(ready_at, seconds, kind="reduce_scatter"):
        return TimedReduce(ready_at, seconds, kind)

    # from t = 1: the reduce-scatter ends at 2.5, the all-reduce after it at 4, waited 1.0
    beside_scatter = [reduce(0, 1.5), reduce(0, 1.5, "all_reduce")]
    for ratio in (1.0, 0.75, 0.5):
        assert exposed_backward_s(compute, [], beside_scatter, in_flight=2,
                                  ratio=ratio) == 1.0
    # the all-reduce first: the reduce-scatter started beside it runs after it
    before_scatter = [reduce(0, 1.5, "all_reduce"), reduce(0, 1.5)]
    assert exposed_backward_s(compute, [], before_scatter, in_flight=2, ratio=0.5) == 1.0
    # a re-gather issued while the all-reduce is in flight runs after it too: the all-reduce
    # from t = 1 to 2.5, the gather (0.5 s) issued at t = 1 ends at 3.0, its use at t = 2
    # waits 1.0 (beside the all-reduce at 1/2 it would end at 2.5)
    regather = _timed([(1, 2, 0.5)])
    assert exposed_backward_s(compute, regather, [reduce(0, 1.5, "all_reduce")],
                              in_flight=2, ratio=0.5) == 1.0
    # once it has completed, collectives run together again: from t = 3 two reduce-scatters
    # of 1.0 s end at 3 + 2 x 0.75 = 4.5, one after the other at 5
    after = [reduce(0, 0.5, "all_reduce"), reduce(2, 1.0), reduce(2, 1.0)]
    assert exposed_backward_s(compute, [], after, in_flight=2, ratio=0.75) == 1.5
    assert exposed_backward_s(compute, [], after, in_flight=2, ratio=1.0) == 2.0


def test_the_stages_after_the_first_run_when_waited_for_by_hand():
    """A two-stage collective's first stage runs on the link from its start; the others
    (``at_wait_s``) run when it is waited for, and the computation waits for all of them."""
    compute = [1.0, 1.0, 1.0]
    # the second gather's first stage (0.75 s) runs from t = 0.5 to 1.25, hidden; its second
    # (0.25 s) runs at its use, t = 1.5
    assert exposed_gather_s(compute, _timed([(0, 0, 0.5), (0, 1, 1.0)])) == 0.5
    assert exposed_gather_s(compute, [TimedGather(0, 0, 0.5),
                                      TimedGather(0, 1, 1.0, 0.25)]) == 0.5 + 0.25
    # a gradient collective from t = 1: its first stage ends at 2, its second runs when
    # backward waits for it at its end, t = 3
    assert exposed_backward_s(compute, [], [TimedReduce(0, 1.5, "reduce_scatter")],
                              in_flight=2) == 0.0
    assert exposed_backward_s(compute, [], [TimedReduce(0, 1.5, "reduce_scatter", 0.5)],
                              in_flight=2) == 0.5
    # one in flight: the second waits for the first, second stage and all (t = 1 to 2.5)
    assert exposed_backward_s(compute, [], [TimedReduce(0, 1.5, "reduce_scatter", 0.5),
                                            TimedReduce(0, 1.5, "reduce_scatter", 0.5)],
                              in_flight=1) == 1.5 + 0.5


def test_backward_without_gradient_collectives_waits_as_the_gather_replay():
    """With no gradient collectives, the backward lane's replay is the gathers' replay, to the
    bit (both add the computation between collectives in order)."""
    rnd = random.Random(1)
    for _ in range(300):
        compute, gathers = _random_lane(rnd, 30, 10)
        assert exposed_backward_s(compute, _timed(gathers), [], in_flight=2) == (
            exposed_gather_s(compute, _timed(gathers)))


def _gpt(dim: int = 64):
    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=256, dim=dim, depth=2, heads=4, max_seq=32))
    x = torch.randint(0, 256, (4, 32))
    return analyze(capture(model, (x,)), (x,), fake=True)


def _predicted(analysis, strategy: str, schedule: Schedule):
    specs = param_specs(analysis.captured)
    plan = build_plan({s.name: strategy for s in specs}, specs, world_size=4, schedule=schedule)
    return predict(analysis, plan, StepSetting(Devices(world_size=4), optimizer="adamw"))


def test_deeper_prefetch_costs_memory_and_saves_predicted_time():
    analysis = _gpt(dim=128)  # the MLP weights are gathered alone, the rest in small buckets
    by_depth = [_predicted(analysis, "full_shard", Schedule(d)) for d in (0, 1, 2)]
    peaks = [p.peak_memory_bytes for p in by_depth]
    steps = [p.step_time_s for p in by_depth]
    assert peaks[0] < peaks[1] <= peaks[2], peaks
    assert steps[0] > steps[1] >= steps[2], steps


def test_hiding_saves_the_devices_share_of_the_hidden_time():
    """``Devices.overlap_efficiency`` credits its share of what prefetching hides: none at 0,
    where prefetching only costs memory (the CPU whose cores the ranks keep busy)."""
    analysis = _gpt(dim=128)

    def comm_s(depth: int, efficiency: float) -> float:
        specs = param_specs(analysis.captured)
        plan = build_plan({s.name: "full_shard" for s in specs}, specs, world_size=4,
                          schedule=Schedule(depth))
        devices = Devices(world_size=4, overlap_efficiency=efficiency)
        return predict(analysis, plan, StepSetting(devices, optimizer="adamw")).prediction.comm_s

    whole = comm_s(1, 0.0)  # nothing credited: every collective's seconds
    assert comm_s(0, 0.0) == whole
    # the gradients' reduce-scatters hide under backward at any depth, the gathers with prefetch
    assert whole > comm_s(0, 1.0) > comm_s(1, 1.0)
    assert comm_s(1, 0.5) == pytest.approx(whole - (whole - comm_s(1, 1.0)) / 2)


def test_where_latency_does_not_hide_only_the_time_beyond_it_is_credited():
    """``Devices.overlap_hides_latency`` False (the CPU): the credit is the efficiency's share
    of the hidden time beyond the collectives' latencies, none where a collective is all
    latency, and each group's share in the search less its latency too."""
    analysis = _gpt(dim=128)
    specs = param_specs(analysis.captured)
    plan = build_plan({s.name: "full_shard" for s in specs}, specs, world_size=4,
                      schedule=Schedule(1))

    def comm_s(efficiency: float, hides: bool, **links: float) -> float:
        devices = Devices(world_size=4, overlap_efficiency=efficiency,
                          overlap_hides_latency=hides, **links)
        return predict(analysis, plan, StepSetting(devices, optimizer="adamw")).prediction.comm_s

    whole = comm_s(0.0, True)
    assert whole == comm_s(0.0, False)
    assert whole > comm_s(1.0, False) > comm_s(1.0, True)
    # bytes that take no time: every collective is its latency, and hiding saves nothing
    instant = {"intra_node_bandwidth_bytes_per_s": 1e18}
    assert comm_s(1.0, False, **instant) == pytest.approx(comm_s(0.0, False, **instant))
    assert comm_s(1.0, True, **instant) < comm_s(0.0, True, **instant)
    state = ParamState(numel=2**16, element_size=4, strategy="full_shard", trainable=True)
    window = GatherWindow(1.0, 1.0, 1.0)  # longer than any collective here
    for links in ({}, instant):
        hides, not_hidden = (hidden_share_s(state, window, Devices(
            world_size=4, overlap_efficiency=1.0, overlap_hides_latency=h, **links),
            regathered=True) for h in (True, False))
        devices = Devices(world_size=4, **links)
        latencies = (2 * collective_time_s("all_gather", 0, devices)
                     + collective_time_s("reduce_scatter", 0, devices))
        assert not_hidden == pytest.approx(hides - latencies)


def test_a_gradient_reduced_alone_is_copied_where_the_collective_cannot_take_it_over():
    """gloo reduces in place, so the runtime clones autograd's gradient before a lone
    reduce-scatter; elsewhere it copies only to pad the gradient to whole rows per rank or to
    cast it: a read and a write at the copy bandwidth. A bucket of several packs its members'
    gradients instead (``bucket_copy_s``), and a frozen group reduces nothing."""
    nccl = Devices(world_size=2, memory_bandwidth_bytes_per_s=1e9)
    gloo = Devices(world_size=2, memory_bandwidth_bytes_per_s=1e9,
                   reduce_scatter_copies_input=True)
    even = ParamState(numel=1000, element_size=4, strategy="full_shard", trainable=True)
    odd = ParamState(numel=1001, element_size=4, strategy="shard_grad_op", trainable=True)
    assert scatter_input_copy_s(even, nccl) == 0.0
    assert scatter_input_copy_s(even, gloo) == pytest.approx(8000 / 1e9)
    assert scatter_input_copy_s(odd, nccl) == pytest.approx((4004 + 4008) / 1e9)  # padded
    cast = ParamState(numel=1000, element_size=4, strategy="full_shard", trainable=True,
                      compute_element_size=2)  # bf16 gradient, reduced in fp32
    assert scatter_input_copy_s(cast, nccl) == pytest.approx((2000 + 4000) / 1e9)
    frozen = ParamState(numel=1000, element_size=4, strategy="full_shard", trainable=False)
    assert scatter_input_copy_s(frozen, gloo) == 0.0
    assert scatter_input_copy_s(even, Devices(world_size=1, reduce_scatter_copies_input=True)) == 0

    # in a plan: only the groups gathered alone pay it, each once
    analysis = _gpt(dim=128)  # the MLP weights are gathered alone, the rest in small buckets
    specs = param_specs(analysis.captured)
    plan = build_plan({s.name: "full_shard" for s in specs}, specs, world_size=2,
                      schedule=Schedule(1))
    copying, not_copying = (predict(analysis, plan, StepSetting(
        Devices(world_size=2, reduce_scatter_copies_input=flag), optimizer="adamw"))
        for flag in (True, False))
    states = param_states(analysis, {s.name: "full_shard" for s in specs})
    alone = [analysis.facts.param_of[b[0]] for b in sharded_gather_buckets(
        analysis.facts, states, 2, SMALL_PARAM_BYTES) if len(b) == 1]
    assert 0 < len(alone) < len(specs)
    expected = sum(scatter_input_copy_s(states[n], Devices(
        world_size=2, reduce_scatter_copies_input=True)) for n in alone)
    assert copying.prediction.comm_s - not_copying.prediction.comm_s == pytest.approx(expected)


def test_larger_gather_buckets_share_latency_and_hold_a_larger_flat_buffer():
    analysis = _gpt(dim=128)  # 256 KiB MLP weights, 64 KiB attention ones, 1.6 MiB in all
    small, mib, block = (_predicted(analysis, "full_shard", Schedule(1, g))
                         for g in (SMALL_PARAM_BYTES, 2**18, 2**20))
    assert block.step_time_s < mib.step_time_s < small.step_time_s
    # a whole block's parameters are gathered at the first use of the first
    assert block.peak_memory_bytes > mib.peak_memory_bytes >= small.peak_memory_bytes
    # buckets never span two blocks: a larger size than one block's changes nothing
    assert _predicted(analysis, "full_shard", Schedule(1, 2**21)).prediction == block.prediction


def test_a_bucket_pays_for_copying_its_members_through_its_flat_buffers():
    """A parameter gathered with others is concatenated into the send buffer and split out of
    the gathered flat buffer (again when re-gathered), and its gradient packed and its reduced
    shard copied out: 2 (read and write) x those bytes at the copy bandwidth. A parameter
    gathered alone is a view of its buffer and copies nothing."""
    state = ParamState(numel=1000, element_size=4, strategy="full_shard", trainable=True)
    devices = Devices(world_size=2, memory_bandwidth_bytes_per_s=1e9)
    # full 4000 B, shard 2000 B: forward and re-gather 2 x 6000 each, reduction 2 x 6000
    assert bucket_copy_s(state, devices, again=True) == pytest.approx(36_000 / 1e9)
    assert bucket_copy_s(state, devices, again=False) == pytest.approx(24_000 / 1e9)
    analysis = _gpt(dim=128)
    slow, fast = (predict(analysis, build_plan(
        {s.name: "full_shard" for s in param_specs(analysis.captured)},
        param_specs(analysis.captured), world_size=4, schedule=Schedule(1, 2**21)),
        StepSetting(Devices(world_size=4, memory_bandwidth_bytes_per_s=b), optimizer="adamw"))
        for b in (1e8, 1e12))
    # one bucket of 1.6 MiB gathered over 4 ranks, re-gathered, reduced: about 12 MiB moved
    extra = slow.prediction.comm_s - fast.prediction.comm_s
    assert 10 * 2**20 / 1e8 < extra < 14 * 2**20 / 1e8


def test_backward_re_gathers_a_buckets_saved_members_in_one_all_gather():
    """The replay's backward re-gathers as the runtime runs them: a gather bucket whose saved
    members fit the bucket size in one all-gather (its latency once, issued when the first of
    them is unpacked), a parameter alone otherwise, as many as forward has buckets here."""
    analysis = _gpt(dim=128)
    facts = analysis.facts
    states = param_states(analysis, {s.name: "full_shard" for s in param_specs(analysis.captured)})
    devices = Devices(world_size=4)
    latency = collective_time_s("all_gather", 0, devices)
    ridden = {}
    for bucket_bytes in (2**20, SMALL_PARAM_BYTES):
        buckets = sharded_gather_buckets(facts, states, 4, bucket_bytes)
        together = regathered_together(facts, states, buckets, 4, bucket_bytes)
        forward, backward = timed_gathers(facts, states, devices, prefetch=1,
                                          gather_bucket_bytes=bucket_bytes,
                                          regathered=analysis.regathered)
        saved = [n for b in buckets for n in b if facts.savers.get(n)]
        riders = sum(len([n for n in b if facts.savers.get(n)]) - 1 for b in together)
        assert len(forward) == len(buckets)
        assert len(backward) == len(saved) - riders
        each = sum(gather_s(states[facts.param_of[n]], devices, regathered=True).backward_s
                   for n in saved)
        assert sum(g.seconds for g in backward) == pytest.approx(each - riders * latency)
        ridden[bucket_bytes] = riders
    assert ridden[2**20] > ridden[SMALL_PARAM_BYTES]  # a block's members ride in one re-gather


def test_smaller_all_reduce_buckets_pay_more_latency():
    analysis = _gpt()
    large, small = (_predicted(analysis, "replicate", Schedule(1, SMALL_PARAM_BYTES, r))
                    for r in (DEFAULT_BUCKET_BYTES, 64 * 1024))
    assert small.prediction.comm_s > large.prediction.comm_s


def test_the_schedule_search_ranks_distinct_plans_that_fit():
    analysis = _gpt()
    limit = 2202009
    setting = StepSetting(Devices(world_size=4, memory_bytes=limit), optimizer="adamw")
    found = search_schedules(analysis, setting, limit, alternatives=True)
    times = [f.step_s for f in found]
    assert times == sorted(times) and len(found) >= 3
    plans = [predict(analysis, build_plan(f.found.strategies, param_specs(analysis.captured),
                                          world_size=4, schedule=f.schedule,
                                          recompute=f.found.recompute),
                     StepSetting(Devices(world_size=4), optimizer="adamw"))
             for f in found]
    assert all(p.peak_memory_bytes <= limit for p in plans)
    assert len({p.hash() for p in plans}) == len(plans)
    assert [p.step_time_s for p in plans] == pytest.approx(times)
    only = search_schedules(analysis, setting.with_schedule(Schedule(prefetch=0)), limit,
                            vary_prefetch=False)
    assert {f.schedule.prefetch for f in only} == {0}
    assert len(candidate_schedules()) == 12 and candidate_schedules()[0] == Schedule()
    assert Schedule(2, 2**20) in candidate_schedules()


def test_rank_schedules_keeps_the_first_of_equal_plans_and_raises_when_none_fits():
    options = [(Schedule(d), 10) for d in (1, 0, 2)]
    ranked = rank_schedules(lambda schedule, memory_limit_bytes: {"w": "replicate"},
                            lambda sch, st: (1.0, "same"), options)
    assert [f.schedule for f in ranked] == [Schedule(1)]

    def none_fits(schedule, memory_limit_bytes):
        raise PlanError(f"nothing fits {schedule.prefetch}")
    with pytest.raises(PlanError, match="nothing fits 1"):
        rank_schedules(none_fits, lambda sch, st: (1.0, sch), options)


def test_the_schedule_round_trips_through_the_plan_file_and_the_runtime_honours_it(tmp_path):
    torch.manual_seed(0)  # 256 KiB weights: above the default small-parameter size
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])
    inputs = (torch.randn(4, 256),)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": "full_shard",
                                "params": {}, "gather_bucket_bytes": 2**20}))
    bucketed = compile_osdp(copy.deepcopy(model), inputs, plan=str(path))
    assert bucketed.plan.schedule.gather_bucket_bytes == 2**20
    assert "gather buckets 1.0 MiB" in str(bucketed.plan)
    gm = bucketed.graph_module
    assert sum("all_gather_params" in str(n.target) for n in gm.graph.nodes) == 1
    assert not any("all_gather_param " in f"{n.target} " for n in gm.graph.nodes)
    bucketed.plan.save(tmp_path / "again.json")
    saved = json.loads((tmp_path / "again.json").read_text())
    assert saved["gather_bucket_bytes"] == 2**20 and "reduce_bucket_bytes" not in saved
    again = compile_osdp(copy.deepcopy(model), inputs, plan=str(tmp_path / "again.json"))
    assert again.plan.hash() == bucketed.plan.hash()
    default = compile_osdp(copy.deepcopy(model), inputs, plan="full_shard")
    assert default.plan.schedule == Schedule() and default.plan.hash() != bucketed.plan.hash()
    torch.testing.assert_close(bucketed(*inputs), default(*inputs), rtol=0, atol=0)
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": "replicate",
                                "params": {}, "reduce_bucket_bytes": 256 * 1024}))
    replicated = compile_osdp(copy.deepcopy(model), inputs, plan=str(path))
    assert len(replicated._runtime.grad_sync.reducer.buckets) == 4  # one 256 KiB weight per bucket
    assert len(compile_osdp(copy.deepcopy(model), inputs,
                            plan="replicate")._runtime.grad_sync.reducer.buckets) == 1
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": "full_shard",
                                "params": {}, "scatters_in_flight": 1}))
    one = compile_osdp(copy.deepcopy(model), inputs, plan=str(path))
    assert one.plan.schedule == Schedule(scatters_in_flight=1)
    assert "gradient collectives in flight 1" in str(one.plan)
    assert (one._runtime.grad_sync.scatters.max_in_flight,
            one._runtime.grad_sync.reducer.max_in_flight) == (1, 1)
    one.plan.save(tmp_path / "one.json")
    assert json.loads((tmp_path / "one.json").read_text())["scatters_in_flight"] == 1
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": "full_shard",
                                "params": {}, "scatters_in_flight": 0}))
    with pytest.raises(PlanError, match="scatters_in_flight=0"):
        compile_osdp(copy.deepcopy(model), inputs, plan=str(path))


def test_a_limit_the_most_sharded_plan_fits_always_gets_a_plan():
    """Near the all-full_shard peak the separable search may find nothing (rounding) or give
    up tightening; the most sharded plan, which fits by the timeline, is returned then."""
    from osdp_fx.planner.analysis import MEMORY_MARGIN
    from osdp_fx.planner.search import _activation_base, search_strategies

    analysis = _gpt()
    devices = Devices(world_size=4)
    lowest, _ = _activation_base(analysis, StepSetting(devices, optimizer="adamw",
                                                       schedule=Schedule(1)))
    for extra in range(1, 6):
        limit = int(lowest / (1 - MEMORY_MARGIN)) + extra
        strategies = search_strategies(analysis, StepSetting(devices, optimizer="adamw"), limit)
        assert set(strategies.values()) <= {"full_shard", "replicate", "shard_grad_op"}


def test_recompute_false_searches_without_recomputation():
    """At a limit only recomputation meets, the search recomputes; with ``recompute=False``
    (``compile_osdp(recompute=False)``, ``plan --no-recompute``) it finds nothing."""
    from osdp_fx.core.regions import find_regions
    from osdp_fx.cost_models.timeline import predict_peak_bytes
    from osdp_fx.planner.analysis import param_states

    analysis = _gpt()
    every = {n: "full_shard" for n in analysis.captured.params}
    regions = find_regions(analysis.captured.gm.graph)

    def peak(recompute):
        return predict_peak_bytes(analysis.captured.gm, param_states(analysis, every),
                                  setting=StepSetting(Devices(world_size=4)),
                                  profiled_batch=analysis.batch_size, recompute=recompute)

    limit = int((peak({}) + peak({r: "full" for r in regions})) / 2 / 0.97)
    setting = StepSetting(Devices(world_size=4, memory_bytes=limit), optimizer="adamw")
    recompute = search_schedules(analysis, setting, limit)[0].found.recompute
    assert recompute
    with pytest.raises(PlanError):
        search_schedules(analysis, setting, limit, recompute=False)


def test_the_search_offers_gather_buckets_of_one_transformer_block():
    analysis = _gpt(dim=512)  # a block's matrices: 12 x 512 x 512 floats, 12 MiB
    gm = analysis.captured.gm
    block = block_gather_bytes(analysis, world_size=4)
    in_block = [p.nbytes for n, p in gm.named_parameters() if "blocks.0." in n or "blocks_0_" in n]
    assert in_block and block == sum(in_block)  # every size divides by 4: no padding
    assert block_gather_bytes(analysis, world_size=3) > block  # shards padded to equal sizes
    schedules = candidate_schedules(block_bytes=block)
    assert len(schedules) == 24 and schedules[0] == Schedule()
    assert {s.gather_bucket_bytes for s in schedules} == {SMALL_PARAM_BYTES, 2**20, block}
    # one gradient collective in flight is offered with block buckets only
    assert {s.gather_bucket_bytes for s in schedules if s.scatters_in_flight == 1} == {block}
    assert candidate_schedules(block_bytes=2**19) == candidate_schedules()  # no larger than 1 MiB
    # where most parameters must be sharded and a collective costs mostly its latency, a
    # bucket per block is the predicted fastest
    limit = int(_predicted(analysis, "full_shard", Schedule(1, block)).peak_memory_bytes / 0.9)
    slow_links = Devices(world_size=4, memory_bytes=limit, intra_node_latency_s=0.05)
    found = search_schedules(analysis, StepSetting(slow_links, optimizer="adamw"), limit)
    assert found[0].schedule.gather_bucket_bytes == block, found[0].schedule


def test_one_collective_in_flight_holds_one_blocks_gradient_buffers_and_the_search_uses_it():
    """With block buckets, full_shard holds each block's flat gradient and its shard until the
    reduce-scatter completes: two in flight hold two blocks' buffers. Under a limit only one in
    flight fits, the search keeps block buckets with one in flight (its step time predicted
    the same here: in the replayed backward each block's reduce-scatter completes before the
    next block's gradients are ready, so the window never makes backward wait)."""
    analysis = _gpt(dim=512)
    block = block_gather_bytes(analysis, world_size=4)
    two, one = (_predicted(analysis, "full_shard", Schedule(1, block, scatters_in_flight=k))
                for k in (2, 1))
    assert one.peak_memory_bytes < two.peak_memory_bytes
    assert one.step_time_s == two.step_time_s
    limit = int((one.peak_memory_bytes + two.peak_memory_bytes) / 2 / 0.97)
    slow_links = Devices(world_size=4, memory_bytes=limit, intra_node_latency_s=0.05)
    found = search_schedules(analysis, StepSetting(slow_links, optimizer="adamw"), limit)
    # the exact search's fastest plan (shard_grad_op on the largest groups and the rest
    # replicated, or on all, which the search also offers, fit here too and are predicted
    # faster still: local_search.refine)
    mixed = [f for f in found if set(f.found.strategies.values()) > {"replicate"}
             and "full_shard" in f.found.strategies.values()]
    assert (mixed[0].schedule.gather_bucket_bytes, mixed[0].schedule.scatters_in_flight) == (
        block, 1), mixed[0].schedule
    assert set(found[0].found.strategies.values()) - {"replicate"} == {"shard_grad_op"}


@pytest.mark.parametrize("dim", [64, 512])
def test_a_named_strategy_gathers_one_block_per_collective_as_fsdp2(dim):
    """On a model of repeated blocks a plan named by a strategy runs FSDP2's schedule: one
    all-gather per block (a bucket of the most bytes one block gathers, at least 1 MiB; a
    bucket never spans two blocks), the default prefetch (one bucket ahead), one gradient
    collective in flight. d 64: a block is under 1 MiB; d 512: 12 MiB."""
    torch.manual_seed(0)
    depth = 2
    model = GPTWithLoss(TinyGPT(vocab=256, dim=dim, depth=depth, heads=4, max_seq=32))
    x = torch.randint(0, 256, (4, 32))
    devices = Devices(world_size=4)
    for strategy in ("shard_grad_op", "full_shard"):
        planned = plan_model(capture(model, (x,)), (x,), strategy,
                             StepSetting(devices, optimizer="adamw"), SearchOptions(fake=True))
        plan, analysis = planned.plan, planned.analysis
        block = block_gather_bytes(analysis, world_size=4)
        assert plan.schedule == Schedule(1, max(block, 2**20), scatters_in_flight=1), strategy
        states = param_states(analysis, {p.name: p.strategy for p in plan.params})
        buckets = sharded_gather_buckets(analysis.facts, states, 4,
                                         plan.schedule.gather_bucket_bytes)
        blocks = [{block_of(analysis.facts.param_of[n]) for n in b} for b in buckets]
        if dim == 512:  # (at d 64 every parameter is small: runs of those share any bucket)
            in_blocks = [b for b in blocks if b != {None}]
            assert sorted(in_blocks, key=str) == [{f"model.blocks.{i}"} for i in range(depth)]


def test_a_named_strategy_without_blocks_keeps_the_peak_of_small_buckets():
    """Without repeated blocks (an MLP), a plan named by a strategy takes 1 MiB buckets only
    where they keep the predicted peak of gathering small parameters alone."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
    x = torch.randn(8, 256)
    devices = Devices(world_size=4)
    for strategy in ("shard_grad_op", "full_shard"):
        planned = plan_model(capture(model, (x,)), (x,), strategy,
                             StepSetting(devices, optimizer="adamw"), SearchOptions(fake=True))
        plan, analysis = planned.plan, planned.analysis
        assert block_gather_bytes(analysis, world_size=4) is None
        default = _predicted(analysis, strategy, Schedule()).peak_memory_bytes
        larger = _predicted(analysis, strategy, Schedule(1, 2**20)).peak_memory_bytes
        assert plan.schedule == (Schedule(1, 2**20) if larger <= default else Schedule())
        assert plan.peak_memory_bytes <= default


def test_largest_first_shards_the_fewest_largest_groups_that_fit():
    """"Shard the k largest groups, replicate the rest": the least k whose predicted peak fits,
    per strategy and schedule; the search beyond the margin lists them among its plans,
    fastest first."""
    from osdp_fx.planner.analysis import plan_step_s
    from osdp_fx.planner.local_search import largest_first
    from osdp_fx.planner.search import plan_peak_bytes
    from osdp_fx.planner.search_margin import search_beyond_margin

    analysis = _gpt(dim=128)
    specs = param_specs(analysis.captured)
    by_size = sorted(specs, key=lambda s: -s.element_size * int(torch.Size(s.shape).numel()))
    replicated = _predicted(analysis, "replicate", Schedule()).peak_memory_bytes
    limit = (replicated + _predicted(analysis, "full_shard", Schedule()).peak_memory_bytes) // 2
    devices = Devices(world_size=4, memory_bytes=limit)
    setting = StepSetting(devices, optimizer="adamw")
    found = largest_first(
        analysis, [Schedule()],
        fits=lambda sch, f: plan_peak_bytes(analysis, f.strategies, f.recompute,
                                            setting.with_schedule(sch)) <= limit,
        step_s=lambda sch, f: plan_step_s(analysis, f.strategies, f.recompute,
                                          setting.with_schedule(sch)))
    assert [f.found.strategies[by_size[0].name] for f in found] == ["full_shard",
                                                                    "shard_grad_op"]
    for f in found:
        strategies, recompute = f.found.strategies, f.found.recompute
        k = sum(s != "replicate" for s in strategies.values())
        assert 0 < k < len(specs) and recompute == {}
        assert {strategies[s.name] for s in by_size[:k]} == {strategies[by_size[0].name]}

        def peak(k: int) -> int:
            plan = build_plan({s.name: strategies[by_size[0].name] if i < k else "replicate"
                               for i, s in enumerate(by_size)}, specs, world_size=4)
            return predict(analysis, plan, setting).peak_memory_bytes

        assert peak(k) <= limit < peak(k - 1)
    beyond = search_beyond_margin(analysis, setting, limit, faster_than_s=float("inf"))
    times = [f.step_s for f in beyond]
    assert times == sorted(times) and len(beyond) >= len(found)


def test_block_bytes_count_parameters_read_through_their_casts():
    """Under mixed precision a block reads its parameters through their casts to the compute
    dtype: one block per all-gather all the same (a named plan's bucket, the search's)."""
    from osdp_fx.core.precision import resolve_mixed_precision

    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=256, dim=512, depth=2, heads=4, max_seq=32))
    x = torch.randint(0, 256, (4, 32))
    blocks = {}
    for mp in (None, "bf16"):
        planned = plan_model(capture(model, (x,)), (x,), "full_shard",
                             StepSetting(Devices(world_size=4), optimizer="adamw",
                                         precision=resolve_mixed_precision(mp)),
                             SearchOptions(fake=True))
        blocks[mp] = block_gather_bytes(planned.analysis, world_size=4)
        assert planned.plan.schedule.gather_bucket_bytes == blocks[mp], mp
    assert blocks["bf16"] == blocks[None] > 2**20

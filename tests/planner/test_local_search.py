"""The local search after the exact one: the searched plan is a local optimum of the models
that judge it (the timeline's peak, the step model's time), not only of the exact problem."""

from __future__ import annotations

from test_schedule_search import _gpt, _predicted

from osdp_fx import Devices
from osdp_fx.core.buckets import Schedule, candidate_schedules
from osdp_fx.core.setting import StepSetting
from osdp_fx.core.strategies import searched_strategies
from osdp_fx.planner.local_search import IMPROVED_GROUPS, improve, largest_first, largest_groups
from osdp_fx.planner.analysis import plan_step_s
from osdp_fx.planner.search import plan_peak_bytes, search_schedules


def test_improve_takes_the_fastest_fitting_change_each_round_toward_more_bytes_held():
    held = {"replicate": 4, "shard_grad_op": 2, "full_shard": 1}
    cost = {"replicate": 1.0, "shard_grad_op": 2.0, "full_shard": 3.0}

    def step_s(plan):  # fits in 9 bytes; replicating "a" saves the most
        if sum(held[s] for s in plan.values()) > 9:
            return None
        return sum(cost[s] * (3 if name == "a" else 1) for name, s in plan.items())

    start = {"a": "full_shard", "b": "full_shard", "c": "full_shard"}
    options = {n: held for n in start}
    seconds, plan = improve(start, options=options, step_s=step_s)
    # round 1: a -> replicate (15 -> 9 s, 6 bytes); round 2: b -> replicate (7 s, 9 bytes;
    # c would do as well, b comes first); round 3: nothing more fits
    assert plan == {"a": "replicate", "b": "replicate", "c": "full_shard"}
    assert seconds == step_s(plan) == 7.0
    # never toward fewer bytes held, even where that would be faster
    seconds, plan = improve({"a": "replicate", "b": "replicate"}, options={"b": held},
                            step_s=lambda p: 1.0 if p["b"] == "full_shard" else 2.0)
    assert plan == {"a": "replicate", "b": "replicate"} and seconds == 2.0
    # a start that does not fit is returned as it is
    assert improve({"a": "replicate", "b": "replicate", "c": "replicate"}, options=options,
                   step_s=step_s) == (None, {"a": "replicate", "b": "replicate",
                                             "c": "replicate"})


def test_improve_asks_fits_only_of_changes_faster_than_the_plan_so_far():
    held = {"replicate": 4, "shard_grad_op": 2, "full_shard": 1}
    cost = {"replicate": 1.0, "shard_grad_op": 2.0, "full_shard": 3.0}

    def seconds(plan):
        return sum(cost[s] * (3 if name == "a" else 1) for name, s in plan.items())

    def fits(plan):
        asked.append(dict(plan))
        return sum(held[s] for s in plan.values()) <= 9

    def checked(plan):  # the same models, fit checked inside the step time
        return seconds(plan) if sum(held[s] for s in plan.values()) <= 9 else None

    start = {"a": "full_shard", "b": "full_shard", "c": "full_shard"}
    options = {n: held for n in start}
    asked: list[dict] = []
    assert (improve(start, options=options, step_s=seconds, fits=fits)
            == improve(start, options=options, step_s=checked))
    assert asked[0] == start
    # every plan asked after the start was faster than the plan it would have replaced
    assert all(seconds(p) < seconds(start) for p in asked[1:])
    assert len(asked) < 1 + 3 * 2 * 4  # not every change of every round


def test_the_searched_plan_has_no_faster_single_change_of_a_large_group_that_fits():
    """At this limit the exact problem's own answer (7.04 ms predicted) leaves memory unused
    that replicating or keeping gathered one more large group would spend (6.95 ms): the search
    returns a plan that no such change improves, by the timeline and the step model (the
    exact problem's answer fails this test: keeping ``blocks.1.fc.weight`` gathered is
    faster and fits)."""
    analysis = _gpt(dim=128)
    replicated = _predicted(analysis, "replicate", Schedule()).peak_memory_bytes
    sharded = _predicted(analysis, "full_shard", Schedule()).peak_memory_bytes
    limit = sharded + (replicated - sharded) // 5
    devices = Devices(world_size=4, memory_bytes=limit)
    setting = StepSetting(devices, optimizer="adamw")
    best = search_schedules(analysis, setting, limit)[0]
    seconds, schedule = best.step_s, best.schedule
    plan, recompute = best.found.strategies, best.found.recompute
    at = setting.with_schedule(schedule)
    assert plan_step_s(analysis, plan, recompute, at) == seconds
    order = ["replicate", "shard_grad_op", "full_shard"]  # most bytes held first
    groups = largest_groups(analysis)
    assert len(groups) == IMPROVED_GROUPS
    for name in groups:
        for strategy in searched_strategies(devices.num_nodes):
            if order.index(strategy) >= order.index(plan[name]):
                continue
            trial = {**plan, name: strategy}
            if plan_peak_bytes(analysis, trial, recompute, at) <= 0.97 * limit:
                assert plan_step_s(analysis, trial, recompute, at) >= seconds, (name, strategy)


def test_the_searched_plan_is_predicted_no_slower_than_a_uniform_plan_that_fits():
    """The exact problem does not see that a bucket's members share one collective's latency:
    on this GPT it returned 21 replicated and 7 shard_grad_op groups (2.11 ms predicted) where
    all full_shard in 1 MiB buckets fits and is predicted at 1.71 ms. The search offers every
    uniform plan under every candidate schedule (and two schedules that bucket the same but
    re-gather differently in backward are told apart: ``schedule.collectives_key``)."""
    analysis = _gpt(dim=64)
    replicated = _predicted(analysis, "replicate", Schedule()).peak_memory_bytes
    sharded = _predicted(analysis, "full_shard", Schedule()).peak_memory_bytes
    limit = sharded + (replicated - sharded) * 9 // 10
    devices = Devices(world_size=4, memory_bytes=limit)
    setting = StepSetting(devices, optimizer="adamw")
    seconds = search_schedules(analysis, setting, limit)[0].step_s
    fitting = []
    for strategy in ("replicate", "shard_grad_op", "full_shard"):
        plan = {n: strategy for n in analysis.captured.params}
        for schedule in candidate_schedules():
            at = setting.with_schedule(schedule)
            if plan_peak_bytes(analysis, plan, {}, at) <= 0.97 * limit:
                fitting.append(plan_step_s(analysis, plan, {}, at))
    assert fitting and seconds <= min(fitting)


def test_the_searched_plan_is_predicted_no_slower_than_sharding_the_largest_groups():
    """"Shard the k largest groups, replicate the rest" (full_shard or shard_grad_op, the least
    k that fits, the default schedule) is the plan a user writes by hand; near the limit the
    exact problem can miss one the step model predicts faster (``benchmarks/optimality.py``:
    the Llama at 70 MiB; here at world 2, halfway from all full_shard to all replicate, its
    answer was predicted at 2.38 ms and shard_grad_op on the largest groups at 2.24 ms), so the
    search offers them (``local_search.largest_first``): at 5, 6 and 7 tenths of the way none is
    predicted faster than the searched plan."""
    analysis = _gpt(dim=64)
    replicated = _predicted(analysis, "replicate", Schedule()).peak_memory_bytes
    sharded = _predicted(analysis, "full_shard", Schedule()).peak_memory_bytes
    for tenths in (5, 6, 7):
        limit = sharded + (replicated - sharded) * tenths // 10
        setting = StepSetting(Devices(world_size=2, memory_bytes=limit), optimizer="adamw")
        seconds = search_schedules(analysis, setting, limit)[0].step_s
        at = setting.with_schedule(Schedule())
        hand = largest_first(
            analysis, [Schedule()],
            fits=lambda sch, f: plan_peak_bytes(analysis, f.strategies, {}, at) <= 0.97 * limit,
            step_s=lambda sch, f: plan_step_s(analysis, f.strategies, {}, at))
        assert hand and seconds <= min(h.step_s for h in hand), tenths

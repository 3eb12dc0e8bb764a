"""After the exact search: plans judged by the timeline and the step model themselves.

The exact problem (``solver``) weighs a plan by a separable step time and a separable memory
(each group's time and bytes added up); the timeline and the step model, which judge the plan,
are not separable (collectives share buckets, prefetching hides a gather behind whatever
computation precedes it, the peak is reached at one moment). So near the memory limit the
exact problem's answer can leave a faster plan unfound, one that differs from it in a group or
two and still fits (``benchmarks/optimality.py`` compares the search with such plans).
:func:`improve` climbs from the searched plan: each round it tries every other strategy for
each of the largest groups, judged by the two models themselves, and takes the fastest change
that fits, until none is faster. Before it, :func:`refine` adds the plans a user would write
by hand: the uniform ones (every group shard_grad_op, or full_shard) under each schedule, and
"shard the k largest groups, replicate the rest" (:func:`largest_first`) under the default
schedule and those of the searched plans that rank first. The exact problem weighs a sharded
group by its own collectives and does not see that a bucket's members share one collective's
latency, so it can return a plan slower than a uniform one that fits, such as all full_shard
in 1 MiB buckets (``tests/planner/test_local_search.py``); and near the limit it can miss a
largest-first plan the step model predicts faster (``docs/benchmarks.md``, "Is the searched
plan the fastest that fits?").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from ..core.buckets import Schedule
from ..core.setting import StepSetting
from ..core.strategies import FULL_SHARD, REPLICATE, SHARD_GRAD_OP, searched_strategies
from ..cost_models.memory import persistent_bytes
from .analysis import Analysis, param_state, param_states
from .results import Found, Ranked
from .schedule_search import collectives_key

UNIFORM = (SHARD_GRAD_OP, FULL_SHARD)
"""The uniform plans :func:`refine` offers under every schedule."""

LARGEST_FIRST = (FULL_SHARD, SHARD_GRAD_OP)
"""The strategies of :func:`largest_first`'s plans."""

HAND_SCHEDULES = 3
""":func:`refine` offers :func:`largest_first`'s plans under the default schedule and those of
this many of the searched plans that rank first (each costs a bisection of timelines)."""

IMPROVED_GROUPS = 12
"""The largest parameter groups whose strategy :func:`improve` changes: they move the step time
and the peak the most; each further group costs a timeline and a step prediction per round."""

IMPROVE_ROUNDS = 4
"""At most this many changes are taken, one per round."""


def improve(
    strategies: Mapping[str, str], *, options: Mapping[str, Mapping[str, int]],
    step_s: Callable[[Mapping[str, str]], float | None], rounds: int = IMPROVE_ROUNDS,
    fits: Callable[[Mapping[str, str]], bool] | None = None,
) -> tuple[float | None, dict[str, str]]:
    """From ``strategies`` (group -> strategy), hill-climb over single changes of the groups
    of ``options`` (group -> {strategy: the bytes it keeps the group in, persistently}) to a
    strategy that keeps the group in at least as many bytes as its current one: the exact
    problem overestimates the peak near the limit and leaves memory unused (``search._loosen``),
    which such changes spend. ``step_s``: a plan's predicted seconds, None when it does not
    fit. Each round takes the fastest change faster than the plan so far; at most ``rounds``.
    With ``fits`` (whether a plan fits), ``step_s`` need not check it: ``fits`` is asked of the
    starting plan and, in each round, of the changes faster than the plan so far, fastest
    first, until one fits (the timeline costs about what the step model does, and most changes
    are slower). Returns (its step seconds,
    the plan); the seconds are None only when ``strategies`` itself does not fit (it is then
    returned unchanged)."""
    best = dict(strategies)
    best_s = step_s(best) if fits is None or fits(best) else None
    if best_s is None:
        return None, best
    for _ in range(rounds):
        faster = []
        for name, held in options.items():
            for strategy, kept in held.items():
                if strategy == best[name] or kept < held[best[name]]:
                    continue
                trial = {**best, name: strategy}
                if (s := step_s(trial)) is not None and s < best_s:
                    faster.append((s, trial))
        # the fastest change that fits: fits asked in order of speed (a stable sort keeps the
        # first of equally fast changes first), until one does
        move = next((m for m in sorted(faster, key=lambda m: m[0])
                     if fits is None or fits(m[1])), None)
        if move is None:
            break
        best_s, best = move
    return best_s, best


def largest_first(analysis: Analysis, schedules: Sequence[Schedule], *,
                  fits: Callable[[Schedule, Found], bool],
                  step_s: Callable[[Schedule, Found], float]) -> list[Ranked]:
    """The plans a user writes by hand, "shard the k largest parameter groups, replicate the
    rest", with each strategy of :data:`LARGEST_FIRST` under each of ``schedules``: for each,
    the least k for which ``fits`` (found by bisection, the peak falling as k grows), with its
    ``step_s``; none where even every group sharded does not fit."""
    names = list(analysis.captured.params)
    largest = largest_groups(analysis, None)
    out: list[Ranked] = []
    for schedule in schedules:
        for strategy in LARGEST_FIRST:
            def plan(k: int) -> Found:
                top = set(largest[:k])
                return Found({n: strategy if n in top else REPLICATE for n in names}, {})

            low, high = 0, len(largest)
            if not fits(schedule, plan(high)):
                continue
            while low < high:
                mid = (low + high) // 2
                low, high = (low, mid) if fits(schedule, plan(mid)) else (mid + 1, high)
            found = plan(low)
            out.append(Ranked(step_s(schedule, found), schedule, found))
    return out


def refine(
    ranked: Sequence[Ranked], *, analysis: Analysis, setting: StepSetting,
    schedules: Sequence[Schedule], fits: Callable[[Schedule, Found], bool],
    step_s: Callable[[Schedule, Found], float],
) -> list[Ranked]:
    """``ranked`` (fastest first, from the exact search) with, before
    it, where predicted faster than its fastest: the :data:`UNIFORM` plans that fit under any of
    ``schedules`` (each distinct plan of collectives judged once) and the :func:`largest_first`
    plans under the first of ``schedules`` (the default) and those of the first
    :data:`HAND_SCHEDULES` of ``ranked``, fastest first, and the fastest plan of all as
    :func:`improve` leaves it. ``fits``, ``step_s``: the timeline's peak against the target and
    the step model's seconds, under a schedule."""
    devices = setting.devices
    if devices.world_size < 2:
        return list(ranked)
    uniform, seen = [], set()
    for strategy in UNIFORM:
        plan = Found({n: strategy for n in analysis.captured.params}, {})
        states = param_states(analysis, plan.strategies)
        for schedule in schedules:
            key = (collectives_key(analysis.facts, states, schedule, devices.world_size),
                   schedule.scatters_in_flight)
            if key in seen:
                continue
            seen.add(key)
            if fits(schedule, plan):
                uniform.append(Ranked(step_s(schedule, plan), schedule, plan))
    first = dict.fromkeys([*schedules[:1], *(r.schedule for r in ranked[:HAND_SCHEDULES])])
    hand = largest_first(analysis, list(first), fits=fits, step_s=step_s)
    ranked = sorted([u for u in uniform + hand if u.step_s < ranked[0].step_s],
                    key=lambda u: u.step_s) + list(ranked)
    fastest_s, schedule = ranked[0].step_s, ranked[0].schedule
    plan, recompute = ranked[0].found.strategies, ranked[0].found.recompute
    sizes = {n: param_state(analysis, n, REPLICATE) for n in largest_groups(analysis)}
    options = {n: {s: persistent_bytes(st.numel, element_size=st.element_size, strategy=s,
                                       world_size=devices.world_size, optimizer=setting.optimizer,
                                       ranks_per_node=devices.ranks_per_node, row=st.row)
                   for s in searched_strategies(devices.num_nodes)} for n, st in sizes.items()}

    s, better = improve(plan, options=options,
                        step_s=lambda trial: step_s(schedule, Found(dict(trial), recompute)),
                        fits=lambda trial: fits(schedule, Found(dict(trial), recompute)))
    if s is None or better == plan or s >= fastest_s:
        return ranked
    return [Ranked(s, schedule, Found(better, recompute)), *ranked]


def largest_groups(analysis: Analysis, count: int | None = IMPROVED_GROUPS) -> list[str]:
    """The ``count`` largest parameter groups (None: all), largest first, by bytes."""
    states = {n: param_state(analysis, n, REPLICATE) for n in analysis.captured.params}
    return sorted(states, key=lambda n: -states[n].numel * states[n].element_size)[:count]

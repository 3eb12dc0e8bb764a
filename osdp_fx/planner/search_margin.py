"""Plans beyond the memory margin, for autotuning to measure before it trusts them.

:func:`search_beyond_margin` searches as ``search.search_schedules`` does, but for the whole
memory limit rather than its plannable share (``Devices.memory_margin``), and adds the plans a
user writes by hand (:func:`largest_first`); ``compile_osdp(autotune=K)`` times the fastest K
of those predicted faster than the searched plan, and keeps one only when it measured under
the limit and faster (``planner/autotune.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..core.buckets import Schedule
from ..core.setting import StepSetting
from ..core.strategies import FULL_SHARD, REPLICATE, SHARD_GRAD_OP
from ..errors import PlanError
from .analysis import Analysis, plan_step_s, unmargined_limit
from .local_search import largest_groups
from .results import Found, Ranked
from .search import LOOSENED_SCHEDULES, plan_peak_bytes, search_schedules


def search_beyond_margin(
    analysis: Analysis, setting: StepSetting, memory_limit_bytes: int, *, faster_than_s: float,
    vary_prefetch: bool = True, recompute: bool = True,
) -> list[Ranked]:
    """Plans the models predict to fit ``memory_limit_bytes`` itself, not only its plannable
    share (``Devices.memory_margin``), and to step in less than ``faster_than_s`` (the best plan
    under the margin), fastest first: none when none does. The prediction alone does not
    promise that they fit; autotuning measures them first (``planner/autotune.py``)."""
    try:
        found = search_schedules(
            analysis, setting,
            unmargined_limit(memory_limit_bytes, setting.devices.memory_margin),
            vary_prefetch=vary_prefetch, recompute=recompute)
    except PlanError:
        return []
    schedules = list(dict.fromkeys(f.schedule for f in found[:LOOSENED_SCHEDULES]))
    found += largest_first(analysis, setting, memory_limit_bytes, schedules)
    distinct: dict[tuple[Any, ...], Ranked] = {}
    for f in sorted(found, key=lambda f: f.step_s):  # fastest first; a plan found twice, once
        distinct.setdefault((f.schedule, *sorted(f.found.strategies.items()),
                             *sorted(f.found.recompute.items())), f)
    return [f for f in distinct.values() if f.step_s < faster_than_s]


LARGEST_FIRST = (FULL_SHARD, SHARD_GRAD_OP)
"""The strategies of :func:`largest_first`'s plans."""


def largest_first(analysis: Analysis, setting: StepSetting, memory_limit_bytes: int,
                  schedules: Sequence[Schedule]) -> list[Ranked]:
    """The plans a user writes by hand, "shard the k largest parameter groups, replicate the
    rest", with each strategy of :data:`LARGEST_FIRST` under each of ``schedules``: for each,
    the least k whose predicted peak is at most ``memory_limit_bytes`` (found by bisection, the
    peak falling as k grows), with its predicted step seconds; none where even every trainable
    group sharded does not fit. The exact problem's step time is separable and the step
    model's is not, so near the limit the solver can miss such a plan that the step model
    predicts faster (``docs/benchmarks.md``): the search beyond the margin
    offers them to autotuning too."""
    if setting.devices.world_size < 2:
        return []
    setting = setting.at_batch(None)
    names = list(analysis.captured.params)
    largest = largest_groups(analysis, None)
    out: list[Ranked] = []
    for schedule in schedules:
        for strategy in LARGEST_FIRST:
            def plan(k: int) -> Found:
                top = set(largest[:k])
                return Found({n: strategy if n in top else REPLICATE for n in names}, {})

            def fits(k: int) -> bool:
                return plan_peak_bytes(analysis, plan(k).strategies, {},
                                       setting.with_schedule(schedule)) <= memory_limit_bytes

            low, high = 0, len(largest)
            if not fits(high):
                continue
            while low < high:
                mid = (low + high) // 2
                low, high = (low, mid) if fits(mid) else (mid + 1, high)
            found = plan(low)
            out.append(Ranked(plan_step_s(analysis, found.strategies, {},
                                          setting.with_schedule(schedule)), schedule, found))
    return out

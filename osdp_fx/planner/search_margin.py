"""Plans beyond the memory margin, for autotuning to measure before it trusts them.

:func:`search_beyond_margin` searches as ``search.search_schedules`` does, but for the whole
memory limit rather than its plannable share (``Devices.memory_margin``), and adds the plans a
user writes by hand (``local_search.largest_first``); ``compile_osdp(autotune=K)`` times the
fastest K of those predicted faster than the searched plan, and keeps one only when it
measured under the limit and faster (``planner/autotune.py``).
"""

from __future__ import annotations

from typing import Any

from ..core.setting import StepSetting
from ..errors import PlanError
from .analysis import Analysis, plan_step_s, unmargined_limit
from .local_search import largest_first
from .results import Ranked
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
    at_batch = setting.at_batch(None)
    if setting.devices.world_size > 1:  # "shard the k largest" over one rank shards nothing
        found += largest_first(
            analysis, schedules,
            fits=lambda schedule, f: plan_peak_bytes(analysis, f.strategies, f.recompute,
                                                     at_batch.with_schedule(schedule))
            <= memory_limit_bytes,
            step_s=lambda schedule, f: plan_step_s(analysis, f.strategies, f.recompute,
                                                   at_batch.with_schedule(schedule)))
    distinct: dict[tuple[Any, ...], Ranked] = {}
    for f in sorted(found, key=lambda f: f.step_s):  # fastest first; a plan found twice, once
        distinct.setdefault((f.schedule, *sorted(f.found.strategies.items()),
                             *sorted(f.found.recompute.items())), f)
    return [f for f in distinct.values() if f.step_s < faster_than_s]

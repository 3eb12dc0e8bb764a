"""The schedule search: which prefetch distance and bucket sizes a searched plan runs with.

A plan's :class:`~osdp_fx.core.buckets.Schedule` (how far ahead all-gathers start, which small
sharded parameters share one all-gather and reduce-scatter, how large an all-reduce bucket of
replicated gradients is) changes both its step time (overlap, latency per collective:
``cost_models.step``, ``cost_models.overlap``) and its peak memory (gathered parameters held
ahead, flat bucket buffers: ``cost_models.timeline``). The search is exact over a small set:
for each candidate schedule (``buckets.candidate_schedules``) the strategy search runs with that
schedule's memory charged, and the plan with the least predicted step time that fits wins
(``search.search_schedules`` runs it; this module holds what needs no planner).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence

from ..core.buckets import Schedule, plan_buckets
from ..core.strategies import traits
from ..cost_models.graph_facts import (
    GraphFacts,
    ParamState,
    regathered_together,
    sharded_gather_buckets,
)
from ..errors import PlanError
from .results import Found, Ranked

log = logging.getLogger(__name__)


def collectives_key(facts: GraphFacts, states: Mapping[str, ParamState], schedule: Schedule,
                    world_size: int) -> Hashable:
    """What the runtime does under ``states`` and ``schedule``: the strategies, the gather
    buckets, which of them backward re-gathers whole, and the prefetch distance (when something
    is sharded), the all-reduce buckets. Two plans with the same key run the same collectives
    at the same points. How many gradient collectives may be in flight, which the step model
    does not see, is not part of it: of two such plans :func:`rank_schedules` keeps the first
    (``candidate_schedules`` lists ``MAX_IN_FLIGHT`` first)."""
    buckets = sharded_gather_buckets(facts, states, world_size, schedule.gather_bucket_bytes)
    gathers = tuple(tuple(facts.param_of[n] for n in b) for b in buckets)
    together = tuple(facts.param_of[b[0]] for b in regathered_together(
        facts, states, buckets, world_size, schedule.gather_bucket_bytes))
    replicated = [n for n, p in states.items() if not traits(p.strategy).sharded and p.trainable]
    reduces = plan_buckets([(states[n].element_size, states[n].numel * states[n].element_size)
                            for n in replicated[::-1]], schedule.reduce_bucket_bytes)
    return (tuple(p.strategy for p in states.values()), gathers, together,
            schedule.prefetch if gathers else 0, tuple(map(tuple, reduces)))


def rank_schedules(
    search: Callable[..., Found],
    score: Callable[[Schedule, Found], tuple[float, Hashable]],
    options: Sequence[tuple[Schedule, int]],
) -> list[Ranked]:
    """Run ``search(schedule=, memory_limit_bytes=)`` (a plan that fits, or PlanError) for
    every (schedule, limit) of ``options`` and ``score`` each result (predicted step seconds,
    :func:`collectives_key`): the plans found, fastest first, ties in the order of ``options``;
    plans with the same key appear once (the first). Raises the first PlanError when none
    fits."""
    found: dict[Hashable, tuple[float, int, Schedule, Found]] = {}
    error: PlanError | None = None
    for i, (schedule, limit) in enumerate(options):
        try:
            plan = search(schedule=schedule, memory_limit_bytes=limit)
        except PlanError as e:
            error = error or e
            continue
        seconds, key = score(schedule, plan)
        found.setdefault(key, (seconds, i, schedule, plan))
    if not found:
        assert error is not None, "no schedules to search"
        raise error
    ranked = sorted(found.values(), key=lambda f: f[:2])
    log.info("schedule search: %d distinct plans fit; chosen %s, predicted %.2f ms",
             len(ranked), ranked[0][2], ranked[0][0] * 1e3)
    return [Ranked(seconds, schedule, plan) for seconds, _, schedule, plan in ranked]

r"""The exact search on small plan spaces: every combination, scored by the cost models themselves.

The solver of ``planner/solver.py`` is exact for its separable model (a time, a persistent and a
transient memory per option), but a plan's predicted step time and peak are not separable: the
timeline's peak is a maximum over time of sums, a replicated gradient shares its all-reduce
bucket's latency with its neighbours, small sharded parameters share collectives, and
prefetching hides gathers under whatever computation surrounds them. Where the plan space is
small (at most :data:`EXACT_COMBINATIONS` combinations of one option per row), this module finds
the plan the models themselves rank fastest among those whose timeline peak fits:

.. math::

    \min_{c \in \prod_i O_i} \mathrm{step}(c)
    \quad \text{s.t.} \quad \mathrm{peak}(c) \le L ,

with ``step`` = ``cost_models.step.predict_step_time`` at the planned batch and ``peak`` =
``cost_models.timeline.predict_step_memory``, the functions a plan is predicted with. It is
branch-and-bound over a flat list: every combination gets a lower bound on its step time
(:func:`step_time_bounds`, vectorised over all combinations), combinations are scored in
increasing bound, the step time is computed only while the bound is below the best fitting time
found, and the peak only for combinations faster than it whose floor (:func:`peak_floor_bytes`:
what the optimizer step holds) fits. The bound holds because each term it
drops or shrinks can only add time: a group's communication is taken with the fewest re-gathers
(those recomputation adds are left out), the all-reduce latency as one latency for all buckets,
minus the latency a gather bucket can save, minus the most prefetching can hide
(``cost_models.overlap``: ``Devices.overlap_efficiency`` of the gathers, and no more than the
computation they hide under). ``tests/property/test_joint_search_exact.py`` checks both the
bound and the answer against brute force.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..core.setting import StepSetting
from ..core.layout import shard_count
from ..core.strategies import Strategy, traits
from ..cost_models.communication import all_reduce_parts_s
from ..cost_models.graph_facts import small_gather_key
from ..cost_models.memory import optimizer_state_bytes, shard_numel
from ..cost_models.overlap import gather_s, reduce_s
from ..cost_models.recompute import RegionCost
from ..cost_models.step import attributed_compute_s, bucket_latencies_s, group_cost
from ..cost_models.timeline import predict_peak_bytes
from .analysis import Analysis, param_state, param_states, plan_step_s
from .results import Found

EXACT_COMBINATIONS = 1024
"""Largest plan space (product of the rows' option counts) searched exactly."""

def plan_space(option_counts: Sequence[int]) -> int:
    """Number of combinations of one option per row."""
    return math.prod(option_counts)


@dataclasses.dataclass(frozen=True)
class _RowTerms:
    """Per row and option, the separable parts of the lower bound."""

    time_s: list[list[float]]
    """Communication (without all-reduce latency, re-gathers recomputation adds, or overlap)
    plus optimizer step, or a region's recomputed forward."""
    gather_s: list[list[float]]
    """Collective seconds overlap may hide: all-gathers prefetching may hide (forward, and
    backward's re-gather) and gradient collectives (``overlap.hidden_comm_s``), at most."""
    link_s: list[list[float]]
    """The seconds of those collectives on the step's replayed link, at most (a replicated
    gradient's with its share of its bucket's latency): what running them side by side can
    save ([Note: collectives together] in ``cost_models/overlap.py``) is a share of it."""
    all_reduced: list[list[bool]]
    """Whether the option all-reduces a gradient (then some bucket pays a latency)."""
    gather_key: list[list[tuple[str, int] | None]]
    """(gather bucket key, its gathers) of a small sharded option, None otherwise: of the small
    sharded parameters with one key, all but one may ride in another's collectives."""


def _row_terms(analysis: Analysis, options: Mapping[str, list[str]],
               regions: Mapping[str, list[RegionCost]], setting: StepSetting,
               scale: float) -> tuple[_RowTerms, float]:
    devices, schedule = setting.devices, setting.schedule
    facts = analysis.facts
    nodes_of: dict[str, int] = {}
    for name in facts.param_of.values():
        nodes_of[name] = nodes_of.get(name, 0) + 1
    # at most: its all-gathers, re-gathers and gradient collectives ride in another's, under
    # the sharded strategy whose stages save the most
    bucket_saving = max((sum(bucket_latencies_s(st.value, devices, again=True))
                         for st in Strategy if traits(st).sharded), default=0.0)
    prefetching = schedule.prefetch > 0 and devices.world_size > 1
    time, gathers, links, reduced, keys = [], [], [], [], []
    for name, strategies in options.items():
        t_row, g_row, l_row, r_row, k_row = [], [], [], [], []
        for strategy in strategies:
            state = param_state(analysis, name, strategy)
            # the largest all-reduce bucket (in reduce bytes) this gradient can share
            widest = schedule.reduce_bucket_bytes * max(1.0, state.reduce_size / state.element_size)
            cost = group_cost(state, regathered=name in analysis.regathered, compute_s=0.0,
                              devices=devices, optimizer=setting.optimizer,
                              reduce_bucket_bytes=int(math.ceil(widest)),
                              split_part=name in analysis.split_parts)
            comm, gathered, all_reduced, key = cost.comm_s, 0.0, False, None
            on_link = 0.0
            if traits(strategy).sharded:
                if prefetching:
                    gathered = (gather_s(state, devices, regathered=True).total_s
                                * nodes_of.get(name, 1))
                gathered += reduce_s(state, devices) * nodes_of.get(name, 1)
                on_link = gathered
                key = small_gather_key(state, devices.world_size, schedule.gather_bucket_bytes)
            elif state.trainable and devices.world_size > 1:
                gathered = on_link = comm  # its all-reduce may run under backward's computation
                # its latency share is counted once per bucket, in exhaustive_search's bound
                full, bucket = state.numel * state.reduce_size, int(math.ceil(widest))
                _, latency = all_reduce_parts_s(max(full, bucket), devices)
                comm -= latency * min(1.0, full / bucket)
                all_reduced = True
            t_row.append(comm + cost.optim_s + cost.host_s)
            g_row.append(gathered)
            l_row.append(on_link)
            r_row.append(all_reduced)
            k_row.append(None if key is None else (key, nodes_of.get(name, 1)))
        time.append(t_row)
        gathers.append(g_row)
        links.append(l_row)
        reduced.append(r_row)
        keys.append(k_row)
    for opts in regions.values():
        time.append([o.recompute_s * scale for o in opts])
        gathers.append([0.0] * len(opts))
        links.append([0.0] * len(opts))
        reduced.append([False] * len(opts))
        keys.append([None] * len(opts))
    return _RowTerms(time, gathers, links, reduced, keys), bucket_saving


def step_time_bounds(analysis: Analysis, options: Mapping[str, list[str]],
                     regions: Mapping[str, list[RegionCost]], setting: StepSetting, *,
                     scale: float) -> np.ndarray:
    """A lower bound on the predicted step time of every combination (flat, row-major over
    the groups of ``options`` then the ``regions``, options in order)::

        bound = compute * scale + sum_i time_i + L
                - e * min(sum_i overlappable_i + L, compute)
                - 2 (1 - r) (sum_i on_link_i + L)

    where ``L`` is one all-reduce latency if some option all-reduces. Overlap hides at most
    ``e`` (``Devices.overlap_efficiency``) of the gathers prefetching starts early and of the
    gradient collectives, and no more than the computation they overlap
    (``overlap.hidden_comm_s`` replays the profiled step); the latency shares of the
    gradients in one all-reduce bucket add up to one latency; of the
    sharded parameters with one gather key, all but one may save two gathers' and a
    reduce-scatter's latency by riding in another's bucket; collectives in flight together
    save at most 2 (1 - r) of their seconds on the link (``r``:
    ``Devices.least_concurrent_ratio``, [Note: collectives together])."""
    devices = setting.devices
    terms, bucket_saving = _row_terms(analysis, options, regions, setting, scale)
    per_group, other_s = attributed_compute_s(analysis.facts, devices)
    compute = other_s + sum(per_group.values())
    time, gathered, on_link = np.zeros(1), np.zeros(1), np.zeros(1)
    reduced = np.zeros(1, dtype=bool)
    distinct = {k[0] for row in terms.gather_key for k in row if k is not None}
    small = {k: np.zeros(1) for k in distinct}  # small sharded parameters per bucket key
    for i, (t, g, r) in enumerate(zip(terms.time_s, terms.gather_s, terms.all_reduced)):
        time = np.add.outer(time, np.asarray(t)).reshape(-1)
        gathered = np.add.outer(gathered, np.asarray(g)).reshape(-1)
        on_link = np.add.outer(on_link, np.asarray(terms.link_s[i])).reshape(-1)
        reduced = np.logical_or.outer(reduced, np.asarray(r)).reshape(-1)
        for k in distinct:
            small[k] = np.add.outer(small[k], [o[1] if o and o[0] == k else 0.0
                                               for o in terms.gather_key[i]]).reshape(-1)
    for count in small.values():
        time -= bucket_saving * np.maximum(0.0, count - 1)
    _, latency = all_reduce_parts_s(0, devices)  # the least latency of an all-reduce
    together = 2.0 * (1.0 - devices.least_concurrent_ratio)
    return (compute * scale + time + latency * reduced
            - devices.overlap_efficiency * np.minimum(gathered + latency * reduced, compute)
            - together * (on_link + latency * reduced))


def peak_floor_bytes(analysis: Analysis, options: Mapping[str, list[str]],
                     regions: Mapping[str, list[RegionCost]], setting: StepSetting, *,
                     scale: float = 1.0) -> np.ndarray:
    """A lower bound on the predicted peak of every combination (flat, as
    :func:`step_time_bounds`), the larger of two moments of a steady-state step: the optimizer
    step, where every group holds its local parameter and, when trainable, its local gradient
    and optimizer state; and the turn from forward to backward, where every group holds its
    local parameter and optimizer state and every region what its policy keeps (``scale``: the
    planned over the profiled batch)."""
    devices = setting.devices
    at_step, at_turn = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    for name, strategies in options.items():
        step_row, turn_row = [], []
        for strategy in strategies:
            state = param_state(analysis, name, strategy)
            local_numel = shard_numel(state.numel, shard_count(strategy, devices.world_size,
                                                              devices.ranks_per_node),
                                      state.row)
            local = local_numel * state.element_size
            state_bytes = optimizer_state_bytes(local_numel, optimizer=setting.optimizer)
            step_row.append(local + (local + state_bytes if state.trainable else 0))
            turn_row.append(local + (state_bytes if state.trainable else 0))
        at_step = np.add.outer(at_step, np.asarray(step_row, dtype=np.int64)).reshape(-1)
        at_turn = np.add.outer(at_turn, np.asarray(turn_row, dtype=np.int64)).reshape(-1)
    for opts in regions.values():
        at_step = np.add.outer(at_step, np.zeros(len(opts), dtype=np.int64)).reshape(-1)
        kept = [int(o.kept_bytes * scale) for o in opts]
        at_turn = np.add.outer(at_turn, np.asarray(kept, dtype=np.int64)).reshape(-1)
    return np.maximum(at_step, at_turn)


def _unravel(flat: int, shape: list[int]) -> list[int]:
    """The index of each dimension of entry ``flat`` of a C-ordered array of ``shape`` (as
    ``np.unravel_index``, which stops at 64 dimensions: a model has a dimension per group)."""
    index = []
    for n in reversed(shape):
        flat, j = divmod(flat, n)
        index.append(j)
    return index[::-1]


def exhaustive_search(
    analysis: Analysis, options: Mapping[str, list[str]],
    regions: Mapping[str, list[RegionCost]], setting: StepSetting, *, target_bytes: int,
) -> Found | None:
    """The (strategies, recomputed regions) with the least predicted step time in a step as
    ``setting`` says (at its batch size; None: the planned one) whose predicted peak fits
    ``target_bytes``, over every combination of ``options`` (per group) and the ``regions``'
    policies; None when none fits. Ties: the earliest combination in the order of the rows and
    options."""
    batch_size = setting.batch_size or analysis.plan_batch
    scale = analysis.batch_scale(batch_size)
    bounds = step_time_bounds(analysis, options, regions, setting, scale=scale)
    floors = peak_floor_bytes(analysis, options, regions, setting, scale=scale)
    names, region_names = list(options), list(regions)
    order = np.argsort(bounds, kind="stable")
    order = order[floors[order] <= target_bytes]
    shape = [len(o) for o in options.values()] + [len(o) for o in regions.values()]
    best: tuple[float, Found] | None = None
    for flat in order:
        if best is not None and bounds[flat] > best[0]:
            break  # every remaining combination's bound is above the best fitting time
        choice = _unravel(int(flat), shape)
        strategies = {n: options[n][j] for n, j in zip(names, choice)}
        recompute = {r: regions[r][j].policy
                     for r, j in zip(region_names, choice[len(names):]) if j}
        seconds = plan_step_s(analysis, strategies, recompute, setting.at_batch(batch_size))
        assert seconds >= bounds[flat] - 1e-9 * abs(seconds), (
            "the exact search's lower bound exceeds the step time it bounds",
            strategies, recompute, seconds, bounds[flat])
        if best is not None and seconds >= best[0]:
            continue
        peak = predict_peak_bytes(
            analysis.captured.gm, param_states(analysis, strategies), analysis.facts,
            setting=setting.at_batch(batch_size), profiled_batch=analysis.batch_size,
            seq_scale=analysis.seq_scale(), recompute=recompute)
        if peak <= target_bytes:
            best = (seconds, Found(strategies, recompute))
    return None if best is None else best[1]

"""The searches: which linears to split, the per-rank batch size, and the plan itself.

:func:`search_strategies` (and :func:`search_plan`, which adds recomputation) chooses a strategy
per parameter group that minimises the predicted step time under a memory limit: it builds each
group's options from ``cost_models.step``, solves the exact problem of ``solver`` with the
activation memory as its base, checks the answer against the timeline's peak, and tightens the
limit by any excess until the timeline agrees (the search's separable memory model is an
approximation of the timeline). :func:`search_schedules` runs it under each candidate schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import fx

from ..core.buckets import DEFAULT_BUCKET_BYTES, Schedule, candidate_schedules
from ..core.setting import StepSetting
from ..core.layout import row_numel
from ..core.node_meta import NodeRole, osdp_meta
from ..core.strategies import (
    FULL_SHARD,
    REPLICATE,
    STRATEGIES,
    searched_strategies,
    traits,
)
from ..cost_models.graph_facts import ParamState
from ..cost_models.memory import gathered_param_bytes
from ..cost_models.overlap import GatherWindow, gather_windows, hidden_share_s
from ..cost_models.recompute import RegionCost, region_costs
from ..cost_models.step import GroupCost
from ..cost_models.timeline import predict_peak_bytes
from ..errors import InputError, PlanError
from ..passes.split_linear import SPLIT_FACTORS, linear_sites
from ..units import format_bytes
from .analysis import (
    Analysis,
    candidate_key,
    param_state,
    param_states,
    plan_step_s,
    plannable_bytes,
    search_cost,
)
from .exhaustive import EXACT_COMBINATIONS, exhaustive_search, plan_space
from .local_search import refine
from .results import BatchChoice, Found, Ranked
from .schedule_search import collectives_key, rank_schedules
from .solver import solve_min_time

log = logging.getLogger(__name__)

_MAX_TIGHTENINGS = 8


@dataclasses.dataclass(frozen=True)
class _Solved:
    """The exact problem's answer at one limit (:func:`_search`), checked by the timeline."""

    found: Found
    """The plan it chose."""
    peak_bytes: int
    """The timeline's predicted peak of the plan."""
    model_peak_bytes: int
    """The exact problem's own (separable) peak of the plan."""


@dataclasses.dataclass(frozen=True)
class _SplitOption:
    """One option of a group in :func:`choose_splits`' problem."""

    parts: int
    """k: the parts the weight is split into (1: not split)."""
    time_s: float
    """Communication and optimizer seconds of its parts."""
    persistent_bytes: int
    transient_bytes: int


def choose_splits(analysis: Analysis, setting: StepSetting,
                  memory_limit_bytes: int) -> dict[str, int]:
    """Which linear weights to split into how many parts (k in 2, 4, 8).

    Every splittable weight gets the options k = 1 (its three strategies) and, for each k, "j of
    the k parts full_shard, the others replicated" (j = 0..k): j sets the memory between
    replicate and full_shard, k the transient memory (one part's gathered weight at a time)
    against the latency of k collectives. Other groups keep their strategies as options. The
    same exact solver as the strategy search picks one option per group; the strategies of the
    parts are then searched again on the split graph.
    """
    devices = setting.devices
    names = list(analysis.captured.params)
    sites = linear_sites(analysis.captured.gm)
    # What the timeline's peak holds besides: gloo copies a gradient it reduce-scatters at the
    # launch while the one before may still be in flight (a gradient more), and a replicated
    # gradient is copied into its all-reduce bucket.
    copies = devices.reduce_scatter_copies_input

    def transient_of(c: GroupCost, state: ParamState) -> int:
        grad = state.numel * state.reduce_size if state.trainable else 0
        if traits(c.strategy).sharded:
            # in mixed precision the gradient cast to the reduce dtype joins the gathered
            # weight and its gradient in the compute dtype
            cast = grad if state.reduce_size != state.compute_size else 0
            return c.transient_bytes + cast + (grad if copies else 0)
        return max(c.transient_bytes, min(grad, DEFAULT_BUCKET_BYTES) if devices.world_size > 1
                   else 0)

    times, persistent, transient, labels = [], [], [], []
    for n in names:
        info = analysis.captured.params[n]
        strategies = searched_strategies(devices.num_nodes)
        costs = [search_cost(analysis, n, param_state(analysis, n, st), setting)
                 for st in strategies]
        options = [_SplitOption(1, c.strategy_s, c.persistent_bytes,
                                transient_of(c, param_state(analysis, n, c.strategy)))
                   for c in costs]
        site = sites.get(n)
        if site is not None and info.trainable:
            summed = _summed_input_grad_bytes(analysis, site.node)
            for k in SPLIT_FACTORS:
                if k > site.out_features:
                    break
                part = dataclasses.replace(param_state(analysis, n, REPLICATE), numel=info.numel // k)
                rep, full = (search_cost(analysis, n, dataclasses.replace(part, strategy=st),
                                         setting, split_part=True)
                             for st in (REPLICATE, FULL_SHARD))
                for j in range(k + 1):
                    options.append(_SplitOption(
                        k, j * full.strategy_s + (k - j) * rep.strategy_s,
                        j * full.persistent_bytes + (k - j) * rep.persistent_bytes,
                        max(transient_of(full, part) if j else 0,
                            transient_of(rep, part) if j < k else 0, summed)))
        labels.append([o.parts for o in options])
        times.append([o.time_s for o in options])
        persistent.append([o.persistent_bytes for o in options])
        transient.append([o.transient_bytes for o in options])
    peak, _ = _activation_base(analysis, setting.at_batch(None))
    # the base of these options: the most sharded plan's peak less what they account for
    # (the options of k = 1 come first, in the order of the strategies searched)
    lowest = searched_strategies(devices.num_nodes).index(FULL_SHARD)
    base = max(0, peak - sum(p[lowest] for p in persistent)
               - max((t[lowest] for t in transient), default=0))
    try:
        result = solve_min_time(times, persistent, transient,
                                limit_bytes=plannable_bytes(memory_limit_bytes,
                                                            devices.memory_margin),
                                base_bytes=base, names=names)
    except PlanError:
        return {}  # the strategy search reports what does not fit
    chosen = {n: labels[i][j] for i, (n, j) in enumerate(zip(names, result.choices))}
    return {n: k for n, k in chosen.items() if k > 1}


def _summed_input_grad_bytes(analysis: Analysis, linear: fx.Node) -> int:
    """What splitting ``linear`` adds in backward: its parts all read its input, whose gradient
    is then summed out of place (a part's contribution and the sum, on top of the gradient so
    far: ``graph_facts.activation_grad_intervals``)."""
    facts = analysis.facts
    inputs = [n for n in linear.all_input_nodes  # activations, not a parameter or its cast
              if n not in facts.param_of and osdp_meta(n).role != NodeRole.CAST]
    return max((2 * facts.profile[n].output_bytes for n in inputs if facts.requires_grad[n]),
               default=0)


def search_batch_size(analysis: Analysis, batch_sizes: Sequence[int], setting: StepSetting,
                      memory_limit_bytes: int) -> BatchChoice:
    """The per-rank batch size among ``batch_sizes`` and the strategies that maximise predicted
    samples per second (``b * N / step_time(b)``) within the memory limit, under ``setting``'s
    schedule."""
    best: tuple[float, BatchChoice] | None = None
    for b in sorted(set(batch_sizes)):
        if not isinstance(b, int) or b < 1:
            raise InputError(f"batch_sizes must be positive ints, got {b!r}")
        at_b = setting.at_batch(b)
        try:
            strategies = search_strategies(analysis, at_b, memory_limit_bytes)
        except PlanError:
            continue
        step_s = plan_step_s(analysis, strategies, {}, at_b)
        samples_per_s = b * setting.devices.world_size / step_s
        log.info("batch %d: %.1f samples/s predicted", b, samples_per_s)
        if best is None or samples_per_s > best[0]:
            best = (samples_per_s, BatchChoice(b, strategies))
    if best is None:
        raise PlanError(
            f"no plan fits the memory limit of {format_bytes(memory_limit_bytes)} per rank at any "
            f"of the batch sizes {sorted(set(batch_sizes))}: try smaller batch sizes, more "
            "ranks or a larger limit")
    return best[1]


def _activation_base(analysis: Analysis, setting: StepSetting,
                     regions: Mapping[str, list[RegionCost]] | None = None,
                     fixed: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(peak of the most sharded plan, every region in ``regions`` fully recomputed; the
    search's base memory): that peak minus what the search itself accounts for (persistent and
    largest transient bytes), i.e. activations outside the regions."""
    lowest = {n: FULL_SHARD if setting.devices.world_size > 1 else REPLICATE
              for n in analysis.captured.params} | dict(fixed or {})
    full = {r: opts[-1] for r, opts in (regions or {}).items()}
    peak = plan_peak_bytes(analysis, lowest, {r: o.policy for r, o in full.items()}, setting)
    costs = [search_cost(analysis, n, param_state(analysis, n, st), setting)
             for n, st in lowest.items()]
    scale = analysis.batch_scale(setting.batch_size)
    transient = max([c.transient_bytes for c in costs]
                    + [int(o.recomputed_bytes * scale) for o in full.values()], default=0)
    return peak, max(0, peak - sum(c.persistent_bytes for c in costs) - transient
                     - sum(int(o.kept_bytes * scale) for o in full.values()))


def search_strategies(analysis: Analysis, setting: StepSetting,
                      memory_limit_bytes: int) -> dict[str, str]:
    """The per-group strategies with the least predicted step time whose predicted peak memory
    (timeline, of a step as ``setting`` says: its batch size, micro-batches and schedule) fits
    ``memory_limit_bytes``, recomputing nothing. Raises PlanError when none does."""
    return _search(analysis, {}, setting, memory_limit_bytes).strategies


def search_plan(analysis: Analysis, setting: StepSetting, memory_limit_bytes: int,
                regions: Mapping[str, list[RegionCost]] | None = None, **kw: Any) -> Found:
    """The plan (strategies, recomputed regions) with the least predicted step time that fits
    (``kw``: the options of :func:`_search`): the joint search, which also chooses per region to
    save, recompute selectively or recompute fully (``docs/recomputation.md``), is taken when
    it is predicted faster or when nothing fits without it. ``regions``: the regions' options
    (``region_costs``; computed when not given)."""
    if regions is None:
        regions = region_costs(analysis.facts, setting.devices)
    try:
        alone = _search(analysis, {}, setting, memory_limit_bytes, **kw)
    except PlanError:
        if not regions:
            raise
        return _search(analysis, regions, setting, memory_limit_bytes, **kw)
    try:
        joint = _search(analysis, regions, setting, memory_limit_bytes, **kw) if regions else alone
    except PlanError:
        return alone

    def time_s(found: Found) -> float:
        return plan_step_s(analysis, found.strategies, found.recompute, setting)

    return joint if joint.recompute and time_s(joint) < time_s(alone) else alone


@dataclasses.dataclass(frozen=True)
class _Row:
    """One row of the exact problem (a parameter group or a region): per option, its time,
    persistent and transient bytes (``solver.solve_min_time``)."""

    time_s: list[float]
    persistent_bytes: list[int]
    transient_bytes: list[int]


def _problem_rows(
    analysis: Analysis, options: Mapping[str, list[str]],
    regions: Mapping[str, list[RegionCost]], setting: StepSetting,
    cost_tables: dict[int, dict[str, list[GroupCost]]],
) -> list[_Row]:
    """The exact problem's rows: each group's ``options`` (communication and optimizer time
    less what prefetching hides, costs computed once per all-reduce bucket size in
    ``cost_tables``), then each region's policies at the planned batch."""
    schedule = setting.schedule
    table = cost_tables.get(schedule.reduce_bucket_bytes)
    if table is None:
        table = cost_tables[schedule.reduce_bucket_bytes] = {
            n: [search_cost(analysis, n, param_state(analysis, n, s), setting,
                            reduce_bucket_bytes=schedule.reduce_bucket_bytes)
                for s in strategies]
            for n, strategies in options.items()
        }
    scale = analysis.batch_scale(setting.batch_size)
    hidden = _hidden_shares(analysis, options, setting, scale=scale)
    rows = [_Row([c.strategy_s - h for c, h in zip(table[n], hidden[n])],
                 [c.persistent_bytes for c in table[n]],
                 [c.transient_bytes for c in table[n]]) for n in options]
    rows += [_Row([o.recompute_s * scale for o in opts], [int(o.kept_bytes * scale) for o in opts],
                  [int(o.recomputed_bytes * scale) for o in opts]) for opts in regions.values()]
    return rows


def _tighten(solve: Callable[[int], _Solved | None], target: int,
             base: int) -> tuple[_Solved | None, int]:
    """Solve the exact problem at ``target`` and, while the timeline's peak of its answer
    exceeds ``target``, again at a limit lowered by the excess (at most
    :data:`_MAX_TIGHTENINGS` times, and not down to the ``base`` bytes): the first answer that
    fits, or None, and the limit it was solved at."""
    limit = target
    for _ in range(_MAX_TIGHTENINGS):
        solved = solve(limit)
        if solved is None:
            break
        if solved.peak_bytes <= target:
            return solved, limit
        limit -= solved.peak_bytes - target
        if limit <= base:
            break
    return None, limit


def _search(
    analysis: Analysis, regions: Mapping[str, list[RegionCost]], setting: StepSetting,
    memory_limit_bytes: int, *, cost_tables: dict[int, dict[str, list[GroupCost]]] | None = None,
    loosen: bool = True, fixed: Mapping[str, str] | None = None,
) -> Found:
    """One exact search over the parameter groups' strategies (but those ``fixed`` names, which
    keep the strategy it gives) and, as more rows of the same
    problem, the ``regions``' policies (time: the recomputed forward; persistent: what the
    region keeps to backward; transient: what its recomputation re-creates), of a step as
    ``setting`` says (its schedule's memory charged). ``cost_tables``: the groups' costs by all-reduce bucket
    size, filled and reused across the searches of one ``search_schedules``. ``loosen``: also
    try the exact problem at looser limits that the timeline still fits (:func:`_loosen`)."""
    devices = setting.devices
    names = list(analysis.captured.params)
    sharding_helps = devices.world_size > 1
    options = {n: searched_strategies(devices.num_nodes) if sharding_helps
               else [REPLICATE] for n in names} | {n: [s] for n, s in (fixed or {}).items()}
    rows = _problem_rows(analysis, options, regions, setting,
                         {} if cost_tables is None else cost_tables)
    lowest_peak, base = _activation_base(analysis, setting, regions, fixed)
    target = plannable_bytes(memory_limit_bytes, devices.memory_margin)
    if plan_space([len(r.time_s) for r in rows]) <= EXACT_COMBINATIONS:
        found = exhaustive_search(analysis, options, regions, setting, target_bytes=target)
        if found is not None:
            return found
        raise PlanError(_no_plan_message(memory_limit_bytes, target, lowest_peak, base, regions))

    def solve(limit: int) -> _Solved | None:
        """The exact problem's answer at its ``limit``, with its timeline peak."""
        try:
            result = solve_min_time([r.time_s for r in rows], [r.persistent_bytes for r in rows],
                                    [r.transient_bytes for r in rows], limit_bytes=limit,
                                    base_bytes=base, names=[*names, *regions])
        except PlanError:  # rounding, near the most sharded plan's peak: see below
            return None
        strategies = {n: options[n][j] for n, j in zip(names, result.choices)}
        recompute = {r: opts[j].policy for (r, opts), j in
                     zip(regions.items(), result.choices[len(names):]) if j}
        peak = plan_peak_bytes(analysis, strategies, recompute, setting)
        return _Solved(Found(strategies, recompute), peak, result.peak_bytes)

    fit, limit = _tighten(solve, target, base)
    if fit is not None:
        found = fit.found if not loosen else _loosen(
            fit, limit, target, solve,
            lambda f: plan_step_s(analysis, f.strategies, f.recompute, setting))
        counts = ", ".join(f"{n} {s}" for s in STRATEGIES
                           if (n := sum(v == s for v in found.strategies.values())))
        log.debug("search candidate: %s, %d regions recomputed, limit %s", counts,
                  len(found.recompute), format_bytes(memory_limit_bytes))
        return found
    if lowest_peak <= target:  # the tightening gave up, but the most sharded plan fits
        return Found({n: FULL_SHARD if sharding_helps else REPLICATE for n in names}
                     | dict(fixed or {}),
                     {r: opts[-1].policy for r, opts in regions.items()})
    raise PlanError(_no_plan_message(memory_limit_bytes, target, lowest_peak, base, regions))


_MAX_LOOSENINGS = 4
LOOSENED_SCHEDULES = 3
"""``search_schedules`` loosens the searches of the schedules whose plans rank first."""
TIGHTENED_SHARES = (0.95, 0.9)
"""... and searches them again at these shares of the limit: the exact problem ranks plans by
a separable step time, so the plan it picks at the limit can be slower, by the step model, than
one it picks under a tighter limit, which shards more (``benchmarks/recompute.py`` shows such a
GPT)."""


def _loosen(fit: _Solved, limit: int, target: int, solve: Callable[[int], _Solved | None],
            step_s: Callable[[Found], float]) -> Found:
    """The fastest plan (``step_s``) of the exact problem solved at ``limit`` (its answer
    ``fit``) and at looser limits whose answers the timeline still fits in ``target``.

    The exact problem's memory is separable (persistent bytes per group, the largest
    transient, activations as a constant) and can overestimate the timeline's peak of a plan
    (the most for plans that shard the largest groups with shard_grad_op): its answer then
    leaves memory unused that a faster plan would fill. So
    raise its limit by what it overestimates plus the timeline's slack, and bisect back where
    the timeline does not fit; at most :data:`_MAX_LOOSENINGS` more solves."""
    best, peak, model_peak = fit.found, fit.peak_bytes, fit.model_peak_bytes
    best_s, lo, hi = step_s(best), limit, None
    for _ in range(_MAX_LOOSENINGS):
        trial = model_peak + (target - peak) if hi is None else (lo + hi) // 2
        if trial - lo <= target // 100:
            break
        solved = solve(trial)
        if solved is None:
            break
        if solved.peak_bytes > target:
            hi = trial
            continue
        lo, peak, model_peak = trial, solved.peak_bytes, solved.model_peak_bytes
        if (s := step_s(solved.found)) < best_s:
            best, best_s = solved.found, s
    return best


def plan_peak_bytes(analysis: Analysis, strategies: Mapping[str, str],
                    recompute: Mapping[str, str], setting: StepSetting) -> int:
    """The timeline's predicted peak of one candidate plan in a step as ``setting`` says,
    predicted once per analysis (``Analysis.peaks``)."""
    batch = setting.batch_size or analysis.plan_batch
    key = candidate_key(analysis, strategies, recompute, setting.schedule) + (
        setting.devices, setting.optimizer, batch, setting.grad_accumulation)
    peak = analysis.peaks.get(key)
    if peak is None:
        peak = analysis.peaks[key] = predict_peak_bytes(
            analysis.captured.gm, param_states(analysis, strategies), analysis.facts,
            setting=setting.at_batch(batch), profiled_batch=analysis.batch_size,
            seq_scale=analysis.seq_scale(), recompute=recompute)
    return peak


def _hidden_shares(analysis: Analysis, options: Mapping[str, list[str]], setting: StepSetting,
                   *, scale: float) -> dict[str, list[float]]:
    """Per group and option, the gather seconds prefetching hides (``overlap.gather_windows``):
    the exact problem then weighs a sharded group's collectives as the step model does, less
    what the computation around it hides, and not at their full time."""
    devices = setting.devices
    windows = gather_windows(analysis.facts, devices, prefetch=setting.schedule.prefetch)
    out = {}
    for n, opts in options.items():
        w = windows.get(n, GatherWindow())
        out[n] = [hidden_share_s(param_state(analysis, n, s), w.scaled(scale), devices,
                                 regathered=n in analysis.regathered) for s in opts]
    return out


def _no_plan_message(memory_limit_bytes: int, target: int, lowest_peak: int, base: int,
                     regions: Mapping[str, list[RegionCost]]) -> str:
    return (
        f"no plan fits the memory limit of {format_bytes(memory_limit_bytes)} per rank (the "
        f"search plans for {format_bytes(target)}, keeping {1 - target / memory_limit_bytes:.0%}"
        f" for what the memory model does not predict): even with every parameter group "
        f"sharded (full_shard)"
        f"{' and every region recomputed' if regions else ''} a step needs "
        f"{format_bytes(lowest_peak)} ({format_bytes(lowest_peak - base)} "
        f"parameters, gradients and optimizer state, the rest activations). Raise the memory "
        f"limit, use more ranks, or use a smaller batch"
    )


def search_schedules(
    analysis: Analysis, setting: StepSetting, memory_limit_bytes: int, *,
    vary_prefetch: bool = True, alternatives: bool = False, recompute: bool = True,
) -> list[Ranked]:
    """:func:`search_plan` under each of ``candidate_schedules`` (``vary_prefetch`` False: at
    ``setting.schedule``'s prefetch distance only; ``alternatives``: also at 90 and 80 % of the
    limit): plans that fit, fastest first (``rank_schedules``). ``recompute`` False: no region
    is offered for recomputation. The step is at the batch the analysis plans for."""
    setting = setting.at_batch(None)
    devices = setting.devices
    shares = (1.0, 0.9, 0.8) if alternatives else (1.0,)
    schedules = candidate_schedules(None if vary_prefetch else setting.schedule.prefetch,
                                    block_gather_bytes(analysis, devices.world_size))
    options = [(sch, int(memory_limit_bytes * f)) for f in shares for sch in schedules]
    regions = region_costs(analysis.facts, devices) if recompute else {}
    cost_tables: dict[int, dict[str, list[GroupCost]]] = {}

    def search(*, schedule: Schedule, memory_limit_bytes: int, loosen: bool = True) -> Found:
        return search_plan(analysis, setting.with_schedule(schedule), memory_limit_bytes,
                           regions, cost_tables=cost_tables, loosen=loosen)

    def score(schedule: Schedule, found: Found) -> tuple[float, Any]:
        states = param_states(analysis, found.strategies)
        return (plan_step_s(analysis, found.strategies, found.recompute,
                            setting.with_schedule(schedule)),
                (collectives_key(analysis.facts, states, schedule, devices.world_size),
                 tuple(sorted(found.recompute.items()))))

    # Every schedule is searched without loosening (each loosening solves the problem up to
    # _MAX_LOOSENINGS more times); the fastest few are searched again with it.
    ranked = rank_schedules(functools.partial(search, loosen=False), score, options)
    loosened = []
    for schedule in dict.fromkeys(r.schedule for r in ranked[:LOOSENED_SCHEDULES]):
        found = search(schedule=schedule, memory_limit_bytes=memory_limit_bytes)
        loosened.append(Ranked(score(schedule, found)[0], schedule, found))
        for share in TIGHTENED_SHARES:  # the exact problem's time is separable, the step's not
            try:
                found = search(schedule=schedule, loosen=False,
                               memory_limit_bytes=int(memory_limit_bytes * share))
            except PlanError:
                break
            loosened.append(Ranked(score(schedule, found)[0], schedule, found))
    best = sorted([r for r in loosened if r.step_s < ranked[0].step_s],
                  key=lambda r: r.step_s) + ranked
    target = plannable_bytes(memory_limit_bytes, devices.memory_margin)
    return refine(  # the uniform plans and changes of the largest groups, by the models
        best, analysis=analysis, setting=setting, schedules=schedules,
        step_s=lambda s, f: score(s, f)[0],
        fits=lambda s, f: plan_peak_bytes(analysis, f.strategies, f.recompute,
                                          setting.with_schedule(s)) <= target)


def block_gather_bytes(analysis: Analysis, world_size: int) -> int | None:
    """The most bytes the parameters one recomputable region (a transformer block) reads take
    gathered (padded shards, as buckets count them): a gather bucket of this size gathers about
    one block per all-gather. None when the graph has no regions. A parameter read through its
    cast to the compute dtype (mixed precision) counts as read."""
    gm = analysis.captured.gm
    names = set(analysis.captured.params)

    def param(node: fx.Node) -> fx.Node:
        return node.args[0] if osdp_meta(node).role == NodeRole.CAST else node  # type: ignore[return-value]

    sizes = []
    for ops in analysis.facts.regions.values():
        read = {gm.get_parameter(a.target) for op in ops for a in map(param, op.all_input_nodes)
                if a.op == "get_attr" and a.target in names}
        sizes.append(sum(gathered_param_bytes(p.numel(), element_size=p.element_size(),
                                              world_size=world_size, row=row_numel(p.shape))
                         for p in read))
    return max(sizes, default=None) or None

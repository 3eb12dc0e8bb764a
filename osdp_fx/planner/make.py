"""Planning: the one entry that ``compile_osdp`` and ``python -m osdp_fx plan`` call.

:func:`plan_model` takes the captured model, the user's ``plan=`` (parsed once,
``plan/request.py``), what a step is (:class:`~osdp_fx.core.setting.StepSetting`) and what the
search may vary (:class:`SearchOptions`), and returns the plan in force with its predictions:

1. :func:`analyze` profiles the normalised graph, cast first to the compute precision when
   there is one (``CastParams``; on the meta device or under ``fake=True`` without running
   it), and derives its storage and gradient facts; it profiles again only after the search
   splits a linear, the split graph computing in the time measured for the unsplit one
   ([Note: the split graph's computation]);
2. a named plan (a strategy, a Plan, a plan file) is resolved against the model
   (:func:`resolve_named`), or the searches of ``planner/search.py`` choose the splits, the
   batch size, and per parameter group a strategy (with the recomputed regions and the
   schedule) that minimises the predicted step time under the memory limit;
3. :func:`predict` attaches to the Plan the step time and the peak memory per rank that the
   cost models predict (``cost_models.step``, ``cost_models.timeline``).

``planner/analysis.py`` holds :class:`Analysis` and :func:`analyze`; this module composes them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from ..core.buckets import LARGE_GATHER_BUCKET_BYTES, Schedule
from ..core.devices import Devices
from ..core.precision import dtype_name
from ..core.setting import StepSetting
from ..core.strategies import traits
from ..cost_models.recompute import recomputed_params, region_rows, region_spans
from ..cost_models.shapes import peak_in_seq, sequence_points
from ..cost_models.timeline import (
    MemoryPrediction,
    predict_memory_lines,
    predict_step_memory,
)
from ..passes.capture import Captured
from ..passes.pipeline import run_pipeline
from ..passes.precision import CastParams
from ..passes.profile import summarize_profile
from ..passes.split_linear import apply_splits, weight_splits
from ..plan.plan import Plan, Prediction
from ..plan.request import PlanRequest, PlanSpec, build_plan, resolve_plan
from .analysis import Analysis, analyze, param_specs, param_states, plan_step, plan_step_s
from .search import (
    block_gather_bytes,
    choose_splits,
    plan_peak_bytes,
    search_batch_size,
    search_schedules,
)
from .search_margin import search_beyond_margin

log = logging.getLogger(__name__)

Decide = Callable[[Callable[[], Any]], Any]
"""Runs a searched choice and gives it to every rank (``compile_osdp``'s runs it on rank 0
alone and broadcasts the result, or its error); planning in one process just calls it."""


def _here(choose: Callable[[], Any]) -> Any:
    return choose()


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """What the planner may vary or how it profiles, besides the step itself (the meaning of
    each is that of ``compile_osdp``'s argument of the same name)."""

    batch_sizes: tuple[int, ...] | None = None
    """Candidate per-rank batch sizes for the search; None: the example's."""
    split: bool = True
    """Whether the search may split large linears into sub-linears."""
    recompute: bool = True
    """Whether the search may recompute regions in backward."""
    vary_prefetch: bool = True
    """Whether the search may choose the prefetch distance; False: the user fixed it
    (``StepSetting.schedule.prefetch``), and a named plan takes it too."""
    candidates: int = 1
    """How many plans to return for autotuning: the plan in force, then the alternatives."""
    max_shape: tuple[int, int | None] | None = None
    """The largest per-rank (batch, sequence length) to plan for; None: the example's."""
    fake: bool = False
    """Profile under fake tensors (FLOPs and bytes only) instead of running the graph."""


@dataclasses.dataclass(frozen=True)
class Planned:
    """What planning a model returns: the plan in force, the alternatives autotuning may
    measure (``SearchOptions.candidates`` > 1), the analysis they were predicted from (for
    predicting other plans of the same model, as ``python -m osdp_fx plan`` compares), and the
    step they were planned for (its devices measured, when ``plan_model`` was asked to)."""

    plan: Plan
    alternatives: tuple[Plan, ...]
    analysis: Analysis
    setting: StepSetting


def plan_model(captured: Captured, example_inputs: tuple[Any, ...], plan: PlanSpec,
               setting: StepSetting, options: SearchOptions = SearchOptions(), *,
               decide: Decide = _here,
               measure: Callable[[Devices], Devices] | None = None) -> Planned:
    """The plan of ``plan`` (the user's ``plan=``, or its :class:`PlanRequest`) for the captured
    model in a step as ``setting`` says, predicted.

    A named plan (a strategy name, a Plan, a plan file) is resolved against the model first
    (:func:`resolve_named`: one that does not fit the model fails before anything is profiled);
    a strategy name takes :func:`uniform_schedule`'s schedule. ``plan`` None: search under
    ``setting.devices.memory_bytes``, first which linears to split into how many parts
    (``options.split``, world size > 1; the graph is split in place), then a strategy per
    parameter group with the recomputed regions and the schedule (``search_schedules``), jointly
    over ``options.batch_sizes`` when given. ``decide`` runs each searched choice; ``measure``
    gives the step's devices their measured figures (collective: after a named plan is resolved,
    so that one that does not fit the model fails on every rank before any collective). Memory
    is predicted for steps of ``setting.grad_accumulation`` micro-batches and at
    ``options.max_shape`` ([Note: input shapes])."""
    request = PlanRequest.parse(plan)
    named = None if request.kind == "search" else resolve_named(captured, request, setting)
    if measure is not None:
        setting = dataclasses.replace(setting, devices=measure(setting.devices))
    analysis = _profile(captured, example_inputs, setting, options, search=named is None,
                        decide=decide)
    if named is None:
        found = _search(analysis, setting, options, decide=decide)
    else:
        found = _Searched(_named(analysis, named, setting, options,
                                 uniform=request.kind == "uniform", decide=decide))
    resolved = found.plan
    if setting.precision is not None:
        resolved = dataclasses.replace(
            resolved, param_dtype=dtype_name(setting.precision.param_dtype),
            reduce_dtype=dtype_name(setting.precision.reduce_dtype))
    planned = predict(analysis, resolved, setting.at_batch(found.batch_size))
    others = tuple(predict(analysis, dataclasses.replace(
        resolved, schedule=alt.schedule, recompute=tuple(alt.found.recompute.items()),
        params=tuple(dataclasses.replace(p, strategy=alt.found.strategies[p.name])
                     for p in resolved.params)), setting.at_batch(None))
        for alt in found.alternatives)
    return Planned(planned, others, analysis, setting)


def resolve_named(captured: Captured, request: PlanRequest, setting: StepSetting) -> Plan:
    """A named plan (a strategy name, a Plan, a plan file) resolved against the captured model
    and ``setting``'s world, its splits applied to the graph: a plan that does not fit the
    model fails here."""
    apply_splits(captured, request.splits)
    devices = setting.devices
    plan = resolve_plan(request, param_specs(captured), world_size=devices.world_size,
                        ranks_per_node=devices.ranks_per_node,
                        memory_limit_bytes=devices.memory_bytes)
    return dataclasses.replace(plan, splits=tuple(sorted(weight_splits(captured).items())))


def _profile(captured: Captured, example_inputs: tuple[Any, ...], setting: StepSetting,
             options: SearchOptions, *, search: bool, decide: Decide) -> Analysis:
    """The analysis of the captured graph cast to the compute precision (the profile measures
    what a step computes), after the splits searched on it; profiled again only when the
    search splits a linear, in the unsplit graph's computation time ([Note: the split graph's
    computation])."""
    precision = setting.precision
    if precision is not None:
        run_pipeline(captured.gm, [CastParams(precision.param_dtype)])
    profile = functools.partial(analyze, captured, example_inputs, fake=options.fake,
                                max_shape=options.max_shape, precision=precision)
    analysis = profile()
    if search and options.split and setting.devices.world_size > 1:
        chosen = decide(lambda: choose_splits(analysis, setting, setting.memory_limit_bytes))
        if chosen:
            unsplit = summarize_profile(captured.gm)
            apply_splits(captured, chosen)
            computation = None
            if unsplit.fwd_time_s is not None and unsplit.bwd_time_s is not None:
                computation = unsplit.fwd_time_s, unsplit.bwd_time_s
            analysis = profile(computation=computation)
    return analysis


# [Note: the split graph's computation]
# A linear split into parts computes the same products in parts, and the split graph is profiled
# again only for where in the graph its time and memory fall (which part's gather the schedule
# waits for, which part's output is saved). Its whole-graph time, though, is a second snapshot of
# a machine whose speed moves from one second to the next where ranks share cores ([Note: the
# whole graph's time] in ``passes/profile.py``): profiled apart, the split and unsplit graphs of a
# searched plan took times further apart than the two took timed whole in the same rounds
# (``benchmarks/split_cost.py``, figures in ``docs/benchmarks.md``). The searched plan, priced on
# the one snapshot, and the named plans it is compared with, priced on the other, then differed by
# the snapshots more than by the plans. So on the CPU the split graph's node times are scaled to
# the forward and backward times measured for the unsplit graph, each node keeping its share of
# the split graph's own profile. On a GPU a node's time is its kernels' ([Note: timing a node on a
# GPU]), which no second snapshot of the whole moves, and the split graph keeps the times of its
# parts' own kernels.


@dataclasses.dataclass(frozen=True)
class _Searched:
    """A plan before its predictions, the batch size it was chosen for (None: the profiled
    one) and the search's alternatives for autotuning."""

    plan: Plan
    batch_size: int | None = None
    alternatives: tuple[Any, ...] = ()


def _search(analysis: Analysis, setting: StepSetting, options: SearchOptions, *,
            decide: Decide) -> _Searched:
    """The searched plan, unpredicted."""
    limit = setting.memory_limit_bytes
    alternatives: list[Any] = []
    batch = None
    if options.batch_sizes:
        chosen = decide(lambda: search_batch_size(analysis, list(options.batch_sizes), setting,
                                                  limit))
        batch, strategies = chosen.batch_size, chosen.strategies
        schedule, recompute = setting.schedule, {}
    else:
        k = options.candidates
        how = dict(vary_prefetch=options.vary_prefetch, recompute=options.recompute)
        found = decide(lambda: search_schedules(analysis, setting, limit, alternatives=k > 1,
                                                **how))
        schedule, alternatives = found[0].schedule, found[1:k]
        strategies, recompute = found[0].found.strategies, found[0].found.recompute
        if k > 1:  # autotuning measures these before it trusts them
            alternatives += decide(lambda: search_beyond_margin(
                analysis, setting, limit, faster_than_s=found[0].step_s, **how))[:k]
    captured, devices = analysis.captured, setting.devices
    plan = build_plan(strategies, param_specs(captured), world_size=devices.world_size,
                      memory_limit_bytes=limit, source="search",
                      splits=weight_splits(captured), schedule=schedule,
                      ranks_per_node=devices.ranks_per_node, recompute=recompute)
    return _Searched(plan, batch, tuple(alternatives))


def _named(analysis: Analysis, plan: Plan, setting: StepSetting, options: SearchOptions, *,
           uniform: bool, decide: Decide) -> Plan:
    """A named plan with the prefetch distance the user fixed, and, for a strategy name
    (``uniform``), the schedule of :func:`uniform_schedule`."""
    if not options.vary_prefetch:
        plan = dataclasses.replace(plan, schedule=dataclasses.replace(
            plan.schedule, prefetch=setting.schedule.prefetch))
    if uniform:
        plan = dataclasses.replace(plan, schedule=decide(
            lambda: uniform_schedule(analysis, plan, setting)))
    return plan


def uniform_plan(analysis: Analysis, strategy: str, setting: StepSetting) -> Plan:
    """Every parameter group under ``strategy``, with :func:`uniform_schedule`'s schedule:
    what a plan named by a strategy runs (unpredicted)."""
    devices = setting.devices
    plan = resolve_plan(strategy, param_specs(analysis.captured), world_size=devices.world_size,
                        ranks_per_node=devices.ranks_per_node)
    return dataclasses.replace(plan, schedule=uniform_schedule(analysis, plan, setting))


def uniform_schedule(analysis: Analysis, plan: Plan, setting: StepSetting) -> Schedule:
    """The schedule of a plan named by a strategy ("full_shard"): where the model has repeated
    blocks (transformer layers: recomputable regions), FSDP2's, which ``fully_shard`` on each
    block gives: one all-gather per block (a gather bucket of the most bytes one block gathers,
    at least 1 MiB; a bucket never spans two blocks), the plan's prefetch distance in buckets
    (by default one block ahead), one gradient collective in flight. Without blocks, the
    largest gather buckets whose predicted peak is at most that of the default schedule (small
    parameters only): 1 MiB, else the default.

    So a strategy named runs as its namesake does, at about its memory: fewer, larger
    collectives pay fewer collectives' latency (the runtime's per call, the link's per
    message; [Note: one gather per block]) and, under ``torch.compile``, leave longer regions
    to compile ([Note: torch.compile]). A plan file or the search chooses other schedules
    (smaller buckets hold less: ``docs/training.md``, "Overlap of communication with
    computation")."""
    # [Note: one gather per block] In buckets of at most 1 MiB a transformer block's parameters
    # (a LoRA layer's base weights and adapters alternating) take tens of all-gathers where
    # FSDP2 takes one, and each collective costs its call in the runtime and the backend, which
    # the step does not hide when it is bound by the host (a GPU at small batch, gloo on a
    # CPU). docs/benchmarks.md measures both against FSDP2 ("A LoRA fine-tune", "On a GPU").
    default = plan.schedule
    states = param_states(analysis, {p.name: p.strategy for p in plan.params})
    if not any(traits(s.strategy).sharded for s in states.values()):
        return default  # nothing is gathered
    block = block_gather_bytes(analysis, setting.devices.world_size)
    if block is not None:
        return dataclasses.replace(default,
                                   gather_bucket_bytes=max(block, LARGE_GATHER_BUCKET_BYTES),
                                   scatters_in_flight=1)
    recompute = dict(plan.recompute)

    def peak(schedule: Schedule) -> int:
        return _memory(analysis, states, recompute,
                       setting.with_schedule(schedule).at_batch(None)).peak_bytes

    larger = dataclasses.replace(default, gather_bucket_bytes=LARGE_GATHER_BUCKET_BYTES)
    if LARGE_GATHER_BUCKET_BYTES > default.gather_bucket_bytes and (
            peak(larger) <= peak(default)):
        return larger
    return default


def _memory(analysis: Analysis, states: dict[str, Any], recompute: dict[str, str],
            setting: StepSetting, seq: int | None = None) -> MemoryPrediction:
    """The predicted memory of a step as ``setting`` says (its batch per rank: None, the
    planned one) under ``states``, at sequence length ``seq`` (None: the planned one)."""
    return predict_step_memory(
        analysis.captured.gm, states, analysis.facts,
        setting=setting.at_batch(setting.batch_size or analysis.plan_batch),
        profiled_batch=analysis.batch_size, recompute=recompute,
        seq_scale=analysis.seq_scale(seq))


def predict_totals(analysis: Analysis, plan: Plan, setting: StepSetting) -> tuple[float, int]:
    """(step seconds, peak bytes per rank) of ``plan`` in a step as ``setting`` says (its
    schedule is the plan's), as :func:`predict` reports them, without the rest of its
    prediction: what a comparison row shows. Both come from the analysis's predictions of
    candidate plans (``plan_step``, ``plan_peak_bytes``), which the search may have made
    already."""
    setting = setting.with_schedule(plan.schedule)
    strategies = {p.name: p.strategy for p in plan.params}
    recompute = dict(plan.recompute)
    return (plan_step_s(analysis, strategies, recompute, setting),
            plan_peak_bytes(analysis, strategies, recompute, setting))


def predict(analysis: Analysis, plan: Plan, setting: StepSetting) -> Plan:
    """``plan`` with the predicted step time, peak memory and per-group costs attached, in a
    step as ``setting`` says (its batch per rank: None, the planned one; steps of its
    ``grad_accumulation`` micro-batches, all but the last inside ``no_sync()``; the plan's own
    schedule), and the peak as a function of batch size and sequence length. The step time
    stays that of one synchronised micro-batch and optimizer step. A plan only compared at one
    shape needs :func:`predict_totals`."""
    setting = setting.with_schedule(plan.schedule).at_batch(
        setting.batch_size or analysis.plan_batch)
    batch = setting.batch_size
    strategies = {p.name: p.strategy for p in plan.params}
    states = param_states(analysis, strategies)
    recompute = dict(plan.recompute)
    step, costs = plan_step(analysis, strategies, recompute, setting)

    def memory_at(seq: int | None) -> MemoryPrediction:
        return _memory(analysis, states, recompute, setting, seq)

    memory = memory_at(None)
    lines, shape_expr = None, None
    if analysis.seq_numels is not None and analysis.seq_len is not None:
        seq = analysis.plan_seq or analysis.seq_len
        found = peak_in_seq(
            lambda s: predict_memory_lines(
                analysis.captured.gm, states, analysis.facts, setting=setting,
                recompute=recompute, seq_scale=analysis.seq_scale(s)),
            sequence_points(analysis.seq_len),
            analysis.batch_size, [(b, s) for b in (1, batch, 4 * batch, 1024 * batch)
                                  for s in (2, analysis.seq_len, seq, 4 * seq, 1024 * seq)])
        lines, shape_expr = found or (None, None)
    scale = analysis.batch_scale(batch)
    prediction = Prediction(
        step_time_s=step.at_scale(scale), compute_s=step.compute_s * scale,
        comm_s=step.comm_s, optim_s=step.optim_s, peak_memory_bytes=memory.peak_bytes,
        peak_at=memory.peak_at, optimizer=setting.optimizer, batch_size=batch,
        step_time_expr=step.step_time_expr, peak_memory_expr=memory.peak_bytes_expr,
        peak_memory_shape_expr=shape_expr, seq_len=analysis.plan_seq if lines else None,
        peak_lines=lines, profiled_shape=(analysis.batch_size, analysis.seq_len),
        first_step_peak_bytes=memory.first_step_peak_bytes,
        peak_by_category=memory.peak_by_category, memory_timeline=memory.timeline,
        grad_accumulation=setting.grad_accumulation, regions=region_rows(
            analysis.facts, setting.devices, recompute, scale),
        figures=setting.devices.figures, host_s=step.host_s, sync_wait_s=step.sync_wait_s,
    )
    regathered = analysis.regathered | recomputed_params(
        analysis.facts, region_spans(analysis.facts, recompute))
    params = tuple(
        dataclasses.replace(p, compute_s=costs[p.name].compute_s, comm_s=costs[p.name].comm_s,
                            regathered=p.name in regathered)
        for p in plan.params
    )
    return dataclasses.replace(plan, params=params, prediction=prediction)

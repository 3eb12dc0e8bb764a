"""Planning: profile a captured model, predict what a plan costs, and search for the best plan.

``compile_osdp`` and ``python -m osdp_fx plan`` both go through here:

1. :func:`analyze` profiles the normalised graph, cast first to the compute precision when
   there is one (``profile_graph_pass``; on the meta device or under ``fake=True`` without
   running it), and derives its storage and gradient facts; it profiles again only after the
   search splits a linear;
2. :func:`predict` attaches to a Plan the step time and the peak memory per rank that the cost
   models predict (``cost_models.step``, ``cost_models.timeline``);
3. the searches of ``planner/search.py`` choose the splits, the batch size, and per parameter group a
   strategy (with the recomputed regions and the schedule) that minimises the predicted step
   time under a memory limit.

``planner/analysis.py`` holds :class:`Analysis` and :func:`analyze`; this module composes them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from ..core.buckets import LARGE_GATHER_BUCKET_BYTES, Schedule
from ..core.devices import Devices
from ..core.precision import MixedPrecision, dtype_name
from ..core.strategies import traits
from ..cost_models.recompute import recomputed_params, region_rows, region_spans
from ..cost_models.shapes import peak_in_seq, sequence_points
from ..cost_models.step import regathered_params
from ..cost_models.timeline import (
    MemoryPrediction,
    predict_memory_lines,
    predict_step_memory,
)
from ..passes.capture import Captured
from ..passes.manager import run_passes
from ..passes.precision import cast_params_pass
from ..passes.split_linear import apply_splits, weight_splits
from ..plan.plan import DEFAULT_PREFETCH, Plan, Prediction, check_prefetch
from ..plan.request import PlanRequest, build_plan, resolve_plan
from .analysis import (  # noqa: F401  (re-exported: the planner's vocabulary)
    Analysis,
    analyze,
    check_grad_accumulation,
    check_optimizer,
    param_specs,
    param_states,
    plan_step,
    plannable_bytes,
)
from .search import (  # noqa: F401  (re-exported)
    block_gather_bytes,
    choose_splits,
    plan_peak_bytes,
    search_batch_size,
    search_plan,
    search_schedules,
    search_strategies,
)
from .search_margin import search_beyond_margin

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What the planner is asked besides the plan itself, checked once when built (the meaning
    of each is that of ``compile_osdp``'s argument of the same name)."""

    optimizer: str = "adamw"
    """The optimizer kind the memory and time predictions assume."""
    batch_sizes: tuple[int, ...] | None = None
    """Candidate per-rank batch sizes for the search; None: the example's."""
    split: bool = True
    """Whether the search may split large linears into sub-linears."""
    recompute: bool = True
    """Whether the search may recompute regions in backward."""
    prefetch: int | None = None
    """Sharded parameters gathered ahead; None: the plan's, else ``DEFAULT_PREFETCH``."""
    precision: MixedPrecision | None = None
    """Mixed precision the graph is cast for before it is profiled."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step (all but the last inside ``no_sync()``)."""
    candidates: int = 1
    """How many plans to return for autotuning: the plan in force, then the alternatives."""
    max_shape: tuple[int, int | None] | None = None
    """The largest per-rank (batch, sequence length) to plan for; None: the example's."""
    fake: bool = False
    """Profile under fake tensors (FLOPs and bytes only) instead of running the graph."""

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer)
        check_grad_accumulation(self.grad_accumulation)
        if self.prefetch is not None:
            check_prefetch(self.prefetch)

    @property
    def prefetch_or_default(self) -> int:
        return DEFAULT_PREFETCH if self.prefetch is None else self.prefetch


@dataclasses.dataclass(frozen=True)
class Planned:
    """What planning a model returns: the plan in force, the alternatives autotuning may
    measure (``PlanOptions.candidates`` > 1), and the analysis they were predicted from (for
    predicting other plans of the same model, as ``python -m osdp_fx plan`` compares)."""

    plan: Plan
    alternatives: tuple[Plan, ...]
    analysis: Analysis


def resolve_named(captured: Captured, request: PlanRequest, *, world_size: int,
                  ranks_per_node: int | None, memory_limit_bytes: int | None) -> Plan:
    """A named plan (a strategy name, a Plan, a plan file) resolved against the captured model,
    its splits applied to the graph: a plan that does not fit the model fails here."""
    apply_splits(captured, request.splits)
    plan = resolve_plan(request, param_specs(captured), world_size=world_size,
                        ranks_per_node=ranks_per_node, memory_limit_bytes=memory_limit_bytes)
    return dataclasses.replace(plan, splits=tuple(sorted(weight_splits(captured).items())))


def make_plan(captured: Captured, example_inputs: tuple[Any, ...], **kwargs: Any) -> Plan:
    """Profile the model and return the plan in force with its predictions (the arguments of
    :func:`make_planned`)."""
    return make_planned(captured, example_inputs, **kwargs).plan


def make_planned(
    captured: Captured,
    example_inputs: tuple[Any, ...],
    *,
    plan: str | os.PathLike[str] | Plan | PlanRequest | None,
    devices: Devices,
    memory_limit_bytes: int | None,
    decide: Callable[[Callable[[], Any]], Any] = lambda choose: choose(),
    **options: Any,
) -> Planned:
    """:func:`plan_model` of ``plan`` (None: search; a strategy name, a Plan, a plan file:
    resolved by :func:`resolve_named`), the other ``options`` the fields of
    :class:`PlanOptions`."""
    request = PlanRequest.parse(plan)
    named = None if request.kind == "search" else resolve_named(
        captured, request, world_size=devices.world_size, ranks_per_node=devices.ranks_per_node,
        memory_limit_bytes=memory_limit_bytes)
    return plan_model(captured, example_inputs, named=named,
                      uniform=request.kind == "uniform", devices=devices,
                      options=PlanOptions(**options), decide=decide)


def plan_model(captured: Captured, example_inputs: tuple[Any, ...], *, named: Plan | None,
               uniform: bool = False, devices: Devices, options: PlanOptions,
               decide: Callable[[Callable[[], Any]], Any] = lambda choose: choose()) -> Planned:
    """Profile the model, then predict ``named`` (a plan resolved by :func:`resolve_named`;
    ``uniform``: named by a strategy, so it takes :func:`uniform_schedule`'s schedule) or,
    when None, search under ``devices.memory_bytes``: first which linears to split into how
    many parts (``options.split``, world size > 1; the graph is split in place), then a
    strategy per parameter group with the recomputed regions and the schedule
    (``search_schedules``), jointly over ``options.batch_sizes`` when given. ``decide`` runs
    each searched choice and gives it to every rank (compile_osdp's runs it on rank 0 alone and
    broadcasts the result, or its error).
    Memory is predicted for steps of ``options.grad_accumulation`` micro-batches and at
    ``options.max_shape`` ([Note: input shapes])."""
    analysis = _profile(captured, example_inputs, search=named is None, devices=devices,
                        options=options, decide=decide)
    found = (_search(analysis, devices=devices, options=options, decide=decide) if named is None
             else _Searched(_named(analysis, named, uniform=uniform, devices=devices,
                                   options=options, decide=decide)))
    resolved = found.plan
    if options.precision is not None:
        resolved = dataclasses.replace(
            resolved, param_dtype=dtype_name(options.precision.param_dtype),
            reduce_dtype=dtype_name(options.precision.reduce_dtype))
    how = dict(devices=devices, optimizer=options.optimizer,
               grad_accumulation=options.grad_accumulation)
    planned = predict(analysis, resolved, batch_size=found.batch_size, **how)
    others = tuple(predict(analysis, with_schedule(
        resolved, alt.schedule, recompute=tuple(alt.found.recompute.items()), params=tuple(
            dataclasses.replace(p, strategy=alt.found.strategies[p.name])
            for p in resolved.params)), **how)
        for alt in found.alternatives)
    return Planned(planned, others, analysis)


def _profile(captured: Captured, example_inputs: tuple[Any, ...], *, search: bool,
             devices: Devices, options: PlanOptions, decide: Callable[[Callable[[], Any]], Any]) -> Analysis:
    """The analysis of the captured graph cast to the compute precision (the profile measures
    what a step computes), after the splits searched on it; profiled again only when the
    search splits a linear."""
    precision = options.precision
    if precision is not None:
        run_passes(captured.gm, [("cast_params",
                                  lambda g: cast_params_pass(g, precision.param_dtype))])
    profile = functools.partial(analyze, captured, example_inputs, fake=options.fake,
                                max_shape=options.max_shape, precision=precision)
    analysis = profile()
    if search and options.split and devices.world_size > 1:
        assert devices.memory_bytes is not None
        chosen = decide(lambda: choose_splits(
            analysis, devices=devices, memory_limit_bytes=devices.memory_bytes,
            optimizer=options.optimizer, prefetch=options.prefetch_or_default,
            grad_accumulation=options.grad_accumulation))
        if chosen:
            apply_splits(captured, chosen)
            analysis = profile()
    return analysis


@dataclasses.dataclass(frozen=True)
class _Searched:
    """A plan before its predictions, the batch size it was chosen for (None: the profiled
    one) and the search's alternatives for autotuning."""

    plan: Plan
    batch_size: int | None = None
    alternatives: tuple[Any, ...] = ()


def _search(analysis: Analysis, *, devices: Devices, options: PlanOptions,
            decide: Callable[[Callable[[], Any]], Any]) -> _Searched:
    """The searched plan, unpredicted."""
    assert devices.memory_bytes is not None, "devices_for fills the memory limit"
    limit, acc = devices.memory_bytes, options.grad_accumulation
    alternatives: list[Any] = []
    batch = None
    if options.batch_sizes:
        chosen = decide(lambda: search_batch_size(
            analysis, list(options.batch_sizes), devices=devices, memory_limit_bytes=limit,
            optimizer=options.optimizer, prefetch=options.prefetch_or_default,
            grad_accumulation=acc))
        batch, strategies = chosen.batch_size, chosen.strategies
        schedule, recompute = Schedule(options.prefetch_or_default), {}
    else:
        how = dict(devices=devices, optimizer=options.optimizer, prefetch=options.prefetch,
                   grad_accumulation=acc, recompute=options.recompute)
        k = options.candidates
        found = decide(lambda: search_schedules(analysis, memory_limit_bytes=limit,
                                       alternatives=k > 1, **how))
        schedule, alternatives = found[0].schedule, found[1:k]
        strategies, recompute = found[0].found.strategies, found[0].found.recompute
        if k > 1:  # autotuning measures these before it trusts them
            alternatives += decide(lambda: search_beyond_margin(
                analysis, memory_limit_bytes=limit, faster_than_s=found[0].step_s, **how))[:k]
    captured = analysis.captured
    plan = build_plan(strategies, param_specs(captured), world_size=devices.world_size,
                      memory_limit_bytes=limit, source="search",
                      splits=weight_splits(captured),
                      schedule=schedule, ranks_per_node=devices.ranks_per_node,
                      recompute=recompute)
    return _Searched(plan, batch, tuple(alternatives))


def _named(analysis: Analysis, plan: Plan, *, uniform: bool, devices: Devices,
           options: PlanOptions, decide: Callable[[Callable[[], Any]], Any]) -> Plan:
    """A named plan with the options' prefetch, and, for a strategy name (``uniform``), the
    schedule of :func:`uniform_schedule`."""
    if options.prefetch is not None:
        plan = dataclasses.replace(plan, prefetch=options.prefetch)
    if uniform:
        plan = with_schedule(plan, decide(lambda: uniform_schedule(
            analysis, plan, devices=devices, optimizer=options.optimizer,
            grad_accumulation=options.grad_accumulation)))
    return plan


def with_schedule(plan: Plan, schedule: Schedule, **changes: Any) -> Plan:
    """``plan`` under ``schedule`` (and any other ``changes`` of its fields)."""
    return dataclasses.replace(plan, **dataclasses.asdict(schedule), **changes)


def uniform_schedule(analysis: Analysis, plan: Plan, *, devices: Devices, optimizer: str,
                     grad_accumulation: int = 1) -> Schedule:
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
    if not any(traits(s.strategy).sharded and not traits(s.strategy).needs_mesh
               for s in states.values()):
        return default  # nothing is bucketed (the mesh strategies never are)
    block = block_gather_bytes(analysis, devices.world_size)
    if block is not None:
        return dataclasses.replace(default,
                                   gather_bucket_bytes=max(block, LARGE_GATHER_BUCKET_BYTES),
                                   scatters_in_flight=1)
    recompute = dict(plan.recompute)

    def peak(schedule: Schedule) -> int:
        return _memory(analysis, states, recompute, schedule, devices=devices,
                       optimizer=optimizer, batch=analysis.plan_batch,
                       grad_accumulation=grad_accumulation).peak_bytes

    larger = dataclasses.replace(default, gather_bucket_bytes=LARGE_GATHER_BUCKET_BYTES)
    if LARGE_GATHER_BUCKET_BYTES > default.gather_bucket_bytes and (
            peak(larger) <= peak(default)):
        return larger
    return default


def _memory(analysis: Analysis, states: dict[str, Any], recompute: dict[str, str],
            schedule: Schedule, *, devices: Devices, optimizer: str, batch: int,
            grad_accumulation: int, seq: int | None = None) -> MemoryPrediction:
    """The predicted memory of a step under ``states`` and ``schedule`` at ``batch`` per rank
    (and sequence length ``seq``: None, the profiled one)."""
    return predict_step_memory(
        analysis.captured.gm, states, analysis.facts, devices=devices, schedule=schedule,
        optimizer=optimizer, profiled_batch=analysis.batch_size, batch_size=batch,
        grad_accumulation=grad_accumulation, recompute=recompute,
        seq_scale=analysis.seq_scale(seq))


def predict_totals(analysis: Analysis, plan: Plan, *, devices: Devices, optimizer: str,
                   batch_size: int | None = None, grad_accumulation: int = 1) -> tuple[float, int]:
    """(step seconds, peak bytes per rank) of ``plan`` at ``batch_size`` per rank (default:
    the planned one), as :func:`predict` reports them, without the rest of its prediction:
    what a comparison row shows. Both come from the analysis's predictions of candidate plans
    (``plan_step``, ``plan_peak_bytes``), which the search may have made already."""
    batch = batch_size or analysis.plan_batch
    strategies = {p.name: p.strategy for p in plan.params}
    recompute = dict(plan.recompute)
    step, _ = plan_step(analysis, strategies, recompute, devices=devices, optimizer=optimizer,
                        schedule=plan.schedule)
    peak = plan_peak_bytes(analysis, strategies, recompute, devices=devices,
                           optimizer=optimizer, batch_size=batch,
                           grad_accumulation=grad_accumulation, schedule=plan.schedule)
    return step.compute_s * batch / analysis.batch_size + step.comm_s + step.optim_s, peak


def predict(analysis: Analysis, plan: Plan, *, devices: Devices, optimizer: str,
            batch_size: int | None = None, grad_accumulation: int = 1) -> Plan:
    """``plan`` with the predicted step time, peak memory and per-group costs attached, at
    ``batch_size`` per rank (default: the profiled batch size); the memory of steps of
    ``grad_accumulation`` micro-batches (all but the last inside ``no_sync()``), and the peak as
    a function of batch size and sequence length. The step time stays that of one synchronised
    micro-batch and optimizer step. A plan only compared at one shape needs
    :func:`predict_totals`."""
    batch = batch_size or analysis.plan_batch
    strategies = {p.name: p.strategy for p in plan.params}
    states = param_states(analysis, strategies)
    recompute = dict(plan.recompute)
    step, costs = plan_step(analysis, strategies, recompute, devices=devices,
                            optimizer=optimizer, schedule=plan.schedule)
    def memory_at(batch: int, seq: int | None) -> MemoryPrediction:
        return _memory(analysis, states, recompute, plan.schedule, devices=devices,
                       optimizer=optimizer, batch=batch, grad_accumulation=grad_accumulation,
                       seq=seq)

    memory = memory_at(batch, None)
    lines, shape_expr = None, None
    if analysis.seq_numels is not None and analysis.seq_len is not None:
        seq = analysis.plan_seq or analysis.seq_len
        found = peak_in_seq(
            lambda s: predict_memory_lines(
                analysis.captured.gm, states, analysis.facts, devices=devices,
                schedule=plan.schedule, optimizer=optimizer, grad_accumulation=grad_accumulation,
                recompute=recompute, seq_scale=analysis.seq_scale(s)),
            sequence_points(analysis.seq_len),
            analysis.batch_size, [(b, s) for b in (1, batch, 4 * batch, 1024 * batch)
                                  for s in (2, analysis.seq_len, seq, 4 * seq, 1024 * seq)])
        lines, shape_expr = found or (None, None)
    compute_s = step.compute_s * batch / analysis.batch_size
    prediction = Prediction(
        step_time_s=compute_s + step.comm_s + step.optim_s, compute_s=compute_s,
        comm_s=step.comm_s, optim_s=step.optim_s, peak_memory_bytes=memory.peak_bytes,
        peak_at=memory.peak_at, optimizer=optimizer, batch_size=batch,
        step_time_expr=step.step_time_expr, peak_memory_expr=memory.peak_bytes_expr,
        peak_memory_shape_expr=shape_expr, seq_len=analysis.plan_seq if lines else None,
        peak_lines=lines, profiled_shape=(analysis.batch_size, analysis.seq_len),
        first_step_peak_bytes=memory.first_step_peak_bytes,
        peak_by_category=memory.peak_by_category, memory_timeline=memory.timeline,
        grad_accumulation=grad_accumulation, regions=region_rows(
            analysis.facts, devices, recompute, batch / analysis.batch_size),
    )
    regathered = regathered_params(analysis.facts) | recomputed_params(
        analysis.facts, region_spans(analysis.facts, recompute))
    params = tuple(
        dataclasses.replace(p, compute_s=costs[p.name].compute_s, comm_s=costs[p.name].comm_s,
                            regathered=p.name in regathered)
        for p in plan.params
    )
    return dataclasses.replace(plan, params=params, prediction=prediction)



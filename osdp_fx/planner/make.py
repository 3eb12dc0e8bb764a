"""Planning: profile a captured model, predict what a plan costs, and search for the best plan.

``compile_osdp`` and ``python -m osdp_fx plan`` both go through here:

1. :func:`analyze` profiles the normalised graph (``profile_graph_pass``; on the meta device or
   under ``fake=True`` without running it) and derives its storage and gradient facts;
2. :func:`predict` attaches to a Plan the step time and the peak memory per rank that the cost
   models predict (``cost_models.step``, ``cost_models.timeline``);
3. the searches of ``search.py`` choose the splits, the batch size, and per parameter group a
   strategy (with the recomputed regions and the schedule) that minimises the predicted step
   time under a memory limit.

``analysis.py`` holds :class:`Analysis` and :func:`analyze`; this module composes them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..core.buckets import LARGE_GATHER_BUCKET_BYTES, Schedule
from ..core.devices import Devices
from ..core.precision import MixedPrecision, dtype_name
from ..core.strategies import traits
from ..cost_models.recompute import recomputed_params, region_rows, region_spans
from ..cost_models.shapes import peak_in_seq, sequence_points
from ..cost_models.step import predict_step_time, regathered_params
from ..cost_models.timeline import MemoryPrediction, predict_step_memory
from ..passes.capture import Captured
from ..passes.manager import run_passes
from ..passes.precision import cast_params_pass
from ..passes.split_linear import apply_splits
from ..plan.plan import DEFAULT_PREFETCH, Plan, Prediction
from ..plan.request import PlanRequest, build_plan, resolve_plan
from ..runtime.collectives import scatter_copies_input
from .analysis import (  # noqa: F401  (re-exported: the planner's vocabulary)
    Analysis,
    analyze,
    check_grad_accumulation,
    check_optimizer,
    param_specs,
    param_states,
    plannable_bytes,
)
from .schedule_search import schedule_memory_kwargs
from .search import (  # noqa: F401  (re-exported)
    block_gather_bytes,
    choose_splits,
    search_batch_size,
    search_plan,
    search_schedules,
    search_strategies,
)
from .search_margin import search_beyond_margin

log = logging.getLogger(__name__)

def make_plan(
    captured: Captured,
    example_inputs: tuple[Any, ...],
    *,
    plan: str | os.PathLike[str] | Plan | PlanRequest | None,
    devices: Devices,
    memory_limit_bytes: int | None,
    optimizer: str,
    fake: bool = False,
    batch_sizes: Sequence[int] | None = None,
    split: bool = True,
    recompute: bool = True,
    agree: Callable[[Any], Any] = lambda choice: choice,
    prefetch: int | None = None,
    precision: MixedPrecision | None = None,
    grad_accumulation: int = 1,
    candidates: int = 1,
    max_shape: tuple[int, int | None] | None = None,
) -> tuple[Plan, Analysis]:
    """Profile the model and return the plan in force with its predictions.

    ``plan`` None runs the search under ``devices.memory_bytes``: first which linears to split
    into how many parts (``split``), then a strategy per parameter group, jointly over the
    per-rank ``batch_sizes`` when given. A plan that names splits is applied to the graph first.
    ``agree`` makes every rank use the same searched choice (compile_osdp passes a broadcast
    from rank 0). The captured graph is split in place. ``grad_accumulation`` k > 1: memory is
    predicted and planned for steps of k micro-batches, all but the last inside ``no_sync()``.
    The search chooses the schedule (``search_schedules``) and, unless ``recompute`` is False,
    which regions to recompute; ``candidates`` > 1: see Analysis.
    ``max_shape`` (batch, sequence length): plan and predict for that per-rank shape instead of
    the example's (``io_spec.py``, [Note: input shapes]).
    """
    check_optimizer(optimizer)
    check_grad_accumulation(grad_accumulation)
    acc = grad_accumulation
    request = PlanRequest.parse(plan)
    splits = request.splits
    apply_splits(captured, splits)
    search = request.kind == "search"
    split_search = search and split and devices.world_size > 1
    if split_search or precision is None:
        analysis = analyze(captured, example_inputs, fake=fake, max_shape=max_shape)
    if split_search:
        assert devices.memory_bytes is not None, "devices_for fills the memory limit"
        # with mixed precision the splits are chosen on the full-precision profile
        chosen = agree(choose_splits(analysis, devices=devices,
                                     memory_limit_bytes=devices.memory_bytes,
                                     optimizer=optimizer, prefetch=_prefetch(prefetch),
                                     grad_accumulation=acc))
        if chosen:
            splits = chosen
            apply_splits(captured, splits)
            analysis = analyze(captured, example_inputs, fake=fake, max_shape=max_shape)
    if precision is not None:
        run_passes(captured.gm, [("cast_params",
                                  lambda g: cast_params_pass(g, precision.param_dtype))])
        analysis = analyze(captured, example_inputs, fake=fake, precision=precision,
                           max_shape=max_shape)
    batch, alternatives = None, []
    if search:
        assert devices.memory_bytes is not None, "devices_for fills the memory limit"
        limit = devices.memory_bytes
        specs = param_specs(captured)
        if batch_sizes:
            batch, strategies = agree(search_batch_size(
                analysis, batch_sizes, devices=devices, memory_limit_bytes=limit,
                optimizer=optimizer, prefetch=_prefetch(prefetch), grad_accumulation=acc))
            schedule, recompute = Schedule(_prefetch(prefetch)), {}
        else:
            how = dict(devices=devices, optimizer=optimizer, prefetch=prefetch,
                       grad_accumulation=acc, recompute=recompute)
            found = agree(search_schedules(analysis, memory_limit_bytes=limit,
                                           alternatives=candidates > 1, **how))
            (_, schedule, (strategies, recompute)), alternatives = (found[0],
                                                                    found[1:candidates])
            if candidates > 1:  # autotuning measures these before it trusts them
                alternatives += agree(search_beyond_margin(
                    analysis, memory_limit_bytes=limit, faster_than_s=found[0][0],
                    **how))[:candidates]
        resolved = build_plan(strategies, specs, world_size=devices.world_size,
                              memory_limit_bytes=limit, source="search", splits=splits,
                              schedule=schedule, ranks_per_node=devices.ranks_per_node,
                              recompute=recompute)
    else:
        resolved = resolve_plan(request, param_specs(captured), world_size=devices.world_size,
                                ranks_per_node=devices.ranks_per_node,
                                memory_limit_bytes=memory_limit_bytes)
        if prefetch is not None:
            resolved = dataclasses.replace(resolved, prefetch=prefetch)
    if precision is not None:
        resolved = dataclasses.replace(resolved, param_dtype=dtype_name(precision.param_dtype),
                                       reduce_dtype=dtype_name(precision.reduce_dtype))
    if request.kind == "uniform":
        schedule = agree(uniform_schedule(analysis, resolved, devices=devices,
                                          optimizer=optimizer, grad_accumulation=acc))
        resolved = with_schedule(resolved, schedule)
    plan_out = predict(analysis, resolved, devices=devices, optimizer=optimizer, batch_size=batch,
                       grad_accumulation=acc)
    analysis.alternatives = tuple(predict(
        analysis, with_schedule(
            resolved, sch, recompute=tuple(rc.items()), params=tuple(
                dataclasses.replace(p, strategy=st[p.name]) for p in resolved.params)),
        devices=devices, optimizer=optimizer, grad_accumulation=acc)
        for _, sch, (st, rc) in alternatives)
    return plan_out, analysis


def with_schedule(plan: Plan, schedule: Schedule, **changes: Any) -> Plan:
    """``plan`` under ``schedule`` (and any other ``changes`` of its fields)."""
    return dataclasses.replace(plan, **dataclasses.asdict(schedule), **changes)


def _prefetch(prefetch: int | None) -> int:
    return DEFAULT_PREFETCH if prefetch is None else prefetch


def uniform_schedule(analysis: Analysis, plan: Plan, *, devices: Devices, optimizer: str,
                     grad_accumulation: int = 1) -> Schedule:
    """The schedule of a plan named by a strategy ("full_shard"): the largest gather buckets
    whose predicted peak is at most that of the default schedule (small parameters only),
    tried in this order: one transformer block per all-gather (as FSDP2 gathers a module), with
    two and then one gradient collective in flight; 1 MiB; the default. A strategy named
    promises its memory; gathering more per collective pays fewer collectives' latency (the
    runtime's per call, the link's per message) and, under ``torch.compile``, leaves longer
    regions to compile ([Note: torch.compile]). shard_grad_op keeps every gathered parameter
    until backward anyway, so a block bucket may cost it nothing (the Llama of
    ``benchmarks/torch_compile.py``); full_shard would hold a gathered block whole. The
    prefetch distance stays the plan's."""
    default = plan.schedule
    states = param_states(analysis, {p.name: p.strategy for p in plan.params})
    if not any(traits(s.strategy).sharded and not traits(s.strategy).needs_mesh
               for s in states.values()):
        return default  # nothing is bucketed (the mesh strategies never are)
    recompute = dict(plan.recompute)
    block = block_gather_bytes(analysis, devices.world_size)

    def peak(schedule: Schedule) -> int:
        return _memory(analysis, states, recompute, schedule, devices=devices,
                       optimizer=optimizer, batch=analysis.plan_batch,
                       grad_accumulation=grad_accumulation).peak_bytes

    tries = [(LARGE_GATHER_BUCKET_BYTES, default.scatters_in_flight)]
    if block is not None and block > LARGE_GATHER_BUCKET_BYTES:
        tries[:0] = [(block, default.scatters_in_flight), (block, 1)]
    limit = peak(default)
    for nbytes, in_flight in tries:
        schedule = dataclasses.replace(default, gather_bucket_bytes=nbytes,
                                       scatters_in_flight=in_flight)
        if nbytes > default.gather_bucket_bytes and peak(schedule) <= limit:
            return schedule
    return default


def _memory(analysis: Analysis, states: dict[str, Any], recompute: dict[str, str],
            schedule: Schedule, *, devices: Devices, optimizer: str, batch: int,
            grad_accumulation: int, seq: int | None = None) -> MemoryPrediction:
    """The predicted memory of a step under ``states`` and ``schedule`` at ``batch`` per rank
    (and sequence length ``seq``: None, the profiled one)."""
    return predict_step_memory(
        analysis.captured.gm, states, world_size=devices.world_size,
        ranks_per_node=devices.ranks_per_node, optimizer=optimizer,
        profiled_batch=analysis.batch_size, batch_size=batch,
        grad_accumulation=grad_accumulation, recompute=recompute,
        seq_scale=analysis.seq_scale(seq), scatter_copies_input=scatter_copies_input(),
        **schedule_memory_kwargs(schedule))


def predict(analysis: Analysis, plan: Plan, *, devices: Devices, optimizer: str,
            batch_size: int | None = None, grad_accumulation: int = 1) -> Plan:
    """``plan`` with the predicted step time, peak memory and per-group costs attached, at
    ``batch_size`` per rank (default: the profiled batch size); the memory of steps of
    ``grad_accumulation`` micro-batches (all but the last inside ``no_sync()``). The step time
    stays that of one synchronised micro-batch and optimizer step."""
    batch = batch_size or analysis.plan_batch
    states = param_states(analysis, {p.name: p.strategy for p in plan.params})
    recompute = dict(plan.recompute)
    step, costs = predict_step_time(analysis.captured.gm, states, analysis.facts, devices=devices,
                                    optimizer=optimizer, profiled_batch=analysis.batch_size,
                                    recompute=recompute, schedule=plan.schedule)
    def memory_at(batch: int, seq: int | None) -> MemoryPrediction:
        return _memory(analysis, states, recompute, plan.schedule, devices=devices,
                       optimizer=optimizer, batch=batch, grad_accumulation=grad_accumulation,
                       seq=seq)

    memory = memory_at(batch, None)
    lines, shape_expr = None, None
    if analysis.seq_numels is not None and analysis.seq_len is not None:
        seq = analysis.plan_seq or analysis.seq_len
        found = peak_in_seq(
            lambda s: memory_at(analysis.batch_size, s).lines, sequence_points(analysis.seq_len),
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



"""Planning: profile a captured model, predict what a plan costs, and search for the best plan.

``compile_osdp`` and ``python -m osdp_fx plan`` both go through here:

1. :func:`analyze` profiles the normalised graph (``profile_graph_pass``; on the meta device or
   under ``fake=True`` without running it) and derives its storage and gradient facts;
2. :func:`predict` attaches to a Plan the step time and the peak memory per rank that the cost
   models predict (``cost_models.step``, ``cost_models.timeline``);
3. :func:`search_strategies` chooses a strategy per parameter group that minimises the predicted
   step time under a memory limit: it builds each group's options from ``cost_models.step``,
   solves the exact problem of ``solver`` with the activation memory as its base, checks
   the answer against the timeline's peak, and tightens the limit by any excess until the
   timeline agrees (the search's separable memory model is an approximation of the timeline).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .capture import Captured, unchanged_state
from .cost_models.step import group_cost, predict_step_time, regathered_params
from .cost_models.graph_facts import GraphFacts, ParamState, graph_facts
from .cost_models.timeline import BATCH, predict_step_memory
from .devices import DEFAULT_CPU_MEMORY_BYTES, OPTIMIZERS, Devices
from .errors import InputError, PlanError
from .passes.precision import cast_params_pass
from .passes.profile import profile_graph_pass, slowest_rank_times_pass
from .passes.runner import run_passes
from .runtime.collectives import WORLD, group_size
from .solver import solve_min_time
from .passes.split_linear import SPLIT_FACTORS, apply_splits, linear_sites
from .plan import DEFAULT_PREFETCH, Plan, Prediction
from .plan_request import ParamSpec, PlanRequest, build_plan, resolve_plan
from .strategies import FULL_SHARD, MESH_STRATEGIES, REPLICATE, STRATEGIES
from .precision import MixedPrecision, dtype_name
from .units import format_bytes

log = logging.getLogger(__name__)

_MAX_TIGHTENINGS = 8

MEMORY_MARGIN = 0.03
"""Share of the memory limit the search keeps free for bytes the memory model does not predict.

Measured against an independent storage tracker (``tests/distributed/test_memory_promise.py``,
``docs/cost-models.md``), predicted peaks are within a few per cent of what a step holds; the
largest under-prediction seen is 2.2 % (a Hugging Face Llama's loss). A searched plan is
therefore one whose predicted peak is at most ``(1 - MEMORY_MARGIN) * limit``."""


def plannable_bytes(memory_limit_bytes: int) -> int:
    """The predicted peak a searched plan may have under ``memory_limit_bytes``."""
    return memory_limit_bytes - int(memory_limit_bytes * MEMORY_MARGIN)


@dataclasses.dataclass
class Analysis:
    """A captured model with its profile."""

    captured: Captured
    """The normalised graph and the model's parameter groups."""
    facts: GraphFacts
    """Storage roots, savers and gradient flow of the profiled graph."""
    batch_size: int
    """Per-rank batch size of the profiled inputs (first dimension of the first tensor)."""
    precision: MixedPrecision | None = None
    """Mixed precision the graph was cast for before profiling (``cast_params_pass``)."""


def check_grad_accumulation(grad_accumulation: Any) -> None:
    """Raise InputError unless ``grad_accumulation`` is an int >= 1."""
    if (isinstance(grad_accumulation, bool) or not isinstance(grad_accumulation, int)
            or grad_accumulation < 1):
        raise InputError(
            f"grad_accumulation={grad_accumulation!r} is not a number of micro-batches: pass an "
            "int >= 1, the micro-batches each optimizer step accumulates gradients over (all "
            "but the last run inside compiled.no_sync()); 1 means no accumulation")


def check_optimizer(optimizer: str) -> None:
    """Raise InputError unless ``optimizer`` is a kind the cost models know."""
    if optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer {optimizer!r} is not a kind the cost models know; use one "
                         f"of {', '.join(OPTIMIZERS)} (the closest to your optimizer)")


def param_specs(captured: Captured) -> list[ParamSpec]:
    """What a Plan needs to know about each parameter group of a captured model."""
    return [
        ParamSpec(name=p.name, shape=p.shape, dtype=str(p.dtype).removeprefix("torch."),
                  element_size=p.dtype.itemsize, aliases=p.aliases, trainable=p.trainable,
                  frozen=not p.requires_grad)
        for p in captured.params.values()
    ]


def devices_for(devices: Devices | None, *, world_size: int, memory_limit_bytes: int | None,
                detect: bool, ranks_per_node: int | None = None) -> Devices:
    """The Devices to plan for: ``devices`` or, when None, measured (``detect``, collective) or
    the defaults; its world size set to ``world_size``, its memory limit filled in, and its
    ranks per node set to ``ranks_per_node`` when given."""
    if devices is None:
        devices = (_detected(world_size, ranks_per_node) if detect and world_size > 1
                   else Devices())
    memory = memory_limit_bytes or devices.memory_bytes or DEFAULT_CPU_MEMORY_BYTES
    return dataclasses.replace(devices, world_size=world_size, memory_bytes=memory,
                               ranks_per_node=ranks_per_node or devices.ranks_per_node)


_detected_devices: dict[tuple[int, int, int | None], Devices] = {}


def _detected(world_size: int, ranks_per_node: int | None = None) -> Devices:
    """Devices.detect() of the current default process group, measured once per group so that
    compiling the same model twice gives the same plan (collective on first use);
    ``ranks_per_node`` None finds the nodes from host names."""
    import torch.distributed as dist

    key = (id(dist.group.WORLD), world_size, ranks_per_node)
    if key not in _detected_devices:
        _detected_devices[key] = Devices.detect(ranks_per_node=ranks_per_node)
    return _detected_devices[key]


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
    agree: Callable[[Any], Any] = lambda choice: choice,
    prefetch: int | None = None,
    precision: MixedPrecision | None = None,
    grad_accumulation: int = 1,
) -> tuple[Plan, Analysis]:
    """Profile the model and return the plan in force with its predictions.

    ``plan`` None runs the search under ``devices.memory_bytes``: first which linears to split
    into how many parts (``split``), then a strategy per parameter group, jointly over the
    per-rank ``batch_sizes`` when given. A plan that names splits is applied to the graph first.
    ``agree`` makes every rank use the same searched choice (compile_osdp passes a broadcast
    from rank 0). The captured graph is split in place. ``grad_accumulation`` k > 1: memory is
    predicted and planned for steps of k micro-batches, all but the last inside ``no_sync()``.
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
        analysis = analyze(captured, example_inputs, fake=fake)
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
            analysis = analyze(captured, example_inputs, fake=fake)
    if precision is not None:
        run_passes(captured.gm, [("cast_params",
                                  lambda g: cast_params_pass(g, precision.param_dtype))])
        analysis = analyze(captured, example_inputs, fake=fake, precision=precision)
    batch = None
    if search:
        assert devices.memory_bytes is not None, "devices_for fills the memory limit"
        limit = devices.memory_bytes
        specs = param_specs(captured)
        if batch_sizes:
            batch, strategies = agree(search_batch_size(
                analysis, batch_sizes, devices=devices, memory_limit_bytes=limit,
                optimizer=optimizer, prefetch=_prefetch(prefetch), grad_accumulation=acc))
        else:
            strategies = agree(search_strategies(analysis, devices=devices,
                                                 memory_limit_bytes=limit, optimizer=optimizer,
                                                 prefetch=_prefetch(prefetch),
                                                 grad_accumulation=acc))
        resolved = build_plan(strategies, specs, world_size=devices.world_size,
                              memory_limit_bytes=limit, source="search", splits=splits,
                              prefetch=_prefetch(prefetch),
                              ranks_per_node=devices.ranks_per_node)
    else:
        resolved = resolve_plan(request, param_specs(captured), world_size=devices.world_size,
                                ranks_per_node=devices.ranks_per_node,
                                memory_limit_bytes=memory_limit_bytes)
        if prefetch is not None:
            resolved = dataclasses.replace(resolved, prefetch=prefetch)
    if precision is not None:
        resolved = dataclasses.replace(resolved, param_dtype=dtype_name(precision.param_dtype),
                                       reduce_dtype=dtype_name(precision.reduce_dtype))
    plan_out = predict(analysis, resolved, devices=devices, optimizer=optimizer, batch_size=batch,
                       grad_accumulation=acc)
    return plan_out, analysis


def _prefetch(prefetch: int | None) -> int:
    return DEFAULT_PREFETCH if prefetch is None else prefetch


def analyze(captured: Captured, example_inputs: tuple[Any, ...], *, fake: bool = False,
            warmup: int = 1, repeats: int = 3,
            precision: MixedPrecision | None = None) -> Analysis:
    """Profile ``captured.gm`` on ``example_inputs``; in a process group, the node times are
    made the same on every rank, summing to the slowest rank's (``slowest_rank_times_pass``)."""
    fake = fake or any(p.device.type == "meta" for p in captured.gm.parameters())
    if not fake and group_size(WORLD) > 1:
        # ranks time their nodes together, sharing the machine as they do when training
        torch.distributed.barrier()
    with unchanged_state(captured.gm):
        run_passes(captured.gm, [("profile", lambda g: profile_graph_pass(
            g, example_inputs, warmup=warmup, repeats=repeats, fake=fake,
            meta_device=captured.materialize_device or "cpu"))])
    if not fake:
        run_passes(captured.gm, [("slowest_rank_times", slowest_rank_times_pass)])
    trainable = {name: p.trainable for name, p in captured.params.items()}
    batch = next((int(x.shape[0]) for x in example_inputs
                  if isinstance(x, torch.Tensor) and x.dim() > 0), 1)
    return Analysis(captured, graph_facts(captured.gm, trainable), batch, precision)


def _state(analysis: Analysis, name: str, strategy: str) -> ParamState:
    p = analysis.captured.params[name]
    mp = analysis.precision if p.dtype.is_floating_point else None
    return ParamState(numel=p.numel, element_size=p.dtype.itemsize, strategy=strategy,
                      trainable=p.trainable,
                      compute_element_size=mp.param_dtype.itemsize if mp else None,
                      reduce_element_size=mp.reduce_dtype.itemsize if mp else None)


def _states(analysis: Analysis, strategies: Mapping[str, str]) -> dict[str, ParamState]:
    return {name: _state(analysis, name, strategies[name]) for name in analysis.captured.params}


def predict(analysis: Analysis, plan: Plan, *, devices: Devices, optimizer: str,
            batch_size: int | None = None, grad_accumulation: int = 1) -> Plan:
    """``plan`` with the predicted step time, peak memory and per-group costs attached, at
    ``batch_size`` per rank (default: the profiled batch size); the memory of steps of
    ``grad_accumulation`` micro-batches (all but the last inside ``no_sync()``). The step time
    stays that of one synchronised micro-batch and optimizer step."""
    batch = batch_size or analysis.batch_size
    states = _states(analysis, {p.name: p.strategy for p in plan.params})
    step, costs = predict_step_time(analysis.captured.gm, states, analysis.facts, devices=devices,
                                    optimizer=optimizer, profiled_batch=analysis.batch_size)
    memory = predict_step_memory(analysis.captured.gm, states, world_size=devices.world_size,
                                 ranks_per_node=devices.ranks_per_node, optimizer=optimizer,
                                 profiled_batch=analysis.batch_size, batch_size=batch,
                                 prefetch=plan.prefetch, grad_accumulation=grad_accumulation)
    compute_s = step.compute_s * batch / analysis.batch_size
    prediction = Prediction(
        step_time_s=compute_s + step.comm_s + step.optim_s, compute_s=compute_s,
        comm_s=step.comm_s, optim_s=step.optim_s, peak_memory_bytes=memory.peak_bytes,
        peak_at=memory.peak_at, optimizer=optimizer, batch_size=batch,
        step_time_expr=step.step_time_expr, peak_memory_expr=memory.peak_bytes_expr,
        first_step_peak_bytes=memory.first_step_peak_bytes,
        peak_by_category=memory.peak_by_category, memory_timeline=memory.timeline,
        grad_accumulation=grad_accumulation,
    )
    regathered = regathered_params(analysis.facts)
    params = tuple(
        dataclasses.replace(p, compute_s=costs[p.name].compute_s, comm_s=costs[p.name].comm_s,
                            regathered=p.name in regathered)
        for p in plan.params
    )
    return dataclasses.replace(plan, params=params, prediction=prediction)


def choose_splits(
    analysis: Analysis, *, devices: Devices, memory_limit_bytes: int, optimizer: str,
    prefetch: int = DEFAULT_PREFETCH, grad_accumulation: int = 1,
) -> dict[str, int]:
    """Which linear weights to split into how many parts (k in 2, 4, 8).

    Every splittable weight gets the options k = 1 (its three strategies) and, for each k, "j of
    the k parts full_shard, the others replicated" (j = 0..k): j sets the memory between
    replicate and full_shard, k the transient memory (one part's gathered weight at a time)
    against the latency of k collectives. Other groups keep their strategies as options. The
    same exact solver as the strategy search picks one option per group; the strategies of the
    parts are then searched again on the split graph.
    """
    names = list(analysis.captured.params)
    sites = linear_sites(analysis.captured.gm)
    regathered = regathered_params(analysis.facts)
    times, persistent, transient, labels = [], [], [], []
    for n in names:
        info = analysis.captured.params[n]
        strategies = searched_strategies(devices) if info.trainable else [REPLICATE]
        costs = [group_cost(_state(analysis, n, st), regathered=n in regathered, compute_s=0.0,
                            devices=devices, optimizer=optimizer,
                            grad_accumulation=grad_accumulation) for st in strategies]
        options = [(1, c.comm_s + c.optim_s, c.persistent_bytes, c.transient_bytes)
                   for c in costs]
        site = sites.get(n)
        if site is not None and info.trainable:
            for k in SPLIT_FACTORS:
                if k > site.out_features:
                    break
                part = dataclasses.replace(_state(analysis, n, REPLICATE), numel=info.numel // k)
                rep, full = (group_cost(dataclasses.replace(part, strategy=st),
                                        regathered=n in regathered, compute_s=0.0,
                                        devices=devices, optimizer=optimizer,
                                        grad_accumulation=grad_accumulation)
                             for st in (REPLICATE, FULL_SHARD))
                for j in range(k + 1):
                    options.append((
                        k, j * (full.comm_s + full.optim_s) + (k - j) * (rep.comm_s + rep.optim_s),
                        j * full.persistent_bytes + (k - j) * rep.persistent_bytes,
                        full.transient_bytes if j else 0))
        labels.append([o[0] for o in options])
        times.append([o[1] for o in options])
        persistent.append([o[2] for o in options])
        transient.append([o[3] for o in options])
    _, base = _activation_base(analysis, devices=devices, optimizer=optimizer, batch_size=None,
                               prefetch=prefetch, grad_accumulation=grad_accumulation)
    try:
        result = solve_min_time(times, persistent, transient,
                                limit_bytes=plannable_bytes(memory_limit_bytes),
                                base_bytes=base, names=names)
    except PlanError:
        return {}  # the strategy search reports what does not fit
    chosen = {n: labels[i][j] for i, (n, j) in enumerate(zip(names, result.choices))}
    return {n: k for n, k in chosen.items() if k > 1}


def search_batch_size(
    analysis: Analysis, batch_sizes: Sequence[int], *, devices: Devices, memory_limit_bytes: int,
    optimizer: str, prefetch: int = DEFAULT_PREFETCH, grad_accumulation: int = 1,
) -> tuple[int, dict[str, str]]:
    """The per-rank batch size among ``batch_sizes`` and the strategies that maximise predicted
    samples per second (``b * N / step_time(b)``) within the memory limit."""
    best: tuple[float, int, dict[str, str]] | None = None
    for b in sorted(set(batch_sizes)):
        if not isinstance(b, int) or b < 1:
            raise InputError(f"batch_sizes must be positive ints, got {b!r}")
        try:
            strategies = search_strategies(analysis, devices=devices, optimizer=optimizer,
                                           memory_limit_bytes=memory_limit_bytes, batch_size=b,
                                           prefetch=prefetch, grad_accumulation=grad_accumulation)
        except PlanError:
            continue
        step, _ = predict_step_time(analysis.captured.gm, _states(analysis, strategies),
                                    analysis.facts, devices=devices, optimizer=optimizer,
                                    profiled_batch=analysis.batch_size)
        samples_per_s = b * devices.world_size / float(step.step_time_expr.subs(BATCH, b))
        log.info("batch %d: %.1f samples/s predicted", b, samples_per_s)
        if best is None or samples_per_s > best[0]:
            best = (samples_per_s, b, strategies)
    if best is None:
        raise PlanError(
            f"no plan fits the memory limit of {format_bytes(memory_limit_bytes)} per rank at any "
            f"of the batch sizes {sorted(set(batch_sizes))}: try smaller batch sizes, more "
            "ranks or a larger limit")
    return best[1], best[2]


def _activation_base(analysis: Analysis, *, devices: Devices, optimizer: str,
                     batch_size: int | None, prefetch: int,
                     grad_accumulation: int = 1) -> tuple[int, int]:
    """(peak of the most sharded plan, the search's base memory): that peak minus what the
    search itself accounts for (persistent and largest transient bytes), i.e. activations."""
    lowest = {n: FULL_SHARD if p.trainable and devices.world_size > 1 else REPLICATE
              for n, p in analysis.captured.params.items()}
    peak = predict_step_memory(
        analysis.captured.gm, _states(analysis, lowest), world_size=devices.world_size,
        ranks_per_node=devices.ranks_per_node, optimizer=optimizer,
        profiled_batch=analysis.batch_size, batch_size=batch_size, prefetch=prefetch,
        grad_accumulation=grad_accumulation).peak_bytes
    regathered = regathered_params(analysis.facts)
    costs = [group_cost(_state(analysis, n, st), regathered=n in regathered, compute_s=0.0,
                        devices=devices, optimizer=optimizer,
                        grad_accumulation=grad_accumulation) for n, st in lowest.items()]
    return peak, max(0, peak - sum(c.persistent_bytes for c in costs)
                     - max((c.transient_bytes for c in costs), default=0))


def searched_strategies(devices: Devices) -> list[str]:
    """Strategies the search offers a trainable group: hybrid_shard and hierarchical only on
    several nodes (on one node they equal full_shard)."""
    if devices.num_nodes > 1:
        return list(STRATEGIES)
    return [s for s in STRATEGIES if s not in MESH_STRATEGIES]


def search_strategies(
    analysis: Analysis, *, devices: Devices, memory_limit_bytes: int, optimizer: str,
    batch_size: int | None = None, prefetch: int = DEFAULT_PREFETCH, grad_accumulation: int = 1,
) -> dict[str, str]:
    """The per-group strategies with the least predicted step time whose predicted peak memory
    (timeline, at ``batch_size``, default the profiled one; of steps of ``grad_accumulation``
    micro-batches) fits ``memory_limit_bytes``. Raises PlanError when none does."""
    names = list(analysis.captured.params)
    trainable = {n: analysis.captured.params[n].trainable for n in names}
    sharding_helps = devices.world_size > 1
    options = {n: searched_strategies(devices) if trainable[n] and sharding_helps else [REPLICATE]
               for n in names}
    regathered = regathered_params(analysis.facts)
    table = {
        n: [group_cost(_state(analysis, n, s), regathered=n in regathered, compute_s=0.0,
                       devices=devices, optimizer=optimizer, grad_accumulation=grad_accumulation)
            for s in options[n]]
        for n in names
    }
    lowest_peak, base = _activation_base(analysis, devices=devices, optimizer=optimizer,
                                         batch_size=batch_size, prefetch=prefetch,
                                         grad_accumulation=grad_accumulation)
    target = plannable_bytes(memory_limit_bytes)
    limit = target
    for _ in range(_MAX_TIGHTENINGS):
        result = solve_min_time(
            [[c.comm_s + c.optim_s for c in table[n]] for n in names],
            [[c.persistent_bytes for c in table[n]] for n in names],
            [[c.transient_bytes for c in table[n]] for n in names],
            limit_bytes=limit, base_bytes=base, names=names,
        )
        strategies = {n: options[n][j] for n, j in zip(names, result.choices)}
        peak = predict_step_memory(
            analysis.captured.gm, _states(analysis, strategies), world_size=devices.world_size,
            ranks_per_node=devices.ranks_per_node, optimizer=optimizer,
            profiled_batch=analysis.batch_size, batch_size=batch_size,
            prefetch=prefetch, grad_accumulation=grad_accumulation).peak_bytes
        if peak <= target:
            counts = {s: sum(v == s for v in strategies.values()) for s in STRATEGIES}
            log.info("search: %s, predicted peak %s of %s", counts, format_bytes(peak),
                     format_bytes(memory_limit_bytes))
            return strategies
        limit -= peak - target
        if limit <= base:
            break
    raise PlanError(
        f"no plan fits the memory limit of {format_bytes(memory_limit_bytes)} per rank (the "
        f"search plans for {format_bytes(target)}, keeping {MEMORY_MARGIN:.0%} for what the "
        f"memory model does not predict): even with every parameter group sharded (full_shard) "
        f"a step needs {format_bytes(lowest_peak)} ({format_bytes(lowest_peak - base)} "
        f"parameters, gradients and optimizer state, the rest activations). Raise the memory "
        f"limit, use more ranks, or use a smaller batch"
    )


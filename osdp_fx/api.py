"""compile_osdp: capture, plan, shard and recompile a model for data-parallel training."""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import logging
import os
import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from .core import progress
from .core.devices import Devices
from .core.io_spec import CallCheck, ShapeGuard, bind_example, check_max_shape
from .core.buckets import DEFAULT_SCHEDULE, Schedule
from .core.precision import MixedPrecision, dtype_from_name, resolve_mixed_precision
from .core.setting import StepSetting
from .core.strategies import traits
from .errors import InputError, OSDPError, PlanMismatchError
from .module import OSDPModule
from .passes.aliases import AnnotateAliases
from .passes.capture import Captured, as_input_tuple, capture, is_on_meta
from .passes.pipeline import run_pipeline
from .passes.recompute import RecomputeRegions
from .passes.shard import ShardParameters
from .plan.plan import Plan
from .plan.request import PlanRequest
from .planner.autotune import autotune_plans, check_autotune
from .planner.cache import (
    DEVICES_FOLDER,
    CachedPlan,
    DevicesCache,
    PlanCache,
    cache_dir,
    devices_key,
    plan_key,
)
from .planner.detect import devices_for, measured, with_figures
from .planner.make import SearchOptions, plan_model
from .runtime.collectives import WORLD, broadcast_, group_rank, group_size
from .runtime.hierarchy import init_mesh, ranks_per_node_for
from .runtime.param_table import ParamTable
from .training.materialize import (
    check_initializable,
    check_same_rng_state,
    materialize_device,
    materialize_meta_model,
    model_device,
)
from .units import parse_bytes

log = logging.getLogger(__name__)


def compile_osdp(
    model: nn.Module,
    example_inputs: Any,
    devices: Devices | None = None,
    *,
    plan: str | os.PathLike[str] | Plan | None = None,
    memory_limit: int | str | None = None,
    optimizer: str = "adamw",
    batch_sizes: Sequence[int] | None = None,
    split: bool = True,
    recompute: bool = True,
    prefetch: int | None = None,
    mixed_precision: MixedPrecision | str | torch.dtype | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    grad_accumulation: int = 1,
    example_kwargs: dict[str, Any] | None = None,
    max_shape: Sequence[int] | None = None,
    autotune: int | None = None,
    plan_cache: bool | str | os.PathLike[str] = True,
) -> OSDPModule:
    """Compile ``model`` for data-parallel training with a per-parameter sharding plan.

    Args:
        model: the model; it is not modified except that its parameters and buffers are
            overwritten with rank 0's values (as DDP does). Drop your reference to it to free
            its full-size parameters. A model built under ``torch.device("meta")`` is planned
            without values and then initialised one module at a time, keeping only this
            rank's shards (``osdp_fx/training/materialize.py``; seed every rank the same); its meta
            tensors are then replaced: replicated parameters and buffers by the values the
            compiled module uses, sharded parameters by new meta tensors.
        example_inputs: this rank's inputs for one step, a tuple of the forward's positional
            arguments (a single tensor is accepted; ``()`` with ``example_kwargs``). Batch
            (dimension 0) and sequence length (dimension 1) may differ from call to call.
        devices: the cluster; None means the current default process group (world size 1 when
            torch.distributed is not initialised), its figures measured on the machine it runs
            on (``detect_devices``, collective) and kept next to the plan cache (``plan_cache``)
            so that a restart does not measure again; ``compiled.plan.prediction.figures`` says
            where the figures came from. Its ``ranks_per_node`` sets the mesh of
            nodes x ranks per node that hybrid_shard and hierarchical use; without it, torchrun's
            ``LOCAL_WORLD_SIZE``, else one node (``docs/multi-node.md``).
        plan: a strategy for every parameter (``"replicate"``, ``"shard_grad_op"``,
            ``"full_shard"``, ``"hybrid_shard"``, ``"hierarchical"``), a :class:`Plan`, or the
            path of a JSON plan file. None: the search chooses, per
            parameter group, the strategies with the least predicted step time whose predicted
            peak memory fits the memory limit.
        memory_limit: per-rank memory limit, bytes or a string such as ``"8GiB"``; default:
            ``devices.memory_bytes``, else the memory of the device the model runs on, at
            every world size and under every plan: a GPU's whole memory, 4 GiB on the CPU
            (``devices.DEFAULT_CPU_MEMORY_BYTES``).
        optimizer: the optimizer kind the memory and time predictions assume: ``"sgd"``,
            ``"sgd_momentum"``, ``"adam"`` or ``"adamw"``.
        batch_sizes: candidate per-rank batch sizes for the search (plan=None): the plan with
            the most predicted samples per second among them is chosen, and
            ``compiled.plan.prediction.batch_size`` says which batch size to feed.
        split: whether the search may split large linear operators into sub-linears
            (``docs/splitting.md``); a plan that names splits is applied either way.
        recompute: whether the search may recompute activations of repeated blocks in backward
            (``docs/recomputation.md``); a plan that names recomputed regions is applied
            either way. False: the search chooses strategies and schedule alone.
        prefetch: how many sharded parameters ahead each all-gather starts, in forward and in
            backward, to overlap it with computation (0: gather each when needed; each more
            holds one more gathered parameter). Default: the plan's, else 1.
        mixed_precision: compute in a lower precision: ``"bf16"``, ``"fp16"``, a dtype, or
            :class:`MixedPrecision` (``param_dtype``, ``reduce_dtype``). Parameters, their
            shards and the optimizer state stay in their own dtype; floating parameters are
            gathered and computed in ``param_dtype`` and floating inputs cast to it; gradients
            are reduced in ``reduce_dtype`` (default float32). Default: the plan's, else none.
        init_fn: for a model on the meta device: ``init_fn(module)`` initialises the tensors a
            module owns directly, instead of its ``reset_parameters()``.
        grad_accumulation: how many micro-batches each optimizer step accumulates gradients
            over, all but the last inside ``compiled.no_sync()``: the predicted peak memory
            (and the search's memory limit) then includes the full gradient every sharded
            parameter holds between micro-batches (``docs/training.md``), so the search may
            choose another plan for it. Default 1: no accumulation.
        example_kwargs: keyword arguments of the example step (``input_ids=``,
            ``attention_mask=``, ``labels=``); the compiled module is then called with the same
            keywords and returns what the model returns (a ``ModelOutput``, a dict, a tuple).
            An argument absent here must stay absent (``docs/guide.md``).
        max_shape: ``(batch, sequence length)``, the largest per-rank shape you will feed: the
            plan is made and its memory predicted for it. Default: the example's. A call whose
            shape is larger, and whose predicted peak exceeds the memory limit, raises an
            ``InputError`` before anything runs.
        autotune: with the search (plan=None), time the ``autotune`` best predicted plans that
            fit (distinct strategies or schedules), and up to ``autotune`` more predicted
            faster whose predicted peak lies between the memory margin and the limit, for a
            few training steps each on ``example_inputs``, on copies of the model, measuring
            each one's peak memory too; keep the fastest measured among those measured under
            the limit (the slowest rank's time and the fullest rank's peak decide, so every
            rank keeps the same plan). ``compiled.plan.measured`` records the figures. Costs
            about ``20 * autotune`` steps; logged as the "autotune" stage. Default None: the
            predicted best, nothing timed.

        plan_cache: with the search (plan=None), where searched plans are kept, so that
            compiling the same model with the same inputs, devices, world and options again (a
            restart) takes the saved plan instead of searching: the same plan hash, the same
            splits. True: ``$OSDP_FX_PLAN_CACHE``, else ``~/.cache/osdp_fx/plans``
            (``planner/cache.py``); a directory; False: no cache. Rank 0 decides for all ranks;
            the log says which entry was used.

    Collective: every rank of the world must call it with the same model and plan. Its stages
    (capture, plan: profile and search, shard, ...) log their seconds at INFO through
    ``logging``; on a terminal rank 0 shows a progress bar (``osdp_fx.core.progress.configure``).
    """
    start, times = time.perf_counter(), {}
    io, target, inputs = bind_example(model, as_input_tuple(example_inputs), example_kwargs)
    request = PlanRequest.parse(plan)  # read once (a plan file too); a bad one fails here
    setting = StepSetting(  # checked once, here; its devices filled in below
        Devices(), optimizer=optimizer, precision=_precision(mixed_precision, request),
        grad_accumulation=grad_accumulation,
        schedule=DEFAULT_SCHEDULE if prefetch is None else Schedule(prefetch=prefetch))
    options = SearchOptions(
        batch_sizes=tuple(batch_sizes) if batch_sizes else None, split=split,
        recompute=recompute, vary_prefetch=prefetch is None, candidates=autotune or 1,
        max_shape=check_max_shape(max_shape))
    on_meta = is_on_meta(model)
    check_autotune(autotune, search=request.kind == "search", on_meta=on_meta)
    check_initializable(model, init_fn, on_meta=on_meta)
    world_size = _world_size(devices)
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    with progress.stage("capture", log, times):
        captured, inputs, device = _capture(target, inputs, on_meta=on_meta, model=model,
                                            precision=setting.precision)
    given = devices
    devices = devices_for(given, world_size=world_size, memory_limit_bytes=limit,
                          ranks_per_node=ranks_per_node_for(given, world_size), device=device)
    cache, key, cached = _cached_plan(plan_cache, request, captured, inputs, devices,
                                      measure=given is None, device=device, options=options,
                                      setting=setting)
    if cached is not None:  # planned before: the saved plan, named
        request, devices = PlanRequest("file", path=str(cached.path), data=cached.plan), \
            cached.devices
    measure = None if cached is not None or given is not None else functools.partial(
        _measured_devices, plan_cache=plan_cache, device=device)  # collective
    with progress.stage("plan (profile, search)" if request.kind == "search"
                        else "plan (profile)", log, times):
        planned = plan_model(captured, inputs, request,
                             dataclasses.replace(setting, devices=devices), options,
                             decide=_decided_on_rank0, measure=measure)
    setting = planned.setting
    devices = setting.devices
    _prepare_graph(captured, planned.plan, inputs, times)
    candidates = (planned.plan, *planned.alternatives)
    _agree(captured, candidates, on_meta=on_meta, device=device)
    precision = setting.precision
    reduce_dtype = precision.reduce_dtype if precision is not None else None
    rank = group_rank(WORLD) if world_size > 1 else 0
    chosen = planned.plan
    if autotune and cached is None:
        with progress.stage(f"autotune ({len(candidates)} plans)", log, times):
            chosen = autotune_plans(
                list(candidates), functools.partial(_trial_module, captured, rank=rank,
                                                    reduce_dtype=reduce_dtype),
                inputs, optimizer=optimizer, limit_bytes=devices.memory_bytes,
                margin=devices.memory_margin)
        _check_ranks_agree(chosen)
    if cache is not None and cached is None and rank == 0:
        log.info("plan cache: saved the plan as %s", cache.put(key, chosen, devices))
    with progress.stage("shard", log, times):
        table = _shard(captured.gm, chosen, captured, rank=rank, reduce_dtype=reduce_dtype)
    if on_meta:
        with progress.stage("materialize", log, times):
            materialize_meta_model(model, table, device=device, init_fn=init_fn)
    compiled = OSDPModule(table, captured_by=captured.method, reduce_dtype=reduce_dtype,
                          io=CallCheck(io, _shape_guard(chosen, devices.memory_bytes)))
    del captured
    _collect_capture_cycles()
    log.info("compile_osdp: %.2f s (%s)", time.perf_counter() - start,
             ", ".join(f"{k} {v:.2f} s" for k, v in times.items()))
    return compiled


# ---- the stages of compile_osdp, in the order it runs them --------------------------------

def _precision(mixed_precision: Any, request: PlanRequest) -> MixedPrecision | None:
    """The mixed precision asked for, else the plan's (a plan file or Plan records one)."""
    precision = resolve_mixed_precision(mixed_precision)
    if precision is None and request.kind != "search" and request.precision is not None:
        precision = MixedPrecision(*map(dtype_from_name, request.precision))
    return precision


def _world_size(devices: Devices | None) -> int:
    """This process's world size, checked against ``devices``."""
    initialized = dist.is_available() and dist.is_initialized()
    size = group_size(WORLD) if initialized else 1
    if devices is not None and devices.world_size not in (1, size):
        if not initialized:
            raise InputError(
                f"Devices(world_size={devices.world_size}) needs a process group of that many "
                "ranks: launch with torchrun and call torch.distributed.init_process_group() "
                "before compile_osdp (to plan offline for hardware you do not have, use "
                "`python -m osdp_fx plan`)"
            )
        raise InputError(
            f"Devices(world_size={devices.world_size}) does not match the process group's "
            f"{size} ranks; describe the world you are running in"
        )
    return size


def _capture(target: nn.Module, inputs: tuple[Any, ...], *, on_meta: bool, model: nn.Module,
             precision: MixedPrecision | None,
             ) -> tuple[Captured, tuple[Any, ...], torch.device]:
    """The captured graph, the inputs it was captured with, and the device the model runs on.
    A model on the meta device is captured and planned there; its values come after
    sharding (``training/materialize.py``). Under mixed ``precision`` a model torch.export
    captures is traced in the compute dtype."""
    dtype = precision.param_dtype if precision is not None else None
    if on_meta:
        device = materialize_device(inputs)
        inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
        return capture(target, inputs, device=device, compute_dtype=dtype), inputs, device
    return (capture(target, inputs, device="cpu", compute_dtype=dtype), inputs,
            model_device(model, inputs))


def _cached_plan(plan_cache: Any, request: PlanRequest, captured: Captured,
                 inputs: tuple[Any, ...], devices: Devices, *, measure: bool,
                 device: torch.device, options: SearchOptions, setting: StepSetting,
                 ) -> tuple[PlanCache | None, str, CachedPlan | None]:
    """The plan cache of a search, the search's key, and rank 0's entry for it (collective),
    or (None, "", None) when there is no search or no cache. ``devices``: the world asked for,
    whose figures the search would ``measure`` (or take as given)."""
    directory = cache_dir(plan_cache)
    if request.kind != "search" or directory is None:
        return None, "", None
    cache = PlanCache(directory)
    key = plan_key(captured, inputs, devices=devices, measured=measure, device=device,
                   options=options, setting=setting)
    cached = _decided_on_rank0(lambda: cache.get(key))
    log.info("plan cache: %s", f"using {cached.path}" if cached is not None
             else f"no plan in {directory} for this model, inputs, devices and options")
    return cache, key, cached


def _measured_devices(devices: Devices, *, plan_cache: Any, device: torch.device) -> Devices:
    """``devices`` (the world asked for) with the figures of the machine it runs on (collective):
    rank 0's cached measurement of this machine, world and backend when the cache holds one
    (``planner/cache.py``, next to the plans), else measured now (``detect_devices``) and
    cached by rank 0."""
    directory = cache_dir(plan_cache)
    store = DevicesCache(directory / DEVICES_FOLDER) if directory is not None else None
    key = ""
    if store is not None:
        backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else ""
        key = devices_key(devices, backend=backend, device=device)
        found = _decided_on_rank0(lambda: store.get(key))
        if found is not None:
            log.info("devices: the figures measured before on this machine, %s", found.path)
            return with_figures(devices, found.devices)
    result = measured(devices)
    if store is not None and (group_rank(WORLD) if devices.world_size > 1 else 0) == 0:
        log.info("devices: measured, kept as %s", store.put(key, result))
    return result


def _prepare_graph(captured: Captured, plan: Plan, inputs: tuple[Any, ...],
                   times: dict[str, float]) -> None:
    """The graph passes the plan's candidates share before sharding: its recomputed regions,
    then which nodes alias which parameters."""
    recompute = [RecomputeRegions(dict(plan.recompute))] if plan.recompute else []
    with progress.stage("aliases", log, times):
        run_pipeline(captured.gm, [*recompute, AnnotateAliases(
            inputs, meta_device=captured.materialize_device)])


def _agree(captured: Captured, candidates: Sequence[Plan], *, on_meta: bool,
           device: torch.device) -> None:
    """Collective: every rank holds the same plans and the same values (rank 0's, or, on the
    meta device, the same random state to initialise them), and the mesh a plan needs."""
    for candidate in candidates:
        _check_ranks_agree(candidate)
    if on_meta:
        check_same_rng_state(device)
    else:
        _broadcast_from_rank0(captured.gm)
    if any(traits(p.strategy).needs_mesh for c in candidates for p in c.params):
        init_mesh(candidates[0].world_size, candidates[0].ranks_per_node)


def _shape_guard(plan: Plan, limit: int | None) -> ShapeGuard | None:
    """What checks a call's shape against the memory limit (None: no prediction)."""
    # rank 0's predictions on every rank, so that every rank decides alike (collective)
    pr = _decided_on_rank0(lambda: plan.prediction)
    if pr is None or limit is None:
        return None
    return ShapeGuard(pr.batch_size, pr.seq_len, limit, pr.peak_bytes_at)


def _shard(gm: fx.GraphModule, plan: Plan, captured: Captured, *, rank: int,
           reduce_dtype: torch.dtype | None) -> ParamTable:
    """Shard ``gm`` (the captured graph, or a copy of it) under ``plan``: this rank's table."""
    gm = run_pipeline(gm, [ShardParameters(plan, rank=rank, group=WORLD,
                                           reduce_dtype=reduce_dtype)])
    return ParamTable(gm, plan, state_keys=captured.state_keys,
                      alias_to_name=captured.alias_to_name, splits=captured.splits, rank=rank)


def _trial_module(captured: Captured, plan: Plan, *, rank: int,
                  reduce_dtype: torch.dtype | None) -> OSDPModule:
    """A compiled module of ``plan`` on a copy of the captured graph (autotuning): its
    parameters are copies, so training it leaves the model's values alone."""
    table = _shard(copy.deepcopy(captured.gm), plan, captured, rank=rank,
                   reduce_dtype=reduce_dtype)
    return OSDPModule(table, captured_by=captured.method, reduce_dtype=reduce_dtype)


def _collect_capture_cycles() -> None:
    """[Note: capture cycles] Free what capture and profiling left in reference cycles.

    ``torch.fx`` tracing inspects its caller's frame (``Proxy.__iter__`` keeps
    ``inspect.currentframe()`` in a local of that frame), and ``torch.export`` builds closures
    and bytecode objects that refer to each other: thousands of objects in cycles whose frames
    hold the model, its modules and tensors of the example forward. Nothing frees them until
    Python's cyclic collector happens to run, possibly many training steps later, so the first
    steps would hold a second copy of the model on top of the planned peak. One collection here,
    when nothing of the capture is referenced any more, frees them before the first step.
    """
    start = time.perf_counter()
    freed = gc.collect()
    log.debug("freed %d objects left in reference cycles by capture in %.3f s", freed,
              time.perf_counter() - start)


def _decided_on_rank0(choose: Callable[[], Any]) -> Any:
    """Rank 0 runs ``choose`` (a search) and every rank gets its result, or raises its error:
    the other ranks search nothing (measured costs differ slightly between ranks, and one
    decision is what they must share)."""
    if group_size(WORLD) == 1:
        return choose()
    box: list[Any] = [None]
    mine: Exception | None = None
    if group_rank(WORLD) == 0:
        try:
            box[0] = (True, choose())
        except Exception as error:  # every rank raises it
            mine = error
            box[0] = (False, error if _picklable(error) else OSDPError(
                f"rank 0: {type(error).__name__}: {error}"))
    dist.broadcast_object_list(box, src=0)
    if mine is not None:
        raise mine
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _check_ranks_agree(plan: Plan) -> None:
    """Compare plan hashes across ranks before any other collective; raise on every rank."""
    if group_size(WORLD) == 1:
        return
    mine = (plan.hash(), plan.counts())
    everyone: list[Any] = [None] * group_size(WORLD)
    dist.all_gather_object(everyone, mine)
    if any(h != mine[0] for h, _ in everyone):
        per_rank = "\n".join(f"  rank {r}: hash {h} {c}" for r, (h, c) in enumerate(everyone))
        raise PlanMismatchError(
            "ranks compiled different plans, so their collectives would not match:\n"
            f"{per_rank}\nCall compile_osdp with the same model, plan and memory limit on "
            "every rank (a searched plan must be computed from the same inputs everywhere)"
        )


def _broadcast_from_rank0(gm: fx.GraphModule) -> None:
    with torch.no_grad():
        for t in (*gm.parameters(), *gm.buffers()):
            broadcast_(t.data, WORLD)

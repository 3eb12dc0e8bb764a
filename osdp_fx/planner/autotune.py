"""Autotuning: time the best predicted plans on the user's inputs and keep the fastest that fits.

``compile_osdp(autotune=K)`` searches as usual, then builds the K plans that fit with the least
predicted step times (distinct plans: strategies and schedule, ``schedule.rank_schedules``), and
up to K more that the models predict faster still, whose predicted peak lies between the memory
margin and the limit (``Devices.memory_margin``: the prediction alone does not promise those).
Each is built on a copy of the captured graph, one at a time, and trained on the example inputs:
one warm-up step, one step whose peak memory the storage tracker measures
(:func:`step_peak_bytes`), then :data:`TIMED_STEPS` timed steps (forward, backward with its
gradient collectives, and a step of the optimizer kind the plan was made for). The copies have
parameters of their own, so the model's values never change. A step's time and peak are the
slowest and the fullest rank's (all-reduced, MAX), so every rank sees the same figures and
keeps the same plan (:func:`keep_index`): among the plans measured under the limit, the fastest
measured, when it is faster than the predicted best by more than the timing's noise; else the
predicted best. The plans are timed one after the other, so before a measured plan overrules
the prediction the two are timed once more in the reverse order (a steady drift of the machine
cancels) and the decision is made again on all their steps. A plan above the margin is thus
kept only when it measured under the limit and faster. The plan in force records every figure
measured (``Plan.measured``). Autotuning costs about ``2K * (TIMED_STEPS + 2)`` steps plus as
many shard passes (and two more plans' worth when the prediction is overruled);
``compile_osdp`` logs its seconds.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from ..errors import InputError
from ..plan.plan import Plan, TimedPlan
from ..runtime.collectives import WORLD, group_size
from ..runtime.storage_tracker import StorageTracker, dense_tensors
from .analysis import MEMORY_MARGIN, plannable_bytes

log = logging.getLogger(__name__)

TIMED_STEPS = 8
"""Steps timed per plan (after one warm-up step); the median is kept. Steps on a loaded machine
vary from one to the next by more than the plans compared differ, so a few steps are not
enough to tell them apart."""

NOISE_SIGMAS = 2.0
"""A measured plan replaces the predicted best only when faster by this many standard errors."""


def check_autotune(autotune: Any, *, search: bool, on_meta: bool) -> None:
    """Raise InputError unless ``autotune`` is None or an int >= 0 that can be used here."""
    if autotune is None:
        return
    if isinstance(autotune, bool) or not isinstance(autotune, int) or autotune < 0:
        raise InputError(f"autotune={autotune!r} is not a number of plans: pass an int >= 1 "
                         "(how many of the best predicted plans to time), or None / 0 to keep "
                         "the predicted best")
    if autotune and not search:
        raise InputError("autotune times searched plans: use it with plan=None (the search), "
                         "or leave it out to run the plan you gave")
    if autotune and on_meta:
        raise InputError("autotune times training steps, which needs parameter values: build "
                         "the model on a real device, or leave autotune out")


def _optimizer(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(params, lr=1e-3)


def _loss(out: Any) -> torch.Tensor:
    leaves = [t for t in tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not leaves:
        raise InputError("autotune needs a model output that depends on trainable parameters "
                         "(it runs backward on the sum of the floating outputs); leave autotune "
                         "out for this model")
    return sum(t.float().sum() for t in leaves)  # type: ignore[return-value]


def step_peak_bytes(module: nn.Module, inputs: tuple[Any, ...],
                    optimizer: torch.optim.Optimizer) -> int:
    """The fullest rank's peak bytes over one training step of ``module`` (which should have run
    a step already, so that the optimizer's state exists): what the step adds to what the
    process held before it, plus the module's parameters, buffers and optimizer state and the
    inputs, each storage once. On the CPU the independent storage tracker measures it
    (``runtime/storage_tracker.py``); on a GPU, ``torch.cuda.max_memory_allocated``. Collective."""
    own = {d.untyped_storage()._cdata: d.untyped_storage().nbytes() for t in (
        *module.parameters(), *module.buffers(),
        *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        *(x for x in tree_leaves(inputs) if isinstance(x, torch.Tensor))) for d in dense_tensors(t)}
    device = next(module.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        _train_step(module, inputs, optimizer)
        torch.cuda.synchronize(device)
        added = torch.cuda.max_memory_allocated(device) - start
    else:
        tracker = StorageTracker()
        with tracker:
            _train_step(module, inputs, optimizer)
        added = tracker.peak_bytes - tracker.start_bytes
    peak = torch.tensor([float(added + sum(own.values()))], dtype=torch.float64)
    if group_size(WORLD) > 1:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _train_step(module: nn.Module, inputs: tuple[Any, ...],
                optimizer: torch.optim.Optimizer) -> None:
    _loss(module(*inputs)).backward()
    optimizer.step()
    optimizer.zero_grad()


def measure_plan(module: nn.Module, inputs: tuple[Any, ...], *, optimizer: str,
                 steps: int = TIMED_STEPS, peak: bool = True) -> tuple[list[float], int]:
    """The slowest rank's seconds for each of ``steps`` training steps of ``module`` on
    ``inputs``, and the fullest rank's peak bytes (:func:`step_peak_bytes`; 0 without
    ``peak``), measured on a step of its own after one warm-up step (the tracker slows the step
    it watches). Collective."""
    opt = _optimizer(optimizer, [p for p in module.parameters() if p.requires_grad])
    _train_step(module, inputs, opt)  # the optimizer's state exists from here on
    peak_bytes = step_peak_bytes(module, inputs, opt) if peak else 0
    world = group_size(WORLD) > 1
    times = []
    for _ in range(steps):
        if world:
            dist.barrier()
        start = time.perf_counter()
        _train_step(module, inputs, opt)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if world:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed.item()))
    return times, peak_bytes


def median_error_s(times: Sequence[float]) -> float:
    """The standard error of the median of ``times``, from their median absolute deviation
    (robust to the few slow steps a loaded machine adds)."""
    if len(times) < 2:
        return 0.0
    mad = statistics.median(abs(t - statistics.median(times)) for t in times)
    return 1.2533 * 1.4826 * mad / len(times) ** 0.5


def keep_index(times: Sequence[Sequence[float]], fits: Sequence[bool] | None = None) -> int:
    """Which plan autotuning keeps, given each plan's step times, the predicted best first, and
    whether each measured under the memory limit (default: all did). The reference is the
    predicted best, or the first plan in predicted order that fits when it does not; the
    fastest plan that fits (least median) replaces it if its median is below the reference's by
    more than :data:`NOISE_SIGMAS` standard errors of the difference. A measurement that cannot
    tell two plans apart does not overrule the prediction; a plan measured over the limit is
    never kept, unless none fits (then the predicted best)."""
    fits = [True] * len(times) if fits is None else list(fits)
    fitting = [i for i in range(len(times)) if fits[i]]
    if not fitting:
        return 0
    medians = [statistics.median(t) for t in times]
    ref = _reference(fits)
    fastest = min(fitting, key=lambda i: (medians[i], i))
    noise = (median_error_s(times[ref]) ** 2 + median_error_s(times[fastest]) ** 2) ** 0.5
    return fastest if medians[ref] - medians[fastest] > NOISE_SIGMAS * noise else ref


def _reference(fits: Sequence[bool]) -> int:
    """The plan a measurement must beat: the first in predicted order that fits (0 if none)."""
    return next((i for i, f in enumerate(fits) if f), 0)


def autotune_plans(plans: Sequence[Plan], build: Callable[[Plan], nn.Module],
                   inputs: tuple[Any, ...], *, optimizer: str, limit_bytes: int | None,
                   margin: float = MEMORY_MARGIN) -> Plan:
    """Time each of ``plans`` (the predicted best first; ``build`` makes a compiled module of
    one), measure its peak, and return the one :func:`keep_index` keeps among those measured
    under ``limit_bytes`` (None: no limit), recording every plan's figures (``TimedPlan``),
    fastest measured first. Collective."""
    start = time.perf_counter()

    def measured(plan: Plan, *, peak: bool) -> tuple[list[float], int]:
        module = build(plan)
        # what building left in reference cycles goes now, as compile_osdp frees it before it
        # returns ([Note: capture cycles]): collected during the measured step, it would count
        # against the step's peak
        gc.collect()
        out = measure_plan(module, inputs, optimizer=optimizer, peak=peak)
        del module
        gc.collect()  # the next plan's module must not share memory with this one
        return out

    times, peaks = map(list, zip(*(measured(plan, peak=True) for plan in plans)))
    fits = [limit_bytes is None or p <= limit_bytes for p in peaks]
    kept = keep_index(times, fits)
    ref = _reference(fits)
    if kept != ref:
        # Before overruling the prediction, time the two again in the reverse order (ref ...
        # kept, then kept, ref): the plans were timed one after the other, and a machine that
        # slowed down between them would favour the earlier. Over both passes a drift that is
        # steady cancels; the decision uses all the steps.
        for i in (kept, ref):
            times[i] = [*times[i], *measured(plans[i], peak=False)[0]]
        kept = (ref, kept)[keep_index([times[ref], times[kept]])]
    if not fits[kept]:
        log.warning("autotune: every plan timed measured over the memory limit (%s); keeping "
                    "the predicted best", ", ".join(f"{p / 2**20:.1f} MiB" for p in peaks))
    best = plans[kept]
    order = sorted(range(len(plans)), key=lambda i: (statistics.median(times[i]), i))
    record = tuple(TimedPlan(
        plans[i].hash(), plans[i].step_time_s or 0.0, statistics.median(times[i]),
        plans[i].peak_memory_bytes or 0, peaks[i],
        role=_role(plans, i, limit_bytes, margin)) for i in order)
    log.info("autotune: timed %d plans in %.2f s (%s); keeping %s", len(plans),
             time.perf_counter() - start,
             ", ".join(f"{t.hash} {t.measured_step_s * 1e3:.1f} ± "
                       f"{median_error_s(times[i]) * 1e3:.1f} ms, "
                       f"{t.measured_peak_bytes / 2**20:.1f} MiB" for t, i in zip(record, order)),
             best.hash())
    return dataclasses.replace(best, measured=record, source=f"{best.source}, autotuned")


def _role(plans: Sequence[Plan], i: int, limit_bytes: int | None, margin: float) -> str:
    if i == 0:
        return "predicted best"
    above = limit_bytes is not None and (plans[i].peak_memory_bytes or 0) > plannable_bytes(
        limit_bytes, margin)
    return "above the margin" if above else "alternative"

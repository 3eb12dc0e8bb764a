"""Autotuning: time the best predicted plans on the user's inputs and keep the fastest.

``compile_osdp(autotune=K)`` searches as usual, then builds the K plans that fit with the least
predicted step times (distinct plans: strategies and schedule, ``schedule.rank_schedules``), one
at a time on a copy of the captured graph, and times :data:`TIMED_STEPS` training steps of each
(after one warm-up step) on the example inputs: forward, backward with its gradient collectives,
and a step of the optimizer kind the plan was made for. The copies have parameters of their own,
so the model's values never change. A step's time is the slowest rank's (all-reduced, MAX), so
every rank sees the same times and keeps the same plan: the fastest measured, when it is faster
than the predicted best by more than the timing's noise (:func:`keep_index`), else the predicted
best. The plan in force records every time measured (``Plan.measured``). Autotuning costs
about ``K * (TIMED_STEPS + 1)`` steps plus K shard passes; ``compile_osdp`` logs its seconds.
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

from .errors import InputError
from .plan import Plan
from .runtime.collectives import WORLD, group_size

log = logging.getLogger(__name__)

TIMED_STEPS = 8
"""Steps timed per plan (after one warm-up step); the median is kept. A step on a loaded
2-core machine varies by ±15 %: the median of 3 could not tell plans 5 % apart."""

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


def step_times_s(module: nn.Module, inputs: tuple[Any, ...], *, optimizer: str,
                 steps: int = TIMED_STEPS) -> list[float]:
    """The slowest rank's seconds for each of ``steps`` steps (after one warm-up) of a forward,
    backward and optimizer step of ``module`` on ``inputs``. Collective."""
    opt = _optimizer(optimizer, [p for p in module.parameters() if p.requires_grad])
    world = group_size(WORLD) > 1
    times = []
    for _ in range(steps + 1):
        if world:
            dist.barrier()
        start = time.perf_counter()
        _loss(module(*inputs)).backward()
        opt.step()
        opt.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        if world:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed.item()))
    return times[1:]


def median_error_s(times: Sequence[float]) -> float:
    """The standard error of the median of ``times``, from their median absolute deviation
    (robust to the few slow steps a loaded machine adds)."""
    if len(times) < 2:
        return 0.0
    mad = statistics.median(abs(t - statistics.median(times)) for t in times)
    return 1.2533 * 1.4826 * mad / len(times) ** 0.5


def keep_index(times: Sequence[Sequence[float]]) -> int:
    """Which plan autotuning keeps, given each plan's step times, the predicted best first: the
    fastest measured (least median), if its median is below the predicted best's by more than
    :data:`NOISE_SIGMAS` standard errors of the difference; else the predicted best (0). A
    measurement that cannot tell two plans apart does not overrule the prediction."""
    medians = [statistics.median(t) for t in times]
    fastest = min(range(len(times)), key=lambda i: (medians[i], i))
    noise = (median_error_s(times[0]) ** 2 + median_error_s(times[fastest]) ** 2) ** 0.5
    return fastest if medians[0] - medians[fastest] > NOISE_SIGMAS * noise else 0


def autotune_plans(plans: Sequence[Plan], build: Callable[[Plan], nn.Module],
                   inputs: tuple[Any, ...], *, optimizer: str) -> Plan:
    """Time each of ``plans`` (the predicted best first; ``build`` makes a compiled module of
    one) and return the one :func:`keep_index` keeps, recording every plan's (hash, predicted,
    measured median) step seconds, fastest measured first. Collective."""
    start = time.perf_counter()
    times: list[list[float]] = []
    for plan in plans:
        module = build(plan)
        times.append(step_times_s(module, inputs, optimizer=optimizer))
        del module
        gc.collect()  # the next plan's module must not share memory with this one
    best = plans[keep_index(times)]
    order = sorted(range(len(plans)), key=lambda i: (statistics.median(times[i]), i))
    record = tuple((plans[i].hash(), plans[i].step_time_s or 0.0, statistics.median(times[i]))
                   for i in order)
    log.info("autotune: timed %d plans in %.2f s (%s); keeping %s", len(plans),
             time.perf_counter() - start,
             ", ".join(f"{h} {m * 1e3:.1f} ± {median_error_s(times[i]) * 1e3:.1f} ms"
                       for (h, _, m), i in zip(record, order)), best.hash())
    return dataclasses.replace(best, measured=record, source=f"{best.source}, autotuned")

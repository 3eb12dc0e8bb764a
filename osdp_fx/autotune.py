"""Autotuning: time the best predicted plans on the user's inputs and keep the fastest.

``compile_osdp(autotune=K)`` searches as usual, then builds the K plans that fit with the least
predicted step times (distinct plans: strategies and schedule, ``schedule.rank_schedules``), one
at a time on a copy of the captured graph, and times :data:`TIMED_STEPS` training steps of each
(after one warm-up step) on the example inputs: forward, backward with its gradient collectives,
and a step of the optimizer kind the plan was made for. The copies have parameters of their own,
so the model's values never change. A step's time is the slowest rank's (all-reduced, MAX), so
every rank sees the same times and keeps the same plan; the plan in force records every time
measured (``Plan.measured``). Autotuning costs about ``K * (TIMED_STEPS + 1)`` steps plus K
shard passes; ``compile_osdp`` logs its seconds.
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


def step_time_s(module: nn.Module, inputs: tuple[Any, ...], *, optimizer: str,
                steps: int = TIMED_STEPS) -> float:
    """Median over ``steps`` steps (after one warm-up) of the slowest rank's seconds for a
    forward, backward and optimizer step of ``module`` on ``inputs``. Collective."""
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
    return statistics.median(times[1:])


def autotune_plans(plans: Sequence[Plan], build: Callable[[Plan], nn.Module],
                   inputs: tuple[Any, ...], *, optimizer: str) -> Plan:
    """Time each of ``plans`` (``build`` makes a compiled module of one) and return the fastest
    measured, recording every plan's (hash, predicted, measured) step seconds. Collective."""
    start = time.perf_counter()
    measured: list[tuple[float, int, Plan]] = []
    for i, plan in enumerate(plans):
        module = build(plan)
        measured.append((step_time_s(module, inputs, optimizer=optimizer), i, plan))
        del module
        gc.collect()  # the next plan's module must not share memory with this one
    measured.sort(key=lambda m: m[:2])
    best = measured[0][2]
    record = tuple((p.hash(), p.step_time_s or 0.0, s) for s, _, p in measured)
    log.info("autotune: timed %d plans in %.2f s (%s); keeping %s", len(plans),
             time.perf_counter() - start,
             ", ".join(f"{h} {m * 1e3:.1f} ms" for h, _, m in record), best.hash())
    return dataclasses.replace(best, measured=record, source=f"{best.source}, autotuned")

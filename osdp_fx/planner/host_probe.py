"""What the runtime itself costs on the host, measured: ``detect_devices``'s probe of the figures
``Devices.param_host_time_s``, ``Devices.bucket_host_time_s``,
``Devices.replica_host_time_s`` and ``Devices.optimizer_sharded_tensor_time_s``.

A compiled step spends host time that neither its operators' profile nor its collectives'
link figures hold ([Note: the host lane] in ``cost_models/step.py``): per sharded parameter,
its copies into and out of its gather bucket's flat buffers, its ``DTensor`` views, the handle
that re-gathers it in backward, its gradient's packing and the accumulation of the reduced
shard; per gather bucket, the launch and completion of its collectives; per replicated
parameter, the reducer's hook and bucket copies; per sharded parameter in the optimizer, the
``DTensor`` dispatch of its update.

The probe runs what a compiled module runs, through the runtime's own functions
(``runtime/forward.py``'s ``ModuleRuntime``, ``runtime/params.py``'s gathers): a chain of
``k`` small square matmuls whose weights are gathered in one bucket (the way the runtime
gathers small parameters), forward and backward, once with ``k = 8`` and once with ``k = 40``.
The difference divided by 32 is one parameter's time; the same chain over plain tensors, timed
the same way, is subtracted (its operators are the profile's). The collectives are the same in
both runs (one bucket), so their time cancels too. A bucket's time is the chain of 40 gathered
in 8 buckets against the same chain in one, less the time of one bucket's collectives run bare
(which the link figures hold). A replicated parameter of a plan that shards others: the
replicated chains with their weights as ``Replicate()`` DTensors read as leaves of autograd,
their slope less the plain replicated chains' (in a world of several ranks only). Every
chain is timed in the same rounds, one after the other in each round (``detect_devices``'
interleaved timing), so the differences are of runs that met the same state of the machine. On the CPU each is timed by the rank's own thread's clock
([Note: host time by the thread's clock] in ``planner/detect.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..core.strategies import Strategy, traits

PROBE_PARAMS = (8, 40)
"""The probe's two chain lengths (parameters per bucket)."""
PROBE_SIDE = 16
"""Side of the probe's square weights: 1 KiB each in fp32, far below any gather bucket."""
PROBE_BUCKETS = 8
"""Buckets the probe's long chain is gathered in for the per-bucket figure."""
_MEASURED = (Strategy.REPLICATE, Strategy.SHARD_GRAD_OP, Strategy.FULL_SHARD)
"""Strategies the probe runs; hybrid_shard and hierarchical free and re-gather like full_shard
and take its figure (their two-level collectives' time is their links')."""


@dataclasses.dataclass(frozen=True)
class HostTimes:
    """The probe's figures: host seconds per step of the runtime under each strategy."""

    param_s: dict[str, float]
    """Per parameter (``Devices.param_host_time_s``)."""
    bucket_s: dict[str, float]
    """Per gather bucket beyond its members, for the sharded strategies
    (``Devices.bucket_host_time_s``)."""
    replica_s: float = 0.0
    """Per replicated parameter of a plan that shards others, beyond its figure in ``param_s``
    (``Devices.replica_host_time_s``)."""


def runtime_host_times(times: Callable[[Sequence[Callable[[], object]]], list[float]], *,
                       world_size: int, rank: int, device: Any = "cpu") -> HostTimes:
    """The runtime's host time per parameter and per gather bucket (module docstring), over
    the default process group (or one process without one). ``times(runs)`` gives each run's
    time as ``detect_devices`` takes it (on every rank together, the runs interleaved round
    by round, so that a slow spell of the machine falls on all of them alike); the chains'
    tensors are on ``device``, where the runtime's are.

    Per parameter: the slope between the chains of ``PROBE_PARAMS`` under each strategy, less
    the plain chain's slope. Per bucket (full_shard's, measured: its bucket runs the most
    collectives, an all-gather, a re-gather and a reduce-scatter; a measurement per strategy
    doubled the probe's time for figures within its noise): the long chain gathered in
    ``PROBE_BUCKETS`` buckets against the same chain in one, the difference over the extra
    buckets, less one bucket's collectives run bare (:func:`_bucket_collectives`). A bucket's
    collectives are launched, waited for and completed on the host: the autograd function
    around its all-gather, its send buffer, the release of its output, its re-gather's saved
    handle, its gradients' flat buffer and the reduced chunk copied out."""
    low, high = PROBE_PARAMS
    runs: dict[tuple[str, int], Callable[[], object]] = {}
    for k in PROBE_PARAMS:
        runs["plain", k] = _plain_step(k, device)
        for strategy in _MEASURED:
            runs[strategy.value, k] = _runtime_step(strategy, k, world_size, rank, device)
    fs = Strategy.FULL_SHARD
    runs["buckets", high] = _runtime_step(fs, high, world_size, rank, device,
                                          buckets=PROBE_BUCKETS)
    runs["bare", high // PROBE_BUCKETS] = _bucket_collectives(fs, high // PROBE_BUCKETS,
                                                              world_size, device)
    if world_size > 1:
        for k in PROBE_PARAMS:
            runs["replica", k] = _runtime_step(Strategy.REPLICATE, k, world_size, rank, device,
                                               as_replicas=True)
    t = dict(zip(runs, times(list(runs.values()))))

    def slope(kind: str) -> float:
        return (t[kind, high] - t[kind, low]) / (high - low)

    param_s = {s.value: max(0.0, slope(s.value) - slope("plain")) for s in _MEASURED}
    for strategy in Strategy:
        param_s.setdefault(strategy.value, param_s[fs.value])
    bucket = max(0.0, (t["buckets", high] - t[fs.value, high]) / (PROBE_BUCKETS - 1)
                 - t["bare", high // PROBE_BUCKETS])
    replica = (max(0.0, slope("replica") - slope(Strategy.REPLICATE.value))
               if world_size > 1 else 0.0)
    return HostTimes(param_s, {s.value: bucket for s in Strategy if traits(s).sharded}, replica)


def sharded_optimizer_tensor_times(
    times: Callable[[Sequence[Callable[[], object]]], list[float]], optimizers: tuple[str, ...],
    make_optimizer: Callable[[str, list[Any]], Any], *, world_size: int, rank: int,
    device: Any = "cpu",
) -> list[float]:
    """Per optimizer kind, the step time per tensor over 64 small sharded parameters (DTensors
    on ``device``, as the compiled module hands them to the optimizer, stepped as it steps
    them: [Note: local optimizer steps]; on a GPU its default foreach step); ``times`` as in
    :func:`runtime_host_times`."""
    import torch

    from ..runtime.params import make_shard
    from ..runtime.sharded import as_dtensor

    side, tensors = PROBE_SIDE, 64
    steps = []
    for kind in optimizers:
        params = [as_dtensor(make_shard(torch.nn.Parameter(torch.randn(side, side,
                                                                       device=device)),
                                        world_size=world_size, rank=rank),
                             (side, side), Strategy.FULL_SHARD.value, world_size=world_size,
                             ranks_per_node=None, rank=rank)
                  for _ in range(tensors)]
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = make_optimizer(kind, params)
        optimizer.step()  # creates the state
        steps.append(optimizer.step)
    return [t / tensors for t in times(steps)]


def _bucket_collectives(strategy: Strategy, members: int, world_size: int,
                        device: Any) -> Callable[[], object]:
    """One bucket's collectives alone, as the runtime's collective functions run them: its
    all-gather (twice where backward re-gathers) and its gradients' reduce-scatter. Their time
    is the link figures' (``detect._time_collectives`` times the same functions), so the
    bucket's host time is what the runtime adds around them."""
    import torch

    from ..runtime.collectives import WORLD, all_gather_flat_start, reduce_scatter_flat_start

    numel = -(-members * PROBE_SIDE * PROBE_SIDE // world_size) * world_size
    shard = torch.zeros(numel // world_size, device=device)
    gathers = 2 if traits(strategy).freed_after_forward else 1

    def run() -> None:
        for _ in range(gathers):
            all_gather_flat_start(shard, WORLD).wait()
        reduce_scatter_flat_start(torch.empty(numel, device=device), WORLD, consume=True).wait()

    return run


def _plain_step(k: int, device: Any) -> Callable[[], object]:
    import torch

    weights = [torch.nn.Parameter(torch.randn(PROBE_SIDE, PROBE_SIDE, device=device))
               for _ in range(k)]
    x = torch.randn(4, PROBE_SIDE, device=device)

    def step() -> None:
        y = x
        for w in weights:
            y = y @ w
        y.sum().backward()
        for w in weights:
            w.grad = None

    return step


def _runtime_step(strategy: Strategy, k: int, world_size: int, rank: int,
                  device: Any, *, buckets: int = 1,
                  as_replicas: bool = False) -> Callable[[], object]:
    """One forward and backward of the probe's chain as a compiled module runs it under
    ``strategy``, a sharded chain gathered in ``buckets`` buckets of equal length (gradients
    set to None after each, as ``zero_grad()`` does); ``as_replicas``: a replicated chain's
    weights are ``Replicate()`` DTensors read as the leaves of autograd, as in a plan that
    shards other groups (``runtime/sharded.py``, [Note: a replicated parameter's local
    leaf])."""
    import torch

    from ..runtime.accumulation import GradSync, HeldGrads
    from ..runtime.collectives import WORLD
    from ..runtime.forward import ModuleRuntime
    from ..runtime.params import (
        GradReduceScatters,
        all_gather_params,
        free_param,
        make_shard,
    )
    from ..runtime.reducer import GradReducer
    from ..runtime.sharded import as_dtensor, as_replicated, local_param, read_locally

    side, shape = PROBE_SIDE, (PROBE_SIDE, PROBE_SIDE)
    fulls = [torch.nn.Parameter(torch.randn(shape, device=device)) for _ in range(k)]
    t = traits(strategy)
    if t.sharded:
        params = [as_dtensor(make_shard(f, world_size=world_size, rank=rank), shape,
                             strategy.value, world_size=world_size, ranks_per_node=None,
                             rank=rank) for f in fulls]
        replicated = []
    else:
        params = replicated = fulls
    holder = None  # the replicas' module: their hooks hold it weakly
    if as_replicas:
        holder = torch.nn.Module()
        for i, f in enumerate(fulls):
            holder.register_parameter(f"w{i}", as_replicated(f, world_size=world_size))
            read_locally(holder.get_parameter(f"w{i}"), holder, f"w{i}")
        params = replicated = list(holder.parameters())
    held = HeldGrads()
    runtime = ModuleRuntime(
        GradSync(GradReducer(replicated, WORLD), GradReduceScatters(held=held), held),
        regather=t.freed_after_forward, prefetch=1)
    x = torch.randn(4, side, device=device)

    def step() -> None:
        with runtime.forward() as scope:
            weights = params
            if holder is not None:  # the leaves, read as the graph reads them
                weights = [local_param(p) for p in holder.parameters()]
            if t.sharded:
                per = k // buckets
                weights = [w for i in range(0, k, per) for w in all_gather_params(
                    tuple(params[i:i + per]), (shape,) * per, strategy.value, WORLD,
                    regather_together=True)]
            y = x
            for w in weights:
                y = y @ w
                if t.freed_after_forward:
                    free_param(w)
            scope.output = y.sum()
        scope.end().backward()
        for p in params:
            p.grad = None

    return step

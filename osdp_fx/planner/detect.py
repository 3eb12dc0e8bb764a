"""Measuring the devices of a running process group (``detect_devices``), and the ``Devices`` a
compile plans for (``devices_for``).

Dense matmul FLOP/s, memory bandwidth from a large copy, optimizer step times per element and
per tensor, and every collective's bandwidth and latency inside a node and across nodes, fitted
to the ring model (``cost_models.communication.fit_link``). Every rank runs the same benchmarks,
and every rank gets the same figures: timings are reduced to the slowest rank.

Kept apart from ``core/devices.py`` (the record of the hardware, which a plan made offline needs
without torch.distributed): measuring runs collectives and fits the cost models, two layers above
the record.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..core.devices import (
    OPTIMIZERS,
    OVERLAP_EFFICIENCY,
    SYNC_STRETCH_S,
    Devices,
    device_memory_bytes,
)
from ..core.presets import GPU_MEMORY_MARGIN, GPU_MEMORY_MARGIN_EXPANDABLE
from ..core.layout import WORLD
from ..core.strategies import COLLECTIVES
from ..cost_models.communication import (
    CollectiveSample,
    collective_time_s,
    fit_link,
)
from ..errors import InputError
from .host_probe import runtime_host_times, sharded_optimizer_tensor_times
from ..units import parse_bytes

log = logging.getLogger(__name__)


_COLLECTIVE_SIZES_BYTES = (*(2**k for k in range(12, 23, 2)), 2**23, 2**24)
"""Message sizes of the collective benchmarks, 4 KiB to 4 MiB by factors of 4, then 8 and 16
MiB: small ones give latency, large ones bandwidth, and together they span the parameters plans
move (a fit to fewer, wider-spaced sizes missed the times of the sizes in between on CPU gloo;
one to sizes up to 4 MiB missed gloo's larger ones, whose rate changes past it, and a step
from 4 to 16 MiB priced the sizes between on a line above their times, the rate climbing
near 16 MiB: ``docs/cost-models.md``)."""
_REPEATS = 5
"""Timed runs per benchmark (after one warmup); the median is kept."""
_PROBE_ROUNDS = 9
"""Rounds of the host probe (``host_probe.py``; ``_interleaved_times_s``), every chain timed
once per round."""
_OVERLAP_ROUNDS = 27
"""Rounds of the overlap probe (``_overlap_figures``): its figure is a difference of three
times, which over the host probe's 9 rounds swung from call to call far more than over 27
(``docs/benchmarks.md``, "How steady detection is")."""
_COLLECTIVE_REPEATS = 15
"""Rounds of the collective benchmarks (``_interleaved_times_s``): collectives between
processes sharing cores vary the most from run to run, and more rounds steady the fitted figures
(``docs/benchmarks.md``, "How steady detection is")."""


CPU_MEMORY_MARGIN = 0.0
"""``Devices.memory_margin`` that ``detect`` sets on the CPU. There a tensor's bytes are freed
when its storage is, with nothing cached, so what a step holds is what a storage tracker counts,
which is what the memory model predicts: equal or above on every plan measured so far (the
architectures of ``tests/distributed/test_zoo.py`` and the plans of ``benchmarks/optimality.py``,
``docs/cost-models.md``). A margin would only keep plans slower than the limit allows."""


def expandable_segments() -> bool:
    """Whether the caching allocator of this process runs with ``expandable_segments:True``
    (set through ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF``, or at run time)."""
    import os

    import torch

    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = get() if get is not None else ""
    settings = settings or os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get(
        "PYTORCH_CUDA_ALLOC_CONF", "")
    return "expandable_segments:true" in settings.replace(" ", "").lower()


def allocator_margin() -> float:
    """``Devices.memory_margin`` for a GPU under this process's caching allocator settings
    ([Note: the allocator's margin] in ``core/presets.py``)."""
    return GPU_MEMORY_MARGIN_EXPANDABLE if expandable_segments() else GPU_MEMORY_MARGIN


def detect_devices(
    *, memory_limit: int | str | None = None, group: Any = None,
    ranks_per_node: int | None = None,
) -> Devices:
    """Measure the devices of the running process group by microbenchmarks.

    Every rank of ``group`` (default: the world) must call it, since it runs collectives;
    every rank returns the same Devices (timings are reduced to the slowest rank first).
    Measured: dense matmul FLOP/s, memory bandwidth from a large copy, optimizer step
    times, what activation checkpointing adds per operator (selective and full), and, by a
    fit of the ring alpha-beta model to each of all-gather, reduce-scatter and all-reduce over
    sizes from 4 KiB to 4 MiB (16 MiB on a GPU), the bandwidth and latency of each collective
    inside a node (ranks sharing a host name) and across nodes (``collective_links``; the
    scope's figures are the all-reduce's). What the runtime itself costs on the host is
    measured over the default group (``group`` None): per parameter and per gather bucket per
    step by strategy, and the optimizer's per-tensor time over sharded parameters
    (``host_probe.py``). On the CPU, the share of hidden collective time that hiding saves:
    an all-gather run beside a computation against both alone ([Note: overlap on the CPU]),
    and whether each rank holds a core of its own (``Devices.prefetch_waits_for_ranks``).
    Figures that cannot be measured (inter-node on one node, all collectives without an
    initialized process group) keep their defaults. ``memory_limit`` (bytes or "8GiB")
    defaults to the device's memory on GPU and to ``DEFAULT_CPU_MEMORY_BYTES`` on CPU.
    ``ranks_per_node`` overrides the node layout found from host names. The benchmarks draw
    their tensors from a forked random generator: the caller's random stream is untouched.
    """
    import torch

    with torch.random.fork_rng():
        return _detect(memory_limit=memory_limit, group=group, ranks_per_node=ranks_per_node)


def _detect(*, memory_limit: int | str | None, group: Any, ranks_per_node: int | None) -> Devices:
    optimizers = OPTIMIZERS
    import torch
    import torch.distributed as dist

    from ..runtime.collectives import collective_device, process_group_copies_input

    distributed = dist.is_available() and dist.is_initialized()
    if group is not None and not distributed:
        raise InputError(
            "detect_devices(group=...) needs an initialized process group: call "
            "torch.distributed.init_process_group first, or omit group to measure one process"
        )
    world_size = dist.get_world_size(group) if distributed else 1
    device = collective_device(group) if distributed else torch.device("cpu")
    if ranks_per_node is None:
        ranks_per_node = _ranks_per_node_from_hosts(group) if world_size > 1 else 1
    if ranks_per_node < 1 or world_size % ranks_per_node:
        raise InputError(
            f"ranks_per_node={ranks_per_node} must divide the group's {world_size} ranks"
        )
    barrier = (lambda: dist.barrier(group=group)) if world_size > 1 else None

    figures: dict[str, Any] = {}
    if barrier is not None:
        barrier()  # ranks share the machine's cores while they measure, as when training
    # every rank at once, as a step runs ([Note: rates with every rank at once])
    flops_per_s = _matmul_flops_per_s(device, barrier)
    bandwidth = _copy_bandwidth_bytes_per_s(device, barrier)
    memory_bytes = (
        parse_bytes(memory_limit) if memory_limit is not None else device_memory_bytes(device)
    )
    # The slowest rank bounds a synchronous step, and every rank must plan with the same figures.
    flops_per_s, bandwidth, memory_bytes_f = _all_reduce_floats(
        [flops_per_s, bandwidth, float(memory_bytes)], "min", group, device, distributed
    )
    per_element, per_tensor = _optimizer_times(device, optimizers, barrier)
    measured = _all_reduce_floats([*per_element, *per_tensor], "max", group, device, distributed)
    selective_s, full_s = _all_reduce_floats(list(_recompute_op_times_s(device)), "max", group,
                                             device, distributed)
    # the wall seconds a second of a rank's work takes while every rank works at once
    share = _wall_per_cpu_second(barrier) if device.type == "cpu" else 1.0
    if group is None:  # the runtime's collectives run over the default group
        figures.update(_host_figures(device, optimizers, barrier, world_size, distributed,
                                     share))
    figures.update(
        selective_op_time_s=selective_s,
        full_recompute_op_time_s=full_s,
        compute_flops_per_s=flops_per_s,
        memory_bandwidth_bytes_per_s=bandwidth,
        memory_bytes=int(memory_bytes_f),
        optimizer_element_time_s=dict(zip(optimizers, measured[:len(optimizers)])),
        optimizer_tensor_time_s=dict(zip(optimizers, measured[len(optimizers):])),
    )
    if world_size > 1:
        figures.update(_measure_links(group, device, world_size, ranks_per_node))
        figures.update(_concurrent_collective_ratios(group, device))
        links = Devices(world_size=world_size, ranks_per_node=None if ranks_per_node == world_size
                        else ranks_per_node, **figures)
        figures.update(_overlap_figures(group, device, links))
        figures["sync_wait_s"] = _sync_wait_s(group, device, links)
        most, = _all_reduce_floats([share], "max", group, device, True)
        figures["prefetch_waits_for_ranks"] = device.type == "cpu" and most < _SHARED_CORES
    devices = Devices(
        world_size=world_size,
        ranks_per_node=None if ranks_per_node == world_size else ranks_per_node,
        source="detected", **figures,
        memory_margin=CPU_MEMORY_MARGIN if device.type == "cpu" else allocator_margin(),
        reduce_scatter_copies_input=distributed and process_group_copies_input(group),
        host_overlaps_device=device.type == "cuda",
        all_reduce_trees=distributed and str(dist.get_backend(group)) == "nccl",
    )
    log.info("detected %s", devices)
    return devices


def _host_figures(device: Any, optimizers: Sequence[str], barrier: Callable[[], object] | None,
                  world_size: int, distributed: bool, share: float) -> dict[str, Any]:
    """What the runtime costs on the host (``host_probe.py``): per parameter and per gather
    bucket per step by strategy, per replicated parameter of a plan that shards others, and
    the optimizer's per-tensor time over sharded parameters; the slowest rank's. On the CPU the
    thread's times are scaled by ``share`` (``_wall_per_cpu_second``)."""
    import torch.distributed as dist

    rank = dist.get_rank() if distributed else 0

    # On the CPU, the main thread's CPU time: what the runtime's work costs, without the waits
    # for the other ranks ([Note: host time by the thread's clock]). On a GPU the wall clock,
    # synchronized (the host waits for kernels).
    clock = time.thread_time if device.type == "cpu" else time.perf_counter

    def times(runs: Sequence[Callable[[], object]]) -> list[float]:
        return _interleaved_times_s(runs, device, barrier=barrier or (lambda: None),
                                    rounds=_PROBE_ROUNDS, clock=clock)

    host = runtime_host_times(times, world_size=world_size, rank=rank, device=device)
    param_s, bucket_s = host.param_s, host.bucket_s
    optimizer_s = sharded_optimizer_tensor_times(times, tuple(optimizers), _optimizer,
                                                 world_size=world_size, rank=rank, device=device)
    # a bucket's work is not scaled by the share: [Note: a bucket's work in the waits]
    slowest = iter(_all_reduce_floats(
        [*(share * t for t in param_s.values()), *bucket_s.values(),
         *(share * t for t in (*optimizer_s, host.replica_s))],
        "max", None, device, distributed))
    return {"param_host_time_s": dict(zip(param_s, slowest)),
            "bucket_host_time_s": dict(zip(bucket_s, slowest)),
            "optimizer_sharded_tensor_time_s": dict(zip(optimizers, slowest)),
            "replica_host_time_s": next(slowest)}


def _wall_per_cpu_second(barrier: Callable[[], object] | None) -> float:
    """The wall seconds one second of a rank's own work takes while every rank works at once,
    at least 1: more where the ranks outnumber the cores they share. The median over
    ``_SHARE_ROUNDS`` runs of a matmul loop, each after a barrier, of its wall over its
    thread's CPU time ([Note: host time by the thread's clock])."""
    import torch

    a = torch.randn(128, 128)
    ratios = []
    for i in range(1 + _SHARE_ROUNDS):
        if barrier is not None:
            barrier()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(_SHARE_MATMULS):
            torch.mm(a, a)
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        if i and cpu > 0:
            ratios.append(wall / cpu)
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


_SHARED_CORES = 1.5
"""The wall seconds per second of a rank's work (``_wall_per_cpu_second``) from which the ranks
share cores: halfway between a core each (1) and two ranks on a core (2). Below it, a gather
prefetched on the CPU waits for the ranks as one started at its use
(``Devices.prefetch_waits_for_ranks``)."""
_SHARE_MATMULS = 256
"""128x128 matmuls in one run of ``_wall_per_cpu_second``: some tens of milliseconds, longer
than the scheduler's time slices, so that ranks sharing a core take turns within it."""
_SHARE_ROUNDS = 5
"""Timed runs of ``_wall_per_cpu_second`` (after one warmup); the median is kept."""


# [Note: host time by the thread's clock]
# The host probe's figures are differences of two step times of a chain whose collectives wait
# for the other ranks. By the wall clock those waits vary from run to run by more than the
# runtime's own work per parameter, and the figure varied several times over between
# measurements on one idle machine (``docs/cost-models.md`` gives the figures). The
# rank's own thread's CPU time (``time.thread_time``) counts the work and not the waits, which
# the collectives' link figures hold: on the CPU, where the host is the device, the probe times
# by it. A second of CPU time is not a second of the step where the ranks outnumber the cores
# (four ranks on two cores each run half the time): the figures are scaled by the wall seconds
# a second of a rank's work takes while every rank works (``_wall_per_cpu_second``), as the
# profile's computation is timed by the wall with every rank at once. A GPU's host waits for
# its kernels, so there it times by the synchronized wall clock.

# [Note: a bucket's work in the waits]
# The share scales work done while every rank works at once. A gather bucket's own host work
# (``host_probe.py``: its collectives' launch and completion) runs around its collectives'
# waits, and where the ranks outnumber the cores those waits are every rank's gloo threads
# woken in turn while the cores idle: the work fills them. By the wall, with four ranks on two
# cores, the probe's chain in 8 buckets took about what its extra buckets' collectives take
# run bare, where the thread's figure scaled by the share charged each bucket twice its work
# (``docs/cost-models.md`` gives the figures). The wall's own figure carries the waits'
# noise, down to nothing at two ranks where the thread's figure fits the step of a plan of
# many buckets, so a bucket keeps the thread's figure, unscaled.


def _host_names(group: Any) -> list[str]:
    """Every rank's host name, in rank order."""
    import torch.distributed as dist

    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return hosts


def _ranks_per_node_from_hosts(group: Any) -> int:
    """Ranks per host name; the ranks of one node are expected to be consecutive."""
    hosts = _host_names(group)
    counts = {h: hosts.count(h) for h in hosts}
    if len(set(counts.values())) != 1:
        raise InputError(
            f"nodes run different numbers of ranks ({counts}); osdp-fx needs the same number on "
            f"every node: launch evenly, or pass detect_devices(ranks_per_node=...)"
        )
    per_node = next(iter(counts.values()))
    if any(hosts[i] != hosts[i - i % per_node] for i in range(len(hosts))):
        log.warning(
            "ranks of one host are not consecutive (%s); cost models assume node-major rank "
            "order, so inter-node estimates may be off", hosts,
        )
    return per_node


# [Note: overlap on the CPU]
# A step hides a collective under computation when the collective's work runs somewhere the
# computation does not. On a GPU it runs beside the kernels (NCCL's own kernels and copy
# engines): ``detect`` keeps the default share. On the CPU gloo's threads copy, reduce and call
# the sockets on the host's cores, which the ranks' computation keeps busy, so what hiding saves
# depends on the machine, and ``detect`` measures it: an all-gather of
# ``_OVERLAP_BYTES`` alone (C), a matmul loop of about ``_OVERLAP_COMPUTE_RATIO`` times its
# length alone (T), and the all-gather started, the loop run, and the all-gather waited for
# (B), interleaved, the slowest rank's times. The step model credits a hidden collective's
# time beyond its latency (α, the fitted time of an empty all-gather) at the share e, so
# T + C - B = e (C - α) / C min(T, C) gives e (:func:`overlap_efficiency_from`), clipped to
# [0, 1]. The latency is left out because it does not hide there: gloo's threads wake on
# cores the computation holds and make their round trips between the ranks when the
# scheduler next takes a core from it (at its tick), so a small all-gather started beside the
# computation completes milliseconds later than alone, often after the computation
# (``Devices.overlap_hides_latency`` False; timings in ``docs/cost-models.md`` and in
# ``docs/benchmarks.md``, "A blocking collective's wait after computation"). What the measured share
# predicts and picks against the steps measured: ``docs/benchmarks.md``, "Predicted against
# measured on this CPU" and the optimality runs.


def overlap_efficiency_from(alone_s: float, compute_s: float, together_s: float,
                            latency_s: float) -> float:
    """``Devices.overlap_efficiency`` from a collective of ``alone_s`` (``latency_s`` of it its
    latency), a computation of ``compute_s``, and the two run together in ``together_s`` (the
    collective started first, waited for after the computation): the saving over what the step
    model's ideal credits ([Note: overlap on the CPU]), within [0, 1]."""
    ideal = max(0.0, alone_s - latency_s) / alone_s * min(compute_s, alone_s) if alone_s else 0.0
    if ideal <= 0.0:
        return 0.0
    return min(1.0, max(0.0, (alone_s + compute_s - together_s) / ideal))


def _overlap_figures(group: Any, device: Any, links: Devices) -> dict[str, Any]:
    """``Devices.overlap_efficiency`` and ``overlap_hides_latency`` for the ranks of ``group``
    on ``device``: the defaults on a GPU; on the CPU measured ([Note: overlap on the CPU]), with
    the all-gather's latency as ``links`` (the link figures measured) has it."""
    import torch
    import torch.distributed as dist

    if device.type != "cpu":
        return {"overlap_efficiency": OVERLAP_EFFICIENCY, "overlap_hides_latency": True}
    size, name = dist.get_world_size(group), _group_name(group)
    numel = max(size, _OVERLAP_BYTES // 4 // size * size)
    start = collective_starts(numel, size, name, device)["all_gather"]
    a, b = filler_operands(device)
    gather_s = _median_time_s(lambda: start().wait(), device)
    matmul_s = _median_time_s(lambda: torch.mm(a, b), device)
    count, = _all_reduce_floats([_OVERLAP_COMPUTE_RATIO * gather_s / matmul_s], "max", group,
                                device, True)

    def compute() -> None:
        for _ in range(max(1, round(count))):
            torch.mm(a, b)

    def together() -> None:
        handle = start()
        compute()
        handle.wait()

    times = _interleaved_times_s([lambda: start().wait(), compute, together], device,
                                 barrier=lambda: dist.barrier(group=group),
                                 rounds=_OVERLAP_ROUNDS, calls=[1, 1, 1])
    alone, computed, both = _all_reduce_floats(times, "max", group, device, True)
    latency = collective_time_s("all_gather", 0, links)
    return {"overlap_efficiency": overlap_efficiency_from(alone, computed, both, latency),
            "overlap_hides_latency": False}


def _sync_wait_s(group: Any, device: Any, links: Devices) -> float:
    """``Devices.sync_wait_s`` for the ranks of ``group`` on ``device``: matmuls for about
    ``SYNC_STRETCH_S`` (the same count on every rank, from the slowest rank's matmul), then a
    ``_SYNC_BYTES`` all-gather waited for, against the matmuls alone, timed interleaved
    (``_interleaved_times_s``, each run a few of them back to back after a barrier); the
    slowest rank's time of each, the difference less the all-gather's price at ``links``
    (the link figures measured), at least 0 ([Note: the wait after a stretch of computation] in
    ``cost_models/overlap.py``)."""
    import torch
    import torch.distributed as dist

    size, name = dist.get_world_size(group), _group_name(group)
    start = collective_starts(_SYNC_BYTES // 4, size, name, device)["all_gather"]
    a, b = filler_operands(device)
    count, = _all_reduce_floats([SYNC_STRETCH_S / _median_time_s(lambda: torch.mm(a, b), device)],
                                "max", group, device, True)

    def compute() -> None:
        for _ in range(max(1, round(count))):
            torch.mm(a, b)

    def then_gather() -> None:
        compute()
        start().wait()

    computed, gathered = _all_reduce_floats(
        _interleaved_times_s([compute, then_gather], device,
                             barrier=lambda: dist.barrier(group=group), rounds=_PROBE_ROUNDS),
        "max", group, device, True)
    price = collective_time_s("all_gather", _SYNC_BYTES, links, group_size=size)
    return max(0.0, gathered - computed - price)


_SYNC_BYTES = 256
"""Bytes of the all-gather the sync-wait probe runs: a small one, whose time is its latency."""
_OVERLAP_BYTES = 2**22
"""Bytes of the all-gather the overlap probe runs: one of the larger ones sharded plans
gather, whose time is mostly its bytes'."""
_OVERLAP_COMPUTE_RATIO = 1.5
"""The overlap probe's computation, in lengths of its all-gather: longer, so that the ideal
hides the whole all-gather."""


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time_s(fn: Callable[[], object], device: Any,
                   barrier: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn`` over ``_REPEATS`` runs after one warmup; with ``barrier``,
    each run after one, so that every rank runs it at once ([Note: rates with every rank at
    once])."""
    times = []
    for i in range(1 + _REPEATS):
        if barrier is not None:
            barrier()
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _interleaved_times_s(runs: Sequence[Callable[[], object]], device: Any, *,
                         barrier: Callable[[], object], rounds: int,
                         between: Callable[[], object] | None = None,
                         clock: Callable[[], float] = time.perf_counter,
                         calls: Sequence[int] | None = None, warmup: int = 1) -> list[float]:
    """Each of ``runs``' time by ``clock`` as a step pays it, timed in ``rounds`` rounds that
    each time every run once (after ``warmup`` untimed rounds): a run is ``calls`` calls (per run;
    default ``_BACK_TO_BACK`` each) after one barrier, each call preceded by ``between`` when
    given, whose own time (timed alone in each round) is subtracted.

    Interleaved, a slow spell of the machine (the other ranks' processes, the system) falls on
    every run alike instead of on the sizes timed during it, which bent the fitted bandwidth
    when the sizes were timed one after the other. A collective's time is bimodal (whether
    the ranks arrive together or not), and a step pays the mean of both modes: each run's time
    is the mean of its rounds without the fastest and the slowest."""

    def timed(body: Callable[[], object], n: int = _BACK_TO_BACK) -> float:
        barrier()
        _synchronize(device)
        start = clock()
        for _ in range(n):
            body()
        _synchronize(device)
        return (clock() - start) / n

    def with_between(fn: Callable[[], object]) -> Callable[[], object]:
        def body() -> None:
            between()
            fn()
        return body

    bodies = list(runs) if between is None else [with_between(fn) for fn in runs]
    samples: list[list[float]] = [[] for _ in bodies]
    alone: list[float] = []
    per_run = list(calls) if calls is not None else [_BACK_TO_BACK] * len(bodies)
    for i in range(warmup + rounds):
        for j, body in enumerate(bodies):
            t = timed(body, per_run[j])
            if i >= warmup:
                samples[j].append(t)
        if between is not None:
            t = timed(between)
            if i >= warmup:
                alone.append(t)
    between_s = statistics.median(alone) if alone else 0.0
    return [max(statistics.mean(sorted(ts)[1:-1]) - between_s, 1e-7) for ts in samples]


_BACK_TO_BACK = 4
"""Collectives are timed in runs of this many calls after one barrier (those of at most
``_BACK_TO_BACK_BYTES``)."""
_BACK_TO_BACK_BYTES = 2**20
"""Larger collectives are timed in runs of ``_LARGE_BACK_TO_BACK`` calls."""
_LARGE_BACK_TO_BACK = 2
"""Calls per run of a collective of more than ``_BACK_TO_BACK_BYTES``: they take milliseconds,
far above the clock's and the barrier's noise, and four calls of the 16 MiB ones took half of
the measuring time. One call per run timed a reduce-scatter with the allocation of its fresh
buffer (which a step's repeated sizes find freed by the step before), slower than timed
directly (``docs/cost-models.md``)."""


def calls_per_run(nbytes: int) -> int:
    """Calls of a collective of ``nbytes`` timed back to back after one barrier:
    ``_BACK_TO_BACK`` up to ``_BACK_TO_BACK_BYTES``, ``_LARGE_BACK_TO_BACK`` above."""
    return _BACK_TO_BACK if nbytes <= _BACK_TO_BACK_BYTES else _LARGE_BACK_TO_BACK


def _matmul_flops_per_s(device: Any, barrier: Callable[[], object] | None = None) -> float:
    """Dense matmul throughput in the default dtype, every rank timing at once (after
    ``barrier``)."""
    import torch

    n = 4096 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    return 2 * n**3 / _median_time_s(lambda: torch.mm(a, b), device, barrier)


def _copy_bandwidth_bytes_per_s(device: Any, barrier: Callable[[], object] | None = None) -> float:
    """Bytes read plus written per second by a copy much larger than caches, every rank
    copying at once (after ``barrier``)."""
    import torch

    nbytes = (256 if device.type == "cuda" else 64) * 2**20
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time_s(lambda: dst.copy_(src), device, barrier)


# [Note: rates with every rank at once]
# Where the ranks share a machine's cores, a rate timed on one rank depends on what the others
# do meanwhile: four ranks on two cores, a copy timed while the other ranks happen to do
# something else runs about twice as fast as one timed while they copy too, and the ranks drift
# apart over the measurements before it, so the figure flipped between the two from call to
# call of ``detect_devices`` (``docs/benchmarks.md``, "How steady detection is"). A step's
# copies and optimizer updates run while every rank works, as the profile's computation is
# timed (a barrier, then every rank at once), so the matmul rate, the copy bandwidth and the
# optimizer's times are timed with every rank at once too: a barrier before each run.


def _optimizer(kind: str, params: list[Any]) -> Any:
    import torch

    if kind in ("sgd", "sgd_momentum"):
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9 if kind == "sgd_momentum" else 0)
    return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(params, lr=1e-3)


def _optimizer_times(device: Any, optimizers: Sequence[str],
                     barrier: Callable[[], object] | None = None,
                     ) -> tuple[list[float], list[float]]:
    """Per optimizer kind, the step time per element and per tensor (a step over 64 tensors of
    16 elements), with torch.optim's default implementation, every rank stepping at once
    (after ``barrier``); the per-element time over
    tensors beyond the caches ([Note: the optimizer beyond the caches]).

    On the CPU the per-element time is a step over 4 tensors of 2 Mi elements less 4 tensors'
    time, per element. On a GPU it is the slope between steps over 4 tensors of 2 Mi and of
    8 Mi elements, whose launches are the same: a step of 4 x 256 Ki elements is its launches,
    which counted per element overstated a whole model's optimizer step several times over
    (``docs/benchmarks.md``, "On a GPU"), and torch.optim's foreach step over 64 small tensors
    does not show what 4 launches of large ones cost. On the CPU one step's time is steadier
    than a difference of two."""
    import torch

    def step_s(kind: str, tensors: int, numel: int) -> float:
        params = [torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = _optimizer(kind, params)
        optimizer.step()  # creates the state
        return _median_time_s(optimizer.step, device, barrier)

    per_element, per_tensor = [], []
    for kind in optimizers:
        per_tensor.append(step_s(kind, 64, 16) / 64)
        if device.type == "cuda":
            small, large = _GPU_OPTIMIZER_NUMELS
            times = [step_s(kind, 4, n) for n in (small, large)]
            per_element.append(max(times[1] - times[0], 0.0) / (4 * (large - small)))
        else:
            numel = _CPU_OPTIMIZER_NUMEL
            per_element.append(max(step_s(kind, 4, numel) - 4 * per_tensor[-1], 0.0)
                               / (4 * numel))
    return per_element, per_tensor


# [Note: the optimizer beyond the caches]
# A training step reaches the optimizer after backward has streamed the activations, the
# weights and the gradients through the caches, and a model whose optimizer step matters
# holds more parameters than they do: its update reads and writes memory. Timed over tensors
# that fit a CPU's last-level cache, the per-element time was below the one a model's step
# pays (``docs/cost-models.md``, "The optimizer step"). The steps timed hold their
# parameters and gradients beyond a CPU's last-level cache; a model small enough to keep its
# own there is predicted its optimizer step too slow, by at most that step's own time.

_CPU_OPTIMIZER_NUMEL = 2**21
"""Elements per tensor of the 4 whose step gives the CPU's per-element optimizer time: 64 MiB
of SGD's parameters and gradients."""
_GPU_OPTIMIZER_NUMELS = (2**21, 2**23)
"""Elements per tensor of the two steps over 4 tensors whose slope is a GPU's per-element
optimizer time."""


def _recompute_op_times_s(device: Any) -> tuple[float, float]:
    """What activation checkpointing adds per operator beyond recomputing the operators it does
    not keep, under the runtime's selective policy and fully: a chain of transformer operators
    (linear, attention, layer norm, GELU on 4 x 32 tokens of width 256) run forward and
    backward under ``checkpoint`` with the selective policy, fully, and without checkpointing,
    less the forward time of the operators each recomputes (those the selective policy does not
    keep, each timed; the whole chain's forward), over the chain's operators (as the graph has
    them: one per torch function called)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils.checkpoint import checkpoint

    from ..core.regions import SELECTIVE_SAVED_OPS
    from ..runtime.recompute import selective_contexts

    w = torch.randn(256, 256, device=device, requires_grad=True)
    x = torch.randn(128, 256, device=device, requires_grad=True)  # 4 sequences of 32 tokens

    def body(h: Any) -> Any:
        for _ in range(4):
            a = torch.nn.functional.linear(h, w).view(4, 32, 4, 64).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(a, a, a, is_causal=True)
            a = torch.nn.functional.layer_norm(a.transpose(1, 2).reshape(128, 256), (256,))
            h = torch.nn.functional.gelu(a * 0.5 + h)
        return h

    class Timed(TorchFunctionMode):
        """Counts the torch functions called and times those the policy recomputes."""

        def __init__(self) -> None:
            super().__init__()
            self.ops, self.recomputed_s = 0, 0.0

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            _synchronize(device)
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            _synchronize(device)
            self.ops += 1
            if getattr(func, "__name__", "") not in SELECTIVE_SAVED_OPS:
                self.recomputed_s += time.perf_counter() - start
            return out

    def recomputed_s() -> tuple[float, int]:
        with torch.no_grad(), Timed() as timed:
            body(x)
        return timed.recomputed_s, timed.ops

    def forward_s() -> float:
        """The chain's forward as a full region's recomputation runs it: recording autograd's
        graph (as the profile times a node's forward)."""
        _synchronize(device)
        start = time.perf_counter()
        body(x)
        _synchronize(device)
        return time.perf_counter() - start

    def step(policy: str | None) -> float:
        _synchronize(device)
        start = time.perf_counter()
        if policy == "selective":
            out = checkpoint(body, x, use_reentrant=False, context_fn=selective_contexts)
        elif policy == "full":
            out = checkpoint(body, x, use_reentrant=False, preserve_rng_state=True)
        else:
            out = body(x)
        out.sum().backward()
        _synchronize(device)
        return time.perf_counter() - start

    recomputed_s(), forward_s(), step("selective"), step("full"), step(None)  # warmup
    # paired: each round times the recomputed operators and the steps one after the other, so
    # that a load on the machine that changes between rounds cancels (as medians taken apart
    # did not)
    selective, full = [], []
    for _ in range(2 * _REPEATS + 1):
        recomputed, ops = recomputed_s()
        selective.append(step("selective") - step(None) - recomputed)
        forward = forward_s()
        full.append(step("full") - step(None) - forward)
    return (max(statistics.median(selective), 0.0) / ops,
            max(statistics.median(full), 0.0) / ops)


def _all_reduce_floats(
    values: list[float], op: str, group: Any, device: Any, distributed: bool
) -> list[float]:
    import torch
    import torch.distributed as dist

    if not distributed or dist.get_world_size(group) == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def _measure_links(group: Any, device: Any, world_size: int, ranks_per_node: int) -> dict[str, Any]:
    """Fit link figures to the collectives timed over each kind of group a plan's collectives
    run over, all in the same rounds ([Note: timing the groups together]): this node's ranks
    (intra-node figures); on several nodes of several ranks, the whole group's ring (kept as
    the ``world`` figures) and the ranks with this rank's local index, one per node
    (inter-node figures), every node's cross-node group at once, as ``hybrid_shard`` and
    ``hierarchical`` run them; on nodes of one rank, the whole group is that cross-node
    group."""
    import torch.distributed as dist

    scopes: list[tuple[str, int, Any]] = []  # (scope, ranks, group)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    local = dist.get_rank(group) % ranks_per_node
    if ranks_per_node > 1:
        node_group = group
        if ranks_per_node < world_size:
            first = dist.get_rank(group) - local
            node_group = dist.new_group(
                ranks[first:first + ranks_per_node], use_local_synchronization=True
            )
        # (not destroyed: a group made with use_local_synchronization is named by its ranks,
        # and one made again under a destroyed one's name finds the old addresses in the store
        # and fails to connect; while this one lives, the next is named apart)
        scopes.append(("intra_node", ranks_per_node, node_group))
    if 1 < ranks_per_node < world_size:
        scopes.append(("world", world_size, group))
    if ranks_per_node < world_size:
        cross_group = group
        if ranks_per_node > 1:
            cross_group = dist.new_group(ranks[local::ranks_per_node],
                                         use_local_synchronization=True)
        scopes.append(("inter_node", world_size // ranks_per_node, cross_group))
    keys, times = _time_collectives([g for _, _, g in scopes], device,
                                    barrier=lambda: dist.barrier(group=group))
    times = _all_reduce_floats(times, "max", group, device, True)

    figures: dict[str, Any] = {"collective_links": {}, "collective_times": {}}
    for index, (scope, size, _) in enumerate(scopes):
        samples = [
            CollectiveSample(collective, nbytes, size, t)  # type: ignore[arg-type]
            for (i, collective, nbytes), t in zip(keys, times) if i == index
        ]
        # Every collective is fitted to its own timings (gloo runs all-gather and reduce-scatter
        # more slowly than all-reduce, by a ratio that changes with the size); the scope's
        # figures are the all-reduce's.
        for collective in COLLECTIVES:
            link = fit_link([x for x in samples if x.collective == collective])
            figures["collective_links"][f"{scope}.{collective}"] = {
                "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s, "latency_s": link.latency_s}
            figures["collective_times"][f"{scope}.{collective}"] = _timed_sizes(
                [x for x in samples if x.collective == collective], size)
            if collective == "all_reduce" and scope != "world":
                figures[f"{scope}_bandwidth_bytes_per_s"] = link.bandwidth_bytes_per_s
                figures[f"{scope}_latency_s"] = link.latency_s
        log.debug("%s collectives measured: %s", scope, samples)
    return figures


def _timed_sizes(samples: Sequence[CollectiveSample], size: int) -> dict[str, Any]:
    """``Devices.collective_times``'s entry of one collective's samples over ``size`` ranks,
    made non-decreasing by pooling: a size timed below a smaller one (sizes timed alike, apart
    by the noise of the rounds) takes, with it, the mean of the two, so that a larger message
    is never priced below a smaller one and no time is raised to another's noise."""
    ordered = sorted(samples, key=lambda x: x.total_bytes)
    return {"group_size": size, "total_bytes": [int(x.total_bytes) for x in ordered],
            "seconds": non_decreasing([x.time_s for x in ordered])}


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence nearest ``values`` in least squares (pool adjacent
    violators: each run of values that falls is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


# [Note: timing the groups together]
# A step of a `hybrid_shard` or `hierarchical` plan moves from group to group: a gather's
# cross-node stage, then its node stage, then the next parameter's, with the world's flat
# collectives between them where the plan mixes strategies. The collectives of each kind of
# group (a node's ranks, the whole world, the ranks of one local index) are timed in the same
# rounds, so that each is timed as such a step runs it. Timed group by group instead (each
# group's sizes in rounds of their own, the cross-node figures derived from the world's ring
# by the rule of [Note: rings across nodes]), the 2-rank groups of a 2 x 2 world on this CPU
# measured about a third faster at small sizes than they ran alternating with the other
# groups, and the strategies' two-stage gathers and reduce-scatters took a quarter to a third
# more than their stages priced (`docs/benchmarks.md`, "Two-stage collectives").


def _time_collectives(groups: Sequence[Any], device: Any, *, barrier: Callable[[], object],
                      ) -> tuple[list[tuple[int, str, int]], list[float]]:
    """Median times of all-gather, reduce-scatter and all-reduce of each benchmark size over
    each of ``groups`` (keys ``(index of the group, collective, bytes)``, and the times in the
    same order), run as a training step runs them: through the runtime's own collectives (``runtime/
    collectives.py``: its output allocated per call, gloo's reduce-scatter run as an all-reduce
    of a buffer handed over, its wait for gloo to release the output), started asynchronously
    and waited for, each after some compute (a matmul, whose time is subtracted), every
    group's in the same rounds, as a step of two-stage collectives moves from one group to the
    other ([Note: timing the groups together]), the sizes above ``_APART_FROM_BYTES`` in rounds
    of their own before the others ([Note: the largest sizes in rounds of their own]). Timed
    back to back instead, with nothing in between, small collectives on CPU gloo cost about
    half as much as they do inside a step."""
    import torch
    import torch.distributed as dist

    a, b = filler_operands(device)
    warm = torch.zeros(max(_COLLECTIVE_SIZES_BYTES) // 4, device=device)
    for group in groups:  # [Note: a new group's first collectives]
        for _ in range(_WARM_COLLECTIVES):
            dist.all_reduce(warm, group=group)
    del warm
    keys: list[tuple[int, str, int]] = []
    times: list[float] = []
    # [Note: the largest sizes in rounds of their own]
    for sizes in ([n for n in _COLLECTIVE_SIZES_BYTES if n > _APART_FROM_BYTES],
                  [n for n in _COLLECTIVE_SIZES_BYTES if n <= _APART_FROM_BYTES]):
        runs: list[Callable[[], object]] = []
        calls: list[int] = []
        for index, group in enumerate(groups):
            size, name = dist.get_world_size(group), _group_name(group)
            for nbytes in sizes:
                numel = max(size, nbytes // 4 // size * size)
                for collective, run in collective_runs(numel, size, name, device).items():
                    keys.append((index, collective, numel * 4))
                    runs.append(run)
                    calls.append(calls_per_run(nbytes))
        if runs:
            times += _interleaved_times_s(runs, device, barrier=barrier,
                                          between=lambda: torch.mm(a, b),
                                          rounds=_COLLECTIVE_REPEATS, calls=calls,
                                          warmup=_COLLECTIVE_WARMUP_ROUNDS)
    return keys, times


_APART_FROM_BYTES = 2**22
"""Collectives of more bytes than this are timed in rounds of their own, before the others
([Note: the largest sizes in rounds of their own])."""
_COLLECTIVE_WARMUP_ROUNDS = 5
"""Untimed rounds before each set of sizes' timed rounds ([Note: the largest sizes in rounds of
their own])."""

# [Note: the largest sizes in rounds of their own]
# On the CPU each collective's output (and a reduce-scatter's input) is a fresh allocation, as
# in a step. Timed in the same rounds as the 8 and 16 MiB ones, whose buffers the C allocator
# hands back to the system and takes again, the smaller sizes met an allocator that had just
# given their memory back too: the ranks took hundreds of times as many page faults over the
# rounds as without the two largest sizes, and the 1 and 4 MiB collectives timed slower than
# alone among the smaller sizes, and slower than in a loop of computation and one collective
# of that size, as a step that moves those sizes runs them (``docs/benchmarks.md``, "How
# steady detection is"). A step repeats its own sizes, so the sizes above
# ``_APART_FROM_BYTES`` are timed among themselves, and the others after them, among
# themselves. Each set of sizes runs ``_COLLECTIVE_WARMUP_ROUNDS`` untimed rounds first: with
# one, the first call of a process in a gloo world of 2 x 2 priced the 1-4 MiB collectives
# above the second call, as the calls did not when the smaller sizes shared the largest
# ones' rounds (which made every call's allocations fault alike).


_WARM_COLLECTIVES = 24
"""All-reduces of the largest timed size run over each group before its collectives are timed
([Note: a new group's first collectives])."""

# [Note: a new group's first collectives]
# A process group made for the measurement (a node's ranks, the ranks of one local index) starts
# slow: in the first ``detect_devices`` call of a gloo world of 2 x 2 ranks on this CPU its
# largest collectives took about twice as long as a second call's, over groups made afresh the
# same way, while the world's group, used since the process group started, took the same in
# both; the first call then priced the two-stage strategies' collectives above the second.
# All-reduces of the largest timed size run over each group first bring the first call's
# figures down to the second's or near them; a few were not enough (``docs/benchmarks.md``,
# "How steady detection is", gives the figures).


def _group_name(group: Any) -> str:
    """The name the runtime's collective functions know ``group`` by (registered here)."""
    import torch.distributed as dist

    from ..runtime.collectives import register_group

    if group is None:
        return WORLD
    name = f"detect.ranks{'-'.join(map(str, dist.get_process_group_ranks(group)))}"
    register_group(name, group)
    return name


def filler_operands(device: Any) -> tuple[Any, Any]:
    """The two square matrices of the short matmul run before each timed collective."""
    import torch

    n = 1024 if device.type == "cuda" else _FILLER_MATMUL_SIZE
    return torch.randn(n, n, device=device), torch.randn(n, n, device=device)


def collective_starts(numel: int, size: int, name: str,
                      device: Any) -> dict[str, Callable[[], Any]]:
    """Starting one call of each collective over ``numel`` float32 elements in the group
    registered as ``name`` (of ``size`` ranks), through the runtime's collective functions as
    a step runs them; each returns what to ``wait()`` for. Each starter has buffers of its
    own, so two calls of different starters may be in flight together."""
    import torch

    from ..runtime.collectives import (
        all_gather_flat_start,
        all_reduce_sum_start,
        reduce_scatter_flat_start,
    )

    full = torch.zeros(numel, device=device)
    shard = torch.zeros(numel // size, device=device)
    return {
        "all_gather": lambda: all_gather_flat_start(shard, name),
        # the runtime hands over the flat gradient it packed (here: a fresh buffer)
        "reduce_scatter": lambda: reduce_scatter_flat_start(
            torch.empty_like(full), name, consume=True),
        "all_reduce": lambda: all_reduce_sum_start(full, name),
    }


def collective_runs(numel: int, size: int, name: str,
                    device: Any) -> dict[str, Callable[[], object]]:
    """One call of each collective over ``numel`` float32 elements in the group registered as
    ``name`` (of ``size`` ranks), through the runtime's collective functions as a step runs
    them: started, then waited for."""
    return {collective: (lambda start=start: start().wait())
            for collective, start in collective_starts(numel, size, name, device).items()}


_CONCURRENT_SIZES_BYTES = (2**16, 2**18, 2**20, 2**22)
"""Message sizes of the pairs of collectives timed together and one after the other
(:func:`_concurrent_collective_ratios`): those of the gather buckets and parameters sharded
plans gather."""


def _concurrent_collective_ratios(group: Any, device: Any) -> dict[str, Any]:
    """``Devices.concurrent_collective_ratios`` and ``concurrent_collective_ratio``: at each
    size of :data:`_CONCURRENT_SIZES_BYTES`, an all-gather and a reduce-scatter (a re-gather
    beside a gradient's reduce-scatter: the pair a sharded step has in flight together)
    started together over the two one after the other, within [1/2, 1]; the single ratio
    pooled over the sizes (the sum of the one over the sum of the other). Timed interleaved as
    the collectives are (``_interleaved_times_s``, two calls per run, each after the short
    matmul, ``_COLLECTIVE_REPEATS`` rounds), the slowest rank's times. (A step's replay runs
    the replicated gradients' all-reduce alone, [Note: the all-reduce runs alone] in
    ``cost_models/overlap.py``: no all-reduce pair is timed.)"""
    import torch
    import torch.distributed as dist

    size, name = dist.get_world_size(group), _group_name(group)
    a, b = filler_operands(device)
    runs: list[Callable[[], object]] = []
    sizes = []
    for nbytes in _CONCURRENT_SIZES_BYTES:
        numel = max(size, nbytes // 4 // size * size)
        sizes.append(numel * 4)
        x = collective_starts(numel, size, name, device)["all_gather"]
        y = collective_starts(numel, size, name, device)["reduce_scatter"]
        runs.append(lambda x=x, y=y: (x().wait(), y().wait()))  # one after the other
        runs.append(lambda x=x, y=y: [w.wait() for w in (x(), y())])  # together
    times = _interleaved_times_s(runs, device, barrier=lambda: dist.barrier(group=group),
                                 between=lambda: torch.mm(a, b), rounds=_COLLECTIVE_REPEATS,
                                 calls=[_LARGE_BACK_TO_BACK] * len(runs))
    times = _all_reduce_floats(times, "max", group, device, True)

    def ratio(together: float, apart: float) -> float:
        return min(1.0, max(0.5, together / apart))

    return {"concurrent_collective_ratios": {
                "total_bytes": sizes,
                "ratios": [ratio(t, s) for s, t in zip(times[0::2], times[1::2])]},
            "concurrent_collective_ratio": ratio(sum(times[1::2]), sum(times[0::2]))}


_FILLER_MATMUL_SIZE = 256
"""Side of the square matmul run before each timed collective on CPU (a short computation)."""


def devices_for(devices: Devices | None, *, world_size: int, memory_limit_bytes: int | None,
                ranks_per_node: int | None = None, device: Any = None) -> Devices:
    """The one record of the hardware a plan is made for: ``devices`` (None: the defaults)
    with its world size set to ``world_size``, its ranks per node to ``ranks_per_node`` when
    given, and its memory limit filled in (the limit given, else the devices', else the memory
    of ``device``, where the model runs: the same at every world size and under every plan).
    In a process group, whether a reduce-scatter copies its input is the group's own (the
    runtime's collectives do as its backend does, whatever the devices say). A search without
    given devices then plans with :func:`measured` figures."""
    from ..runtime.collectives import WORLD, group_size, scatter_copies_input

    devices = devices if devices is not None else Devices()
    memory = memory_limit_bytes or devices.memory_bytes or device_memory_bytes(device)
    copies = (scatter_copies_input() if group_size(WORLD) > 1
              else devices.reduce_scatter_copies_input)
    return dataclasses.replace(devices, world_size=world_size, memory_bytes=memory,
                               ranks_per_node=ranks_per_node or devices.ranks_per_node,
                               reduce_scatter_copies_input=copies)


def measured(devices: Devices) -> Devices:
    """``devices`` (of :func:`devices_for`) with the figures ``detect_devices`` measures on the
    current default process group instead of its own, its world, memory limit and copies kept,
    and its ranks per node when it names them (else the nodes detection finds from host names).
    Collective; measured once per process group (in a world of one process without one, once
    per process)."""
    return with_figures(devices, _detected(devices.world_size, devices.ranks_per_node))


def with_figures(devices: Devices, figures: Devices) -> Devices:
    """The rates and times of ``figures`` (``detect_devices``'s, or a cached measurement) for
    the world of ``devices``: its world size, memory limit and copies kept, its ranks per node
    when it names them (else the measurement's)."""
    return dataclasses.replace(figures, world_size=devices.world_size,
                               memory_bytes=devices.memory_bytes,
                               ranks_per_node=devices.ranks_per_node or figures.ranks_per_node,
                               reduce_scatter_copies_input=devices.reduce_scatter_copies_input)


_detected_devices: dict[tuple[int, int, int | None], Devices] = {}
"""Process-wide: the Devices measured per process group, so that compiling the same model twice
in one process plans with the same figures (keyed by the group's identity; a group lives as long
as the process or until destroyed)."""


def _detected(world_size: int, ranks_per_node: int | None = None) -> Devices:
    """``detect_devices()`` of the current default process group, measured once per group
    (collective on first use); ``ranks_per_node`` None finds the nodes from host names."""
    import torch.distributed as dist

    key = (id(dist.group.WORLD), world_size, ranks_per_node)
    if key not in _detected_devices:
        _detected_devices[key] = detect_devices(ranks_per_node=ranks_per_node)
    return _detected_devices[key]

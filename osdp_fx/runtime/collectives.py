"""Collectives on flat 1-D buffers, with the process group named by a string.

Graph nodes cannot carry a ProcessGroup object (the generated code prints its arguments), so
groups are named: ``"world"`` is the default group. gloo rejects stacked all-gather outputs, so
every collective here works on flat contiguous buffers. torch renamed the tensor collectives
(``all_gather_single``/``reduce_scatter_single`` in 2.13, the old names warn); both are detected.

[Note: gloo's last reference]
gloo runs a collective on a worker thread that holds the work, and with it the work's tensors,
until it loops round, after the work has completed: ``wait()`` can return while the worker
still holds the output. A gathered weight whose last user drops it is then freed when the
worker lets go, not where the plan frees it: under CPU contention, tens of operators later (a
frozen weight that backward does not read, alive into backward, above the predicted peak).
So :meth:`Pending.wait` returns a CPU all-gather's output only once it holds no more
references than before the launch (it yields to the worker meanwhile, at most
``RELEASE_WAIT_S``): its lifetime is the program's. Buffers handed over to a collective are
released with ``resize_(0)`` instead (``consume``, the reduce-scatter and all-reduce buffers),
which frees them whoever still refers to them. On a GPU the caching allocator and the streams
order reuse, and nothing waits.

[Note: the collective clock]
:func:`collective_clock` counts, while it is open, the wall seconds this process's threads spend
in the runtime's collectives: starting one (``CollectiveClock.launch_s``: the output's
allocation, the call into the process group, which on gloo queues the work for its thread; at
one rank, the copy that stands for a gather or a reduce-scatter) and
waiting for one (``wait_s``: the completion, and on the CPU gloo's last reference; a collective
run to completion in one call, such as ``all_reduce_sum_``, counts as a wait). A step's wall
less both is its computation, the runtime's host work, and the time its thread lost its core
to other threads (``benchmarks/step_wall.py`` prints the three beside the step model's
prediction). With no clock open each counted function costs one test of a module global.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..core.layout import WORLD, shard_numel  # noqa: F401  (re-exported)
from ..errors import CollectiveError
from .memory import note_resized

_named_groups: dict[str, Any] = {}

_all_gather_flat_impl = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat_impl = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


@dataclasses.dataclass
class CollectiveClock:
    """Wall seconds spent in the runtime's collectives while :func:`collective_clock` is open
    ([Note: the collective clock])."""

    launches: int = 0
    """Collectives started."""
    launch_s: float = 0.0
    """Seconds spent starting them."""
    waits: int = 0
    """Waits for a collective that had not been waited for (and blocking collectives)."""
    wait_s: float = 0.0
    """Seconds spent in those waits."""


_clock: CollectiveClock | None = None


@contextlib.contextmanager
def collective_clock() -> Iterator[CollectiveClock]:
    """Count the seconds the runtime's collectives take to start and to wait for, until the
    block exits ([Note: the collective clock]); yields the counts, updated as they run."""
    global _clock
    outer, _clock = _clock, CollectiveClock()
    try:
        yield _clock
    finally:
        _clock = outer


def _counted(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a function whose time counts on the open clock as ``kind`` (``"launch"`` or
    ``"wait"``)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            clock = _clock
            if clock is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                if kind == "launch":
                    clock.launches += 1
                    clock.launch_s += seconds
                else:
                    clock.waits += 1
                    clock.wait_s += seconds
        return counted
    return wrap


@_counted("wait")
def wait_work(work: Any) -> None:
    """Wait for a process group's ``work`` (counted on the open clock)."""
    work.wait()


def register_group(name: str, group: Any) -> None:
    """Make ``group`` reachable from graph nodes under ``name``."""
    _named_groups[name] = group


def forget_named_groups() -> None:
    """Drop every registered group (see ``hierarchy._forget_groups``)."""
    _named_groups.clear()


def resolve_group(name: str) -> Any:
    """The ProcessGroup named ``name`` (None, meaning the default group, for ``"world"``)."""
    if name == WORLD:
        return None
    return _named_groups[name]


def collective_device(group: Any = None) -> torch.device:
    """The device ``group``'s collectives take tensors on (NCCL: this rank's GPU; the default
    group where None)."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_size(name: str) -> int:
    """Ranks in the named group; 1 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(resolve_group(name))


def group_rank(name: str) -> int:
    """This process's rank in the named group; 0 when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(resolve_group(name))


RELEASE_WAIT_S = 1.0
"""The longest :meth:`Pending.wait` yields for gloo's worker to let go of an output ([Note:
gloo's last reference]); past it the output is returned, and freed when the worker lets go."""

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def references(t: torch.Tensor) -> int | None:
    """How many references ``t``'s storage has (tensors, views and the storage object), or None
    where this torch does not say."""
    return None if _use_count is None else _use_count(t.untyped_storage()._cdata)


class Pending:
    """A collective in flight: ``wait()`` returns its output once it has completed. ``held``:
    the output's :func:`references` before the launch, awaited after completion ([Note:
    gloo's last reference])."""

    def __init__(self, out: torch.Tensor, work: Any = None, keep: Any = None, *,
                 release: bool = False, held: int | None = None) -> None:
        self._out, self._work, self._keep, self._release = out, work, keep, release
        self._held = held

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._complete()
        return self._out

    @_counted("wait")
    def _complete(self) -> None:
        self._work.wait()
        if self._release:  # an input handed over: gloo's worker may hold it a while yet
            _free(self._keep)
        self._work = self._keep = None  # the input may be freed now
        if self._held is not None:
            _await_release(self._out, self._held)


def _await_release(t: torch.Tensor, held: int) -> None:
    """Yield to other threads until ``t``'s storage has no more than ``held`` references, for at
    most ``RELEASE_WAIT_S``."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while references(t) > held and time.monotonic() < deadline:
        time.sleep(0)


def _free(t: torch.Tensor) -> None:
    """Release the memory of ``t``'s storage now, unless ``t`` views only part of it."""
    storage = t.untyped_storage()
    if storage.nbytes() == t.numel() * t.element_size():
        storage.resize_(0)
        note_resized(storage)


@_counted("launch")
def all_gather_flat_start(shard: torch.Tensor, group: str, *, consume: bool = False) -> Pending:
    """Start concatenating every rank's flat ``shard`` (rank order) into a new flat tensor.
    ``consume``: the caller hands ``shard`` over (a buffer of its own); on the CPU its memory
    is released when the gather completes, not when gloo's worker thread lets go of it (on a
    GPU the caching allocator and the process group order its reuse after the collective)."""
    world = group_size(group)
    out = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    if world == 1:
        return Pending(out.copy_(shard.reshape(-1)))
    src = shard.reshape(-1).contiguous()
    cpu = src.device.type == "cpu"
    held = references(out) if cpu else None
    work = _all_gather_flat_impl(out, src, group=resolve_group(group), async_op=True)
    return Pending(out, work, src, release=consume and cpu, held=held)


def all_gather_flat(shard: torch.Tensor, group: str) -> torch.Tensor:
    """Concatenate every rank's flat ``shard`` (rank order) into a new flat tensor."""
    return all_gather_flat_start(shard, group).wait()


def scatter_copies_input(group: str = WORLD) -> bool:
    """Whether a reduce-scatter over ``group`` copies a gradient it is handed at its launch:
    on gloo ([Note: gloo reduce-scatter]); not on NCCL, nor without a process group. Planning
    reads it as ``Devices.reduce_scatter_copies_input`` (set by ``planner/detect.py``)."""
    if group_size(group) == 1:
        return False
    return process_group_copies_input(resolve_group(group))


def process_group_copies_input(pg: Any = None) -> bool:
    """:func:`scatter_copies_input` of a ProcessGroup object (None: the default group), which
    must be initialised."""
    return dist.get_world_size(pg) > 1 and str(dist.get_backend(pg)) == "gloo"


@_counted("launch")
def reduce_scatter_flat_start(full: torch.Tensor, group: str, *,
                              consume: bool = False) -> Pending:
    """Start summing ``full`` (flat, divisible by the group size) over ranks into this rank's
    chunk. ``full`` (on gloo: a copy of it, made here) is kept alive until the collective
    completes; ``consume``: the caller hands ``full`` over, and it may be overwritten and freed
    (on gloo it is then reduced in place, without a copy)."""
    world = group_size(group)
    if world == 1:
        return Pending(full.clone())
    pg = resolve_group(group)
    out = torch.empty(full.numel() // world, dtype=full.dtype, device=full.device)
    if full.device.type == "cpu" and scatter_copies_input(group):
        # [Note: gloo reduce-scatter] gloo's reduce_scatter_tensor clones its input and
        # all-reduces the clone, which its work object holds until it is freed: 2x the input
        # in flight. Doing that here, on the caller's buffer when it is handed over, holds 1x.
        buf = (full if consume and full.is_contiguous()
               else full.clone(memory_format=torch.contiguous_format))
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=pg, async_op=True)
        return _ChunkPending(out, buf, work, dist.get_rank(pg))
    src = full.contiguous()
    work = _reduce_scatter_flat_impl(out, src, op=dist.ReduceOp.SUM, group=pg, async_op=True)
    return Pending(out, work, src)


class _ChunkPending(Pending):
    """An all-reduce of ``buf`` in flight whose ``wait()`` copies this rank's chunk of the sum
    into ``out`` (allocated at the start, as the output of a reduce-scatter is) and frees
    ``buf``."""

    def __init__(self, out: torch.Tensor, buf: torch.Tensor, work: Any, rank: int) -> None:
        super().__init__(out, work)
        self._buf, self._rank = buf, rank

    @_counted("wait")
    def _complete(self) -> None:
        self._work.wait()
        self._work = None
        buf, self._buf = self._buf, None
        self._out.copy_(buf.view(-1, self._out.numel())[self._rank])
        _free(buf)


def reduce_scatter_flat(full: torch.Tensor, group: str) -> torch.Tensor:
    """Sum ``full`` (flat, divisible by the group size) over ranks; return this rank's chunk."""
    return reduce_scatter_flat_start(full, group).wait()


@_counted("launch")
def all_reduce_sum_start(tensor: torch.Tensor, group: str) -> Any:
    """Start summing ``tensor`` over ranks in place; returns the work to ``wait()`` on (None
    when there is nothing to do)."""
    if group_size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=resolve_group(group),
                           async_op=True)


@_counted("wait")
def all_reduce_sum_(tensor: torch.Tensor, group: str) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place."""
    if group_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=resolve_group(group))
    return tensor


@_counted("wait")
def broadcast_(tensor: torch.Tensor, group: str, *, src_rank: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` with the group's rank ``src_rank``'s copy, in place."""
    if group_size(group) > 1:
        pg = resolve_group(group)
        src = src_rank if pg is None else dist.get_global_rank(pg, src_rank)
        dist.broadcast(tensor, src=src, group=pg)
    return tensor


def pad_flat(tensor: torch.Tensor, padded_numel: int) -> torch.Tensor:
    """``tensor`` flattened and zero-padded to ``padded_numel`` elements."""
    flat = tensor.reshape(-1)
    if flat.numel() == padded_numel:
        return flat
    out = flat.new_zeros(padded_numel)
    out[: flat.numel()] = flat
    return out


_LOST_PEER = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe")
"""What gloo (and the TCP store) say when a collective's other ranks never join it."""


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that timed out or lost a peer (torch raises
    ``RuntimeError`` or its ``DistBackendError`` for both)."""
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _LOST_PEER)


def collective_error(what: str, fix: str, exc: BaseException) -> CollectiveError:
    """The error of a collective that ``what`` runs and that every rank must call, which timed
    out on this rank (``exc``, torch's), naming ``fix``."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return CollectiveError(
        f"{what} is collective: every rank must call it, and rank {group_rank(WORLD)} called "
        f"it alone, or another rank failed or is far behind (the others did not join its "
        f"collective within the process group's timeout: {type(exc).__name__}: {first}). "
        f"{fix}")


@contextlib.contextmanager
def every_rank(what: str, fix: str) -> Iterator[None]:
    """Around collectives every rank must call (``what``: the call, e.g.
    ``"full_state_dict()"``): one that times out, or loses a peer, raises
    :class:`~osdp_fx.errors.CollectiveError` naming the problem and ``fix`` instead of torch's
    error. A rank that calls alone then fails within the process group's timeout (on gloo;
    NCCL's watchdog may abort the process at the timeout instead)."""
    try:
        yield
    except RuntimeError as exc:
        if not lost_peer(exc):
            raise
        raise collective_error(what, fix, exc) from exc

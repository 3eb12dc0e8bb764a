"""Runtime of sharded parameters: the functions the sharding pass inserts as graph nodes.

* :func:`all_gather_param` gathers a parameter's flat shards into the full tensor, or waits for
  the gather a :func:`prefetch_param` node started earlier. Its backward starts an asynchronous
  reduce-scatter of the full gradient (:class:`GradReduceScatters`); averaged over ranks, it is
  accumulated into the shard's ``.grad`` by the end of backward.
* :func:`free_param` releases a full_shard parameter's gathered storage after its last forward
  use.
* :func:`module_scope` (entered by ``OSDPModule.forward``) enters a
  :class:`~.regather.StepContext`, whose saved-tensor hooks keep a handle instead of a gathered
  full_shard parameter and re-gather it in backward (:mod:`.regather`).

hybrid_shard and hierarchical parameters are freed and re-gathered like full_shard ones; their
collectives run in two levels (:mod:`.hierarchy`).

Outside a StepContext (a bare call of the graph module) the functions still compute the right
values; gathered tensors are then simply kept by autograd like any other tensor.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..core.buckets import MAX_IN_FLIGHT
from ..core.layout import row_numel, shard_layout, shard_numel
from ..core.strategies import traits
from .accumulation import HeldGrads, LocalScatters
from .collectives import Pending, pad_flat
from .compile_support import defer_free, eager, take_deferred
from .hierarchy import (
    averaging_ranks,
    gather_shards_start,
    reduce_scatter_shards_start,
    shard_chunks,
)
from .memory import note_resized
from .regather import (
    Gathered,
    StepContext,
    cast,
    gather_full,
    split_gathered,
    start_params,
)
from .sharded import (
    SplitGrads,
    accumulate_grad,
    flat_shard,
    local_of,
    padded_numel,
    split_of,
)

_local = threading.local()


@dataclasses.dataclass
class _Scope:
    """The runtime state of one compiled module's forward: its reduce-scatter queue and, for
    plans that free parameters after forward, the step context that re-gathers them."""

    scatters: GradReduceScatters | LocalScatters
    step: StepContext | None


def _scope() -> _Scope | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def _active() -> StepContext | None:
    scope = _scope()
    return scope.step if scope is not None else None


def region_saves() -> contextlib.AbstractContextManager[None]:
    """Around a recomputed region's forward: the sharded parameters it saves are re-gathered
    together when backward recomputes it (:meth:`StepContext.region`)."""
    step = _active()
    return step.region() if step is not None else contextlib.nullcontext()


def _scatters() -> GradReduceScatters | LocalScatters:
    """The reduce-scatter queue of the compiled module running this forward (a bare call of a
    graph module gets a queue of its own)."""
    scope = _scope()
    return scope.scatters if scope is not None else GradReduceScatters()


@contextlib.contextmanager
def module_scope(scatters: GradReduceScatters | LocalScatters, *, regather: bool,
                 prefetch: int = 1) -> Iterator[StepContext | None]:
    """Run one compiled module's forward: its gathers' gradients go to ``scatters`` (the
    module's own queue, so two compiled models whose forwards and backwards interleave keep
    their collectives apart); with ``regather``, freed parameters are re-gathered in backward,
    ``prefetch`` parameters ahead. A no_sync forward passes :class:`LocalScatters` instead of
    the queue ([Note: no_sync])."""
    take_deferred()  # what a failed compiled forward left
    step = StepContext(prefetch) if regather else None
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(_Scope(scatters, step))
    try:
        if step is None:
            yield None
        else:
            with torch.autograd.graph.saved_tensors_hooks(step.pack, step.unpack):
                yield step
    finally:
        _free_deferred()
        stack.pop()


def _free_deferred() -> None:
    for full in take_deferred():
        _free(full)


class GradReduceScatters:
    """Reduce-scatters of sharded gradients, run asynchronously during backward.

    Each is started as soon as backward has produced a full gradient; at most ``max_in_flight``
    run at once (each holds its full gradient until done): starting one more first completes
    the oldest. The rest complete in a callback at the end of backward. Completing one averages
    it over the ranks and accumulates it into the shard's ``.grad``.
    """

    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT, held: HeldGrads | None = None) -> None:
        self.max_in_flight = max_in_flight
        self.held = held if held is not None else HeldGrads()  # [Note: no_sync]
        self._in_flight: collections.deque[
            tuple[list[torch.Tensor], Pending, int, torch.Tensor | None]] = (
            collections.deque())
        self._queued = False
        self._holding: dict[int, SplitGrads] = {}
        """Split weights holding reduced chunks of their parts (``SplitGrads.add``)."""

    def start(self, shard: torch.Tensor, grad_full: torch.Tensor, group: str,
              padded_numel: int, reduce_dtype: torch.dtype | None = None) -> None:
        """Reduce-scatter one parameter's full gradient into ``shard.grad`` (added to the
        gradient earlier no_sync backwards held, if any)."""
        held = self.held.take([shard]) if self.held else None
        if held is not None:
            held[:grad_full.numel()].add_(grad_full.reshape(-1))
            self.start_flat([shard], held, group)
            return
        dtype = reduce_dtype or grad_full.dtype
        if grad_full.dim() > 0 and (dtype != grad_full.dtype or grad_full.numel() != padded_numel
                                    or not grad_full.is_contiguous()):
            # cast and padded to whole rows per chunk in one op
            chunks = shard_chunks(group)
            grad = torch.empty((chunks, padded_numel // chunks), dtype=dtype,
                               device=grad_full.device)
            torch._chunk_cat([grad_full], dim=0, num_chunks=chunks, out=grad)
            self.start_flat([shard], grad.view(-1), group)
            return
        grad = pad_flat(cast(grad_full, reduce_dtype), padded_numel)
        owned = grad.untyped_storage().data_ptr() != grad_full.untyped_storage().data_ptr()
        self.start_flat([shard], grad, group, owned=owned)


    def buffer(self, shards: list[torch.Tensor], numel: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """A flat buffer for the gradients of ``shards``, zero or holding what earlier no_sync
        backwards accumulated: the caller adds its gradients, then :meth:`start_flat`."""
        return self.held.buffer(shards, numel, dtype, device)

    def holds(self, shards: list[torch.Tensor]) -> bool:
        """Whether earlier no_sync backwards hold a gradient buffer for ``shards``."""
        return self.held.holds(shards)

    def start_flat(self, shards: list[torch.Tensor], flat: torch.Tensor, group: str, *,
                   owned: bool = True) -> None:
        """Reduce-scatter ``flat``, laid out so that this rank's chunk is its ``shards``
        concatenated, into their ``.grad``. ``owned``: ``flat`` is a buffer of this queue's
        own, released as soon as the collective completes."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        while len(self._in_flight) >= self.max_in_flight:
            self._complete(*self._in_flight.popleft())
        pending = reduce_scatter_shards_start(flat, group, consume=owned)
        self._in_flight.append((shards, pending, averaging_ranks(group), flat if owned else None))

    def _complete(self, shards: list[torch.Tensor], pending: Pending, world: int,
                  owned: torch.Tensor | None) -> None:
        chunk = pending.wait().div_(world)
        if owned is not None:
            # gloo's worker may hold the input a few milliseconds after the collective
            # completes: release its memory now rather than when the last reference goes
            storage = owned.untyped_storage()
            storage.resize_(0)
            note_resized(storage)
        kept = False
        dtypes = {s.dtype for s in shards}
        if len(dtypes) == 1:  # one cast for the bucket; its members' gradients are views of it
            chunk = chunk.to(dtypes.pop())
            grads = chunk.split([padded_numel(s) for s in shards])
        else:
            grads = [g.to(s.dtype, copy=True)
                     for s, g in zip(shards, chunk.split([padded_numel(s) for s in shards]))]
        for shard, grad in zip(shards, grads):
            split = split_of(shard)
            if split is not None:  # a split weight's part: into the weight's gradient
                if len(grads) > 1:  # a held chunk is released alone: a tensor of its own
                    grad = grad.clone()
                held = split[0].add(split[1], grad)
                if held:  # until the weight's gradient exists (at the latest: finish)
                    self._holding[id(split[0])] = split[0]
                kept = kept or (held and grad.untyped_storage().data_ptr()
                                == chunk.untyped_storage().data_ptr())
                continue
            accumulate_grad(shard, grad)
            kept = kept or (local_of(shard.grad).untyped_storage().data_ptr()
                            == chunk.untyped_storage().data_ptr())
        if not kept:
            # copied out; gloo's worker may still hold the output for a few milliseconds
            storage = chunk.untyped_storage()
            storage.resize_(0)
            note_resized(storage)

    def finish(self) -> None:
        """Complete every reduce-scatter in flight (end of backward); then each split weight
        whose parts' chunks wait for its gradient gets it, one after another."""
        self._queued = False
        while self._in_flight:
            self._complete(*self._in_flight.popleft())
        holding, self._holding = self._holding, {}
        for split in holding.values():
            split.join()

    def reset(self) -> None:
        """Forget what a failed backward left (autograd drops its end-of-backward callback)."""
        self._queued = False
        self._in_flight.clear()
        for split in self._holding.values():
            split.drop()
        self._holding.clear()


class _AllGatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, shape: tuple[int, ...], group: str,
                pending: Pending | None, dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.group, ctx.reduce_dtype = group, reduce_dtype
        ctx.padded_numel = padded_numel(shard) * shard_chunks(group)
        ctx.shard = shard  # the leaf itself: saved_tensors would give a new tensor object
        ctx.scatters = _scatters()
        ctx.set_materialize_grads(False)  # None: grad_ready started the reduce-scatter
        return gather_full(shard, shape, group, pending, dtype)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor | None) -> tuple[None, ...]:
        # The shard's gradient is not returned to autograd: the asynchronous reduce-scatter
        # accumulates it into ``shard.grad`` itself (by the end of backward).
        if grad_full is not None:
            _start_scatter(ctx, grad_full)
        return None, None, None, None, None, None


def _start_scatter(gather: Any, grad_full: torch.Tensor) -> None:
    gather.scatters.start(gather.shard, grad_full, gather.group, gather.padded_numel,
                          gather.reduce_dtype)


class _GradReady(torch.autograd.Function):
    """The gathered parameter as it is; its backward reduce-scatters the gradient in place of
    the all-gather's (:func:`grad_ready`)."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, gather: Any) -> torch.Tensor:
        ctx.gather = gather
        return full.view_as(full)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[None, None]:
        _start_scatter(ctx.gather, grad_full)
        return None, None  # the all-gather's backward gets None: it starts nothing


@torch.compiler.disable
def grad_ready(full: torch.Tensor) -> torch.Tensor:
    """A recomputed region's first read of a gathered parameter that only it reads
    (``passes/recompute.py``, [Note: reduce-scatter in recomputed regions]).

    The region's all-gathers run before it, so autograd, which runs the ready backward of the
    most recently created node first, would run theirs, and start the reduce-scatters, only
    after the backward of the whole region: every gradient of the block alive at once, and its
    reduce-scatters one after another, waited for, at its end. Read through this, the gradient
    is reduce-scattered as soon as the region's backward has computed it, as outside regions.
    Anything but the output of a single parameter's all-gather (a bucket's member, a
    replicated parameter, the region's recomputation reading a re-gathered parameter) is
    returned as it is."""
    gather = full.grad_fn
    if isinstance(gather, _AllGatherParam._backward_cls) and torch.is_grad_enabled():
        return _GradReady.apply(full, gather)
    return full


class Prefetched:
    """An all-gather started ahead of its use by :func:`prefetch_param`."""

    def __init__(self, pending: Pending) -> None:
        self.pending: Pending | None = pending

    def take(self) -> Pending:
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError("a prefetched all-gather was used twice")
        return pending


@eager(_free_deferred)
def prefetch_param(shard: torch.Tensor, group: str, *,
                   dtype: torch.dtype | None = None) -> Prefetched:
    """Start gathering ``shard`` (cast to ``dtype``) asynchronously; :func:`all_gather_param`
    waits for it."""
    return Prefetched(gather_shards_start(cast(flat_shard(shard).detach(), dtype), group))


@eager(_free_deferred)
def all_gather_param(
    shard: torch.Tensor, shape: tuple[int, ...], strategy: str, group: str,
    prefetched: Prefetched | None = None, *, dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The full parameter of shape ``shape`` gathered from every rank's flat ``shard``.

    ``prefetched``: the all-gather a :func:`prefetch_param` node started earlier (this waits for
    it), else it is started here. Differentiable: in backward the gradient is reduce-scattered
    asynchronously, averaged over the ranks of ``group`` (a flat group, or a two-level group of
    :mod:`.hierarchy`) and accumulated into ``shard.grad`` (complete when backward returns).
    Mixed precision: ``dtype`` is the dtype the shard is cast to before it is gathered,
    ``reduce_dtype`` the one its gradient is reduce-scattered in (both default to the shard's).
    For the strategies that free after forward (full_shard, hybrid_shard, hierarchical) inside a
    StepContext, autograd saves a handle instead of the gathered tensor and backward re-gathers
    it.
    """
    shape = tuple(shape)
    pending = prefetched.take() if prefetched is not None else None
    if shard.requires_grad and torch.is_grad_enabled():
        full = _AllGatherParam.apply(shard, shape, group, pending, dtype, reduce_dtype)
    else:
        with torch.no_grad():
            full = gather_full(shard, shape, group, pending, dtype)
    ctx = _active()
    if traits(strategy).freed_after_forward and ctx is not None:
        ctx.track(full, Gathered(shard, shape, group, dtype))
    return full


class _AllGatherParams(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shapes: tuple[tuple[int, ...], ...], group: str,
                pending: Pending | None, dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.reduce_dtype, ctx.shards = group, reduce_dtype, shards
        ctx.scatters = _scatters()
        flat = (pending or start_params(shards, group, dtype)).wait()
        fulls = split_gathered(flat, shard_chunks(group), shards, shapes)
        # a frozen member (a LoRA layer's base weight) has no gradient: autograd computes none
        ctx.mark_non_differentiable(*(f for f, s in zip(fulls, shards) if not s.requires_grad))
        ctx.set_materialize_grads(False)
        return fulls

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        # One flat buffer of the trainable members, row r = what rank r's shards receive (each
        # member a column block), filled straight from the gradients: no padded or cast copies
        # on the way.
        world = shard_chunks(ctx.group)
        members = [(s, g) for s, g in zip(ctx.shards, grads) if s.requires_grad]
        shards = [s for s, _ in members]
        present = [g for _, g in members if g is not None]
        dtype = ctx.reduce_dtype or (present[0].dtype if present else shards[0].dtype)
        total = sum(padded_numel(s) for s in shards)
        if (len(present) == len(members) and all(g.dim() > 0 for g in present)
                and not ctx.scatters.holds(shards)):
            # every member's gradient, cut into ``world`` chunks of whole rows (the shards'
            # layout), in one op that casts as it copies
            flat = torch.empty((world, total), dtype=dtype, device=shards[0].device)
            torch._chunk_cat(present, dim=0, num_chunks=world, out=flat)
            ctx.scatters.start_flat(shards, flat.view(-1), ctx.group)
            return (None,) * (5 + len(ctx.shards))
        # zero, or what no_sync backwards accumulated ([Note: no_sync]): gradients are added
        flat = ctx.scatters.buffer(shards, world * total, dtype,
                                   shards[0].device).view(world, total)
        offset = 0
        for shard, grad in members:
            c = padded_numel(shard)
            if grad is not None:
                g, rows = grad.reshape(-1), grad.numel() // c
                flat[:rows, offset:offset + c].add_(g[:rows * c].view(rows, c))
                if rows * c < g.numel():
                    flat[rows, offset:offset + g.numel() - rows * c].add_(g[rows * c:])
            offset += c
        flat = flat.view(-1)
        ctx.scatters.start_flat(shards, flat, ctx.group)
        return (None,) * (5 + len(ctx.shards))


@eager(_free_deferred)
def prefetch_params(shards: tuple[torch.Tensor, ...], group: str, *,
                    dtype: torch.dtype | None = None) -> Prefetched:
    """:func:`prefetch_param` for a bucket of parameters (see :func:`all_gather_params`)."""
    return Prefetched(start_params(tuple(shards), group, dtype))


@eager(_free_deferred)
def all_gather_params(
    shards: tuple[torch.Tensor, ...], shapes: tuple[tuple[int, ...], ...], strategy: str,
    group: str, prefetched: Prefetched | None = None, *, dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None, regather_together: bool = False,
) -> tuple[torch.Tensor, ...]:
    """:func:`all_gather_param` for a bucket of parameters: one all-gather of every rank's
    concatenated shards, one reduce-scatter of their gradients in backward (of the trainable
    members': frozen ones share the gather, as FSDP2 gathers a module's). A full_shard member
    is freed on its own after its last use; backward re-gathers it on its own, or with the
    bucket's other saved members in one all-gather (``regather_together``: the bucket is at
    most the plan's ``gather_bucket_bytes``; a longer run of small parameters is not)."""
    shards, shapes = tuple(shards), tuple(tuple(s) for s in shapes)
    pending = prefetched.take() if prefetched is not None else None
    if any(s.requires_grad for s in shards) and torch.is_grad_enabled():
        fulls = _AllGatherParams.apply(shapes, group, pending, dtype, reduce_dtype, *shards)
    else:
        with torch.no_grad():
            flat = (pending or start_params(shards, group, dtype)).wait()
            fulls = split_gathered(flat, shard_chunks(group), shards, shapes)
    ctx = _active()
    if traits(strategy).freed_after_forward and ctx is not None:
        for shard, shape, full in zip(shards, shapes, fulls):
            ctx.track(full, Gathered(shard, shape, group, dtype,
                                     shards if regather_together else None))
    return tuple(fulls)


def free_param(full: torch.Tensor) -> None:
    """Release the storage of a gathered parameter after its last forward use (traced by
    torch.compile: at the end of the compiled region, [Note: torch.compile])."""
    if torch.compiler.is_compiling():
        defer_free(full)
        return
    _free(full)


def _free(full: torch.Tensor) -> None:
    ctx = _active()
    if ctx is not None and ctx.release(full):
        storage = full.untyped_storage()
        storage.resize_(0)
        note_resized(storage)


def make_shard(full: torch.Tensor, *, world_size: int, rank: int) -> nn.Parameter:
    """This rank's flat zero-padded shard of ``full`` (whole rows) as a new leaf parameter."""
    n = shard_numel(full.numel(), world_size, row_numel(full.shape))
    flat = pad_flat(full.detach(), n * world_size)
    return nn.Parameter(flat[rank * n:(rank + 1) * n].clone(), requires_grad=full.requires_grad)


def shard_of(full: torch.Tensor, strategy: str, *, world_size: int, ranks_per_node: int | None,
             rank: int) -> nn.Parameter:
    """This rank's shard of ``full`` under ``strategy``: its chunk of ``shard_layout``."""
    layout = shard_layout(strategy, world_size=world_size, ranks_per_node=ranks_per_node,
                          rank=rank)
    return make_shard(full, world_size=layout.chunks, rank=layout.index)

"""Averaging of replicated parameters' gradients over ranks, in buckets, DDP-style.

The trainable replicated parameters are assigned once, in reverse order (about the order
backward produces their gradients), to flat buckets of at most ``bucket_bytes`` per dtype. Each
parameter gets a post-accumulate-grad hook; when every parameter of a bucket has its gradient,
the bucket is packed and its all-reduce started asynchronously, overlapping the rest of
backward. Buckets start strictly in index order (a bucket that is ready waits for the ones
before it), so every rank issues the same collectives in the same order whatever order autograd
produced the gradients in. At most ``max_in_flight`` run at once: starting one more completes
the oldest (divide by the world size, copy back into the ``.grad`` tensors, free the bucket). A
callback queued on the autograd engine starts what is left (parameters without a gradient in
this backward are skipped) and completes everything when backward ends.

A part of a split weight is one of ``params``: its gradient is its view of the weight's
gradient (``sharded.grad_of``, [Note: split parameters]).

A backward of a forward run inside ``OSDPModule.no_sync()`` pauses the reducer (:meth:`pause`):
its gradients stay in ``.grad``, and the next synchronised backward all-reduces the sum
([Note: no_sync] in ``accumulation.py``).
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..core.buckets import DEFAULT_BUCKET_BYTES, MAX_IN_FLIGHT, plan_buckets
from .collectives import all_reduce_sum_start, group_size, wait_work
from .memory import note_resized
from .sharded import grad_of, local_of

log = logging.getLogger(__name__)

class GradReducer:
    """Averages the gradients of ``params`` over the ranks of ``group`` during and at the end of
    backward (in ``reduce_dtype``, default the gradients' own)."""

    def __init__(
        self, params: Sequence[nn.Parameter], group: str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reduce_dtype: torch.dtype | None = None, max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.params = list(params)
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.max_in_flight = max_in_flight
        order = self.params[::-1]
        self.buckets = [[order[i] for i in b] for b in plan_buckets(
            [(p.dtype, p.numel() * p.element_size()) for p in order], bucket_bytes)]
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        # The hooks live on the parameters (in C++, out of the garbage collector's sight): they
        # must not hold the reducer, which holds the parameters, or neither is ever freed.
        this = weakref.ref(self)

        def on_grad(param: torch.Tensor) -> None:
            reducer = this()
            if reducer is not None:
                reducer._on_grad(param)

        self._handles = [p.register_post_accumulate_grad_hook(on_grad) for p in self.params]
        self.unsynced = False  # gradients accumulated by a paused backward, not yet reduced
        self.new_step()

    def new_step(self) -> None:
        """Start a step afresh (also forgets what a failed backward left: autograd drops its
        end-of-backward callback)."""
        self._queued = False
        self._paused = False
        self._missing = [len(b) for b in self.buckets]
        self._next = 0  # the next bucket to start
        self._in_flight: collections.deque[tuple[list[nn.Parameter], torch.Tensor, Any]] = (
            collections.deque())

    def pause(self) -> None:
        """Leave the gradients of the backward now running in ``.grad``, unreduced."""
        if not self._paused:
            self._paused = True
            torch.autograd.Variable._execution_engine.queue_callback(self._resume)

    def _resume(self) -> None:
        self._paused = False

    def flush(self) -> None:
        """End of a synchronised backward that produced no replicated gradient: all-reduce the
        ones earlier paused backwards accumulated."""
        if self.unsynced and not self._queued:
            self._finish()

    def _on_grad(self, param: torch.Tensor) -> None:
        if group_size(self.group) == 1:
            return
        if self._paused:
            self.unsynced = True
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        self._missing[self._bucket_of[id(param)]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] == 0:
            self._start(self._next)

    def _start(self, index: int) -> None:
        self._next = index + 1
        bucket = [p for p in self.buckets[index] if grad_of(p) is not None]
        if not bucket:
            return
        while len(self._in_flight) >= self.max_in_flight:
            self._complete(*self._in_flight.popleft())
        flat = torch.cat([local_of(grad_of(p)).reshape(-1) for p in bucket])
        if self.reduce_dtype is not None:
            flat = flat.to(self.reduce_dtype)
        self._in_flight.append((bucket, flat, all_reduce_sum_start(flat, self.group)))

    def _complete(self, bucket: list[nn.Parameter], flat: torch.Tensor, work: Any) -> None:
        wait_work(work)
        flat.div_(group_size(self.group))
        offset = 0
        for p in bucket:
            n = p.numel()
            grad = local_of(grad_of(p))
            grad.copy_(flat[offset:offset + n].view_as(grad))
            offset += n
        # The collective is complete, but gloo's worker may hold the buffer for a few more
        # milliseconds: release its memory now rather than when the last reference goes.
        storage = flat.untyped_storage()
        storage.resize_(0)
        note_resized(storage)

    def _finish(self) -> None:
        while self._next < len(self.buckets):
            self._start(self._next)
        while self._in_flight:
            self._complete(*self._in_flight.popleft())
        self.unsynced = False
        self.new_step()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

"""Averaging of replicated parameters' gradients over ranks, in buckets, DDP-style.

Each trainable replicated parameter gets a post-accumulate-grad hook. The first hook to fire in a
backward pass queues a callback on the autograd engine that runs when backward ends: it
all-reduces every replicated gradient in a fixed order, packed into flat buckets of at most
``bucket_bytes`` per dtype, and divides by the world size. The fixed order makes every rank issue
the same collectives whatever order autograd produced the gradients in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .collectives import all_reduce_sum_, group_size
from .memory import note_resized

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 2**20


def plan_buckets(sizes: Sequence[tuple[Any, int]], bucket_bytes: int) -> list[list[int]]:
    """Group tensors, given as (dtype, bytes) in order, into buckets of one dtype and at most
    ``bucket_bytes`` (a larger tensor gets a bucket of its own). Returns index lists."""
    buckets: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}
    for i, (dtype, nbytes) in enumerate(sizes):
        bucket, filled = open_bucket.get(dtype, (None, 0))
        if bucket is None or filled + nbytes > bucket_bytes:
            bucket, filled = [], 0
            buckets.append(bucket)
        bucket.append(i)
        open_bucket[dtype] = (bucket, filled + nbytes)
    return buckets


class GradReducer:
    """Averages the gradients of ``params`` over the ranks of ``group`` at the end of backward
    (in ``reduce_dtype``, default the gradients' own)."""

    def __init__(
        self, params: Sequence[nn.Parameter], group: str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = list(params)
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.bucket_bytes = bucket_bytes
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def new_step(self) -> None:
        """Forget a reduction queued by a backward that failed (autograd drops its callback)."""
        self._queued = False

    def _on_grad(self, _param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce_all)

    def _buckets(self) -> list[list[nn.Parameter]]:
        with_grad = [p for p in self.params if p.grad is not None]
        groups = plan_buckets([(p.dtype, p.numel() * p.element_size()) for p in with_grad],
                              self.bucket_bytes)
        return [[with_grad[i] for i in group] for group in groups]

    def _reduce_all(self) -> None:
        self._queued = False
        world = group_size(self.group)
        if world == 1:
            return
        for bucket in self._buckets():
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            if self.reduce_dtype is not None:
                flat = flat.to(self.reduce_dtype)
            all_reduce_sum_(flat, self.group).div_(world)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
            # The collective is complete, but gloo's worker may hold the buffer for a few more
            # milliseconds: release its memory now rather than when the last reference goes.
            storage = flat.untyped_storage()
            storage.resize_(0)
            note_resized(storage)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

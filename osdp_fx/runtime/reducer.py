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

import torch
from torch import nn

from .collectives import all_reduce_sum_, group_size

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 25 * 2**20


class GradReducer:
    """Averages the gradients of ``params`` over the ranks of ``group`` at the end of backward."""

    def __init__(
        self, params: Sequence[nn.Parameter], group: str, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        self.params = list(params)
        self.group = group
        self.bucket_bytes = bucket_bytes
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _on_grad(self, _param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce_all)

    def _buckets(self) -> list[list[nn.Parameter]]:
        buckets: list[list[nn.Parameter]] = []
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.params:
            if p.grad is None:
                continue
            bucket = by_dtype.get(p.dtype)
            size = p.numel() * p.element_size()
            if bucket is None or sum(q.numel() for q in bucket) * p.element_size() + size > self.bucket_bytes:
                bucket = by_dtype[p.dtype] = []
                buckets.append(bucket)
            bucket.append(p)
        return buckets

    def _reduce_all(self) -> None:
        self._queued = False
        world = group_size(self.group)
        if world == 1:
            return
        for bucket in self._buckets():
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            all_reduce_sum_(flat, self.group).div_(world)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

"""Gradient accumulation without synchronisation: the runtime of ``OSDPModule.no_sync()``.

[Note: no_sync]
A forward run inside ``no_sync()`` makes its backward local: no collective runs in it, and the
gradients it produces wait for the next synchronised backward, which reduces the accumulated
sum once. As in DDP, the forward decides (``GradSync.begin_forward``): a backward through a
forward run inside ``no_sync()`` is local wherever ``backward()`` is called, one through a
forward run outside it synchronises.

* Replicated parameters: their gradients accumulate in ``.grad`` as autograd leaves them; the
  module's ``GradReducer`` is paused for that backward (``GradReducer.pause``, set by a hook
  on the forward's outputs, the first thing its backward runs). The next synchronised backward
  all-reduces ``.grad``, now the sum over the micro-batches, and divides by the world size once:
  the mean over ranks of the sum over micro-batches, DDP's result.
* Sharded parameters: the gather's backward adds the full gradient to a flat buffer of the
  module's own (:class:`HeldGrads`; a parameter's padded flat gradient in the reduce dtype, or
  a bucket's row-per-rank layout) instead of starting its reduce-scatter (the forward's gathers
  hand their gradients to :class:`LocalScatters` instead of the module's reduce-scatter queue).
  The next synchronised backward adds its full gradient into that buffer and reduce-scatters
  the buffer: the same collective as without accumulation, on the sum. Like FSDP's
  ``no_sync``, this holds one unsharded gradient per sharded parameter between micro-batches.
* Under mixed precision the held buffers are in the reduce dtype (float32 by default), as the
  reduce-scatter's input is; replicated gradients accumulate in the parameters' own dtype.
* A synchronised backward that does not reach some gradient held or accumulated before (a
  micro-batch whose loss skips a parameter) still reduces it, at the end of backward.
* A no_sync forward leaves the reducer's and the queue's per-step state as it is, so a
  synchronised forward whose backward has not run yet is not disturbed by it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .reducer import GradReducer


class HeldGrads:
    """Unsharded gradients of sharded parameters held between micro-batches, by the tuple of
    shards they reduce into (one parameter, or a bucket of small ones)."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], torch.Tensor, str]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def take(self, shards: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The buffer held for ``shards``, which is no longer held (None if none is)."""
        entry = self._held.pop(tuple(id(s) for s in shards), None)
        return entry[1] if entry is not None else None

    def holds(self, shards: Sequence[torch.Tensor]) -> bool:
        return tuple(id(s) for s in shards) in self._held

    def buffer(self, shards: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """The buffer held for ``shards`` (taken), else a zero one: gradients are added to it."""
        held = self.take(shards)
        if held is None:
            return torch.zeros(numel, dtype=dtype, device=device)
        assert held.numel() == numel and held.dtype == dtype, (held.shape, numel, held.dtype)
        return held

    def add_full(self, shard: torch.Tensor, grad_full: torch.Tensor, padded_numel: int,
                 dtype: torch.dtype | None) -> torch.Tensor:
        """The buffer of one parameter (taken, else new) with ``grad_full`` added."""
        flat = self.buffer([shard], padded_numel, dtype or grad_full.dtype, grad_full.device)
        flat[:grad_full.numel()].add_(grad_full.reshape(-1))
        return flat

    def hold(self, shards: Sequence[torch.Tensor], flat: torch.Tensor, group: str) -> None:
        key = tuple(id(s) for s in shards)
        assert key not in self._held, "a held gradient is taken before it is held again"
        self._held[key] = (tuple(shards), flat, group)

    def take_all(self) -> list[tuple[list[torch.Tensor], torch.Tensor, str]]:
        """Every held buffer, in the order they were first held (the same on every rank)."""
        out = [(list(shards), flat, group) for shards, flat, group in self._held.values()]
        self._held.clear()
        return out

    def clear(self) -> None:
        self._held.clear()


class LocalScatters:
    """Where a no_sync forward's gathers send their gradients (the interface of
    ``GradReduceScatters``): added to the held buffers, no collective."""

    def __init__(self, held: HeldGrads) -> None:
        self.held = held

    def buffer(self, shards: Sequence[torch.Tensor], numel: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        return self.held.buffer(shards, numel, dtype, device)

    def holds(self, shards: Sequence[torch.Tensor]) -> bool:
        return True  # a no_sync backward adds to the held buffers

    def start(self, shard: torch.Tensor, grad_full: torch.Tensor, group: str,
              padded_numel: int, reduce_dtype: torch.dtype | None = None) -> None:
        self.held.hold([shard], self.held.add_full(shard, grad_full, padded_numel, reduce_dtype),
                       group)

    def start_flat(self, shards: list[torch.Tensor], flat: torch.Tensor, group: str, *,
                   owned: bool = True) -> None:
        assert owned, "a held gradient must be a buffer of its own"
        self.held.hold(shards, flat, group)


class GradSync:
    """Whether one compiled module's backwards synchronise their gradients (``no_sync()``),
    and what accumulates meanwhile (see [Note: no_sync]).

    ``scatters`` is the module's reduce-scatter queue (``GradReduceScatters``, whose ``held``
    is this object's ``held``), ``reducer`` its all-reduce of replicated gradients.
    """

    def __init__(self, reducer: GradReducer, scatters: Any, held: HeldGrads) -> None:
        self.reducer, self.scatters, self.held = reducer, scatters, held
        self.local = LocalScatters(held)
        self.enabled = True
        self._flush_queued = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def begin_forward(self) -> tuple[bool, Any]:
        """(whether this forward's backward synchronises, where its gathers send gradients);
        a synchronised forward starts the step's collective state afresh."""
        if not self.enabled:
            return False, self.local
        self.reducer.new_step()
        self.scatters.reset()
        self._flush_queued = False  # also what a failed backward left
        return True, self.scatters

    def end_forward(self, output: Any, sync: bool) -> Any:
        """Hook the forward's outputs: a no_sync forward's backward pauses the reducer; a
        synchronised one reduces, at its end, what earlier local backwards left unreached."""
        if not torch.is_grad_enabled() or (sync and not self.held and not self.reducer.unsynced):
            return output
        this = weakref.ref(self)  # the hooks live in the autograd graph: no cycle through it

        def on_backward(_: torch.Tensor) -> None:
            owner = this()
            if owner is not None:
                owner._backward_starts(sync)

        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(on_backward)
        return output

    def _backward_starts(self, sync: bool) -> None:
        if not sync:
            self.reducer.pause()
        elif not self._flush_queued:
            self._flush_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._flush)

    def _flush(self) -> None:
        """End of a synchronised backward: reduce what it did not reach itself."""
        self._flush_queued = False
        for shards, flat, group in self.held.take_all():
            self.scatters.start_flat(shards, flat, group)
        self.reducer.flush()

    def drop(self) -> None:
        """Forget gradients accumulated locally and not yet reduced (``zero_grad``)."""
        self.held.clear()
        self.reducer.unsynced = False

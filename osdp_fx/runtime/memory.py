"""LiveTensorTracker: bytes of tensor storage alive, counted at the dispatcher.

A TorchDispatchMode that adds ``untyped_storage().nbytes()`` for every new storage an operator
creates (outputs that share an input's storage, views and in-place results, are not new) and
subtracts it when the storage is freed. Storages created before the mode was entered are not
counted. It measures what an
allocator-agnostic "live tensor bytes" means on any device, CPU included, where
``torch.cuda.max_memory_allocated`` does not exist.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .storage_tracker import dense_tensors

_active_trackers: list[LiveTensorTracker] = []


def storage_key(t: torch.Tensor) -> int:
    """A key of ``t``'s storage, the same for every view of it while the storage lives."""
    return t.untyped_storage()._cdata


def note_resized(storage: torch.UntypedStorage) -> None:
    """Tell active trackers that ``storage`` was resized in place (not seen by the dispatcher)."""
    for tracker in _active_trackers:
        tracker.resized(storage)


class LiveTensorTracker(TorchDispatchMode):
    """Counts live and peak storage bytes created while the mode is active."""

    def __enter__(self) -> LiveTensorTracker:
        _active_trackers.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _active_trackers.remove(self)
        super().__exit__(*exc)

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._seen: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {
            storage_key(d) for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) for d in dense_tensors(t)
        }
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            # meta and fake tensors (profiling a meta model) have no memory; a DTensor's is
            # its local tensor's
            if isinstance(t, torch.Tensor) and not is_fake(t):
                for d in dense_tensors(t):
                    storage = d.untyped_storage()
                    if storage._cdata not in inputs:  # views and in-place results are not new
                        self._count(storage)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            if key in self._seen:
                return
            self._seen[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            self.live_bytes -= self._seen.pop(key, 0)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Account for a storage resized in place (e.g. freed with ``resize_(0)``)."""
        with self._lock:
            key = storage._cdata
            if key in self._seen:
                self.live_bytes += storage.nbytes() - self._seen[key]
                self._seen[key] = storage.nbytes()

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def settle(self, *, below_bytes: int | None = None, timeout_s: float = 0.2) -> int:
        """Live bytes after letting background threads (gloo) drop their last references."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (below_bytes is None or self.live_bytes >= below_bytes):
            time.sleep(0.01)
        return self.live_bytes


def measure_step_peak_bytes(
    step: Callable[[], None],
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    zero_grad: Callable[[], None],
    warmup_steps: int = 2,
) -> int:
    """Peak bytes of one steady-state training step: what exists before it (parameters and
    optimizer state, counted by storage) plus the tracker's peak during it.

    Runs ``warmup_steps`` steps first (so optimizer state exists), each followed by
    ``zero_grad`` (which should set gradients to None), then one measured step.
    """
    for _ in range(warmup_steps):
        step()
        zero_grad()
    existing: dict[int, int] = {}
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    for t in (*params, *state):
        for d in dense_tensors(t):
            storage = d.untyped_storage()
            existing[storage._cdata] = storage.nbytes()
    tracker = LiveTensorTracker()
    with tracker:
        step()
    peak = sum(existing.values()) + tracker.peak_bytes
    zero_grad()
    return peak

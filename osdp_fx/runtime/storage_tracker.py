"""An independent live-storage tracker: the bytes of every tensor storage this process holds.

It imports only torch, nothing of osdp-fx, so that it measures what a user measures, not what
the project's runtime reports about itself: the tests and benchmarks judge the memory promise
with it, and autotuning (``planner/autotune.py``) admits a plan predicted above the memory margin only
when it measures the plan's peak under the limit. Users may measure their own steps with it.

- On entry it finds every tensor the process already holds, through ``gc.get_objects()``
  (without collecting: a tensor kept alive by a reference cycle is held memory), the tensors
  autograd graphs hanging off them save, and any ``extra`` tensors given.
- While active, every operator's inputs and outputs are registered (a TorchDispatchMode), so
  every storage created during the step is seen, whoever allocates it.
- Storages are counted at their **current** size: after every operator the tracker re-sums
  ``nbytes()`` of the live storages, so a storage shrunk by ``untyped_storage().resize_(0)``
  (which no dispatch mode sees) counts as freed, and one grown back as allocated.
- A storage leaves the count when it is freed (a weak reference to it dies).
- Wrapper subclasses (DTensor) count their inner tensors (``__tensor_flatten__``).

``samples`` records (operator index, live bytes, phase) after every operator, with phases set
by :meth:`phase`, for drawing the measured memory over a step.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StorageTracker", "dense_tensors", "held_tensors"]


def dense_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own real storage behind ``t``: a wrapper subclass's inner tensors; none
    for meta and fake tensors. (torch 2.13's DTensor also names its ``device_mesh`` among its
    inner attributes: attributes that are not tensors own no storage.)"""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, n) for n in names)
        return [d for i in inner if isinstance(i, torch.Tensor) for d in dense_tensors(i)]
    if t.device.type == "meta" or getattr(t, "fake_mode", None) is not None:
        return []
    return [t]


def _saved_by_graph(t: torch.Tensor, seen: set[int]) -> Iterable[torch.Tensor]:
    """Tensors that the autograd graph ending at ``t.grad_fn`` saves for backward."""
    stack = [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        for attr in dir(fn):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(fn, attr)
                except RuntimeError:  # already freed by a backward
                    continue
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(v, torch.Tensor):
                        yield v
        stack.extend(next_fn for next_fn, _ in fn.next_functions)


def _is_tensor(o: Any) -> bool:
    try:
        return isinstance(o, torch.Tensor)
    except ReferenceError:  # a weakref.proxy whose referent died (torch.compile makes some)
        return False


def held_tensors() -> list[torch.Tensor]:
    """Every tensor reachable by the garbage collector's list of objects (no collection), and
    the tensors their autograd graphs save."""
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes warns
        warnings.simplefilter("ignore", FutureWarning)
        found = [o for o in gc.get_objects() if _is_tensor(o)]
    seen_fns: set[int] = set()
    saved = [s for t in found if t.grad_fn is not None for s in _saved_by_graph(t, seen_fns)]
    return found + saved


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes of every storage the process holds, counted at current size."""

    def __init__(self, extra: Iterable[torch.Tensor] = (), *, record: bool = False) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._live: dict[int, weakref.ref] = {}
        self.record = record
        self.samples: list[tuple[int, int, str]] = []
        self._phase = ""
        self._ops = 0
        for t in (*held_tensors(), *extra):
            self._add(t)
        self.live_bytes = self._sum()
        self.peak_bytes = self.live_bytes
        self.start_bytes = self.live_bytes

    # ---- registering storages -------------------------------------------------------------
    def _add(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            return
        for d in dense_tensors(t):
            storage = d.untyped_storage()
            key = storage._cdata
            if key in self._live:
                continue

            def forget(_: Any, key: int = key, tracker: weakref.ref = weakref.ref(self)) -> None:
                me = tracker()  # weakly: a tracker is no reference cycle, freed when dropped
                if me is not None:
                    with me._lock:
                        me._live.pop(key, None)

            with self._lock:
                self._live[key] = weakref.ref(storage, forget)

    def _sum(self) -> int:
        with self._lock:
            refs = list(self._live.values())
        total = 0
        for ref in refs:
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    # ---- the mode -------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in tree_leaves((args, kwargs, out)):
            self._add(t)
        self.update()
        return out

    def update(self) -> int:
        """Re-sum the live storages (call after work done outside the dispatcher)."""
        self.live_bytes = self._sum()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._ops += 1
        if self.record:
            self.samples.append((self._ops, self.live_bytes, self._phase))
        return self.live_bytes

    def phase(self, name: str) -> None:
        """Label the samples that follow (e.g. 'forward', 'backward', 'optimizer')."""
        self._phase = name
        self.update()

    def reset_peak(self) -> None:
        self.peak_bytes = self.update()

"""Runtime of sharded parameters: the functions the sharding pass inserts as graph nodes.

* :func:`all_gather_param` gathers a parameter's flat shards into the full tensor. Its backward
  reduce-scatters the full gradient and averages it over ranks into the shard's gradient.
* :func:`free_param` releases a full_shard parameter's gathered storage after its last forward
  use.
* :class:`StepContext` (entered by ``OSDPModule.forward``) installs saved-tensor hooks: when
  autograd wants to save a gathered full_shard parameter (or a view of it, such as ``W.t()``) it
  keeps a small handle instead, and backward re-gathers the parameter when it needs it. So no
  gathered full_shard weight stays alive between forward and backward.

Outside a StepContext (a bare call of the graph module) the functions still compute the right
values; gathered tensors are then simply kept by autograd like any other tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .collectives import all_gather_flat, group_size, pad_flat, reduce_scatter_flat
from .memory import note_resized

FULL_SHARD = "full_shard"
SHARD_GRAD_OP = "shard_grad_op"


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclasses.dataclass
class _Gathered:
    shard: torch.Tensor
    shape: tuple[int, ...]
    group: str


@dataclasses.dataclass(frozen=True)
class _Handle:
    """What autograd keeps instead of a view of a gathered parameter."""

    gathered: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class StepContext:
    """Tracks this forward's gathered full_shard parameters and re-gathers them in backward."""

    def __init__(self) -> None:
        self._live: dict[int, _Gathered] = {}
        self._regathered: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )

    def track(self, full: torch.Tensor, gathered: _Gathered) -> None:
        self._live[_storage_key(full)] = gathered

    def release(self, full: torch.Tensor) -> bool:
        return self._live.pop(_storage_key(full), None) is not None

    def pack(self, t: torch.Tensor) -> Any:
        gathered = self._live.get(_storage_key(t)) if t.device.type != "meta" else None
        if gathered is None:
            return t
        return _Handle(gathered, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        g = packed.gathered
        full = self._regathered.get(id(g.shard))
        if full is None:
            with torch.no_grad():
                full = _gather_full(g.shard, g.shape, g.group)
            self._regathered[id(g.shard)] = full
        return full.as_strided(packed.size, packed.stride, packed.offset)


_local = threading.local()


def _active() -> StepContext | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def step_context() -> Iterator[StepContext]:
    """Run a forward with re-gathering of freed full_shard parameters in backward."""
    ctx = StepContext()
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(ctx)
    try:
        with torch.autograd.graph.saved_tensors_hooks(ctx.pack, ctx.unpack):
            yield ctx
    finally:
        stack.pop()


def _gather_full(shard: torch.Tensor, shape: tuple[int, ...], group: str) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    return all_gather_flat(shard, group)[:numel].view(shape)


class _AllGatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, shape: tuple[int, ...], group: str) -> torch.Tensor:
        ctx.group = group
        ctx.padded_numel = shard.numel() * group_size(group)
        return _gather_full(shard, shape, group)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        world = group_size(ctx.group)
        grad_shard = reduce_scatter_flat(pad_flat(grad_full, ctx.padded_numel), ctx.group)
        return grad_shard.div_(world), None, None


def all_gather_param(
    shard: torch.Tensor, shape: tuple[int, ...], strategy: str, group: str
) -> torch.Tensor:
    """The full parameter of shape ``shape`` gathered from every rank's flat ``shard``.

    Differentiable: the gradient of the result is reduce-scattered into the shard and averaged
    over the ranks of ``group``. For ``strategy == "full_shard"`` inside a StepContext, autograd
    saves a handle instead of the gathered tensor and backward re-gathers it.
    """
    shape = tuple(shape)
    if shard.requires_grad and torch.is_grad_enabled():
        full = _AllGatherParam.apply(shard, shape, group)
    else:
        with torch.no_grad():
            full = _gather_full(shard, shape, group)
    ctx = _active()
    if strategy == FULL_SHARD and ctx is not None:
        ctx.track(full, _Gathered(shard, shape, group))
    return full


def free_param(full: torch.Tensor) -> None:
    """Release the storage of a gathered full_shard parameter after its last forward use."""
    ctx = _active()
    if ctx is not None and ctx.release(full):
        storage = full.untyped_storage()
        storage.resize_(0)
        note_resized(storage)

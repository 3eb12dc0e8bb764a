"""Sharded parameters as users see them: ``DTensor`` parameters of their logical shape, sharded
on dim 0 (as FSDP2's), over the padded flat buffers the collectives move.

A rank holds of a sharded parameter one padded flat chunk of whole rows (``core/layout.py``):
``ceil(rows / chunks)`` rows, the trailing ones zero where the parameter has fewer rows. The
compiled module registers, under the parameter's own name, an ``nn.Parameter`` wrapping a
``DTensor`` of the parameter's shape whose local tensor is the chunk's rows that hold data, a
view of the flat buffer (:func:`as_dtensor`). So ``p.shape``, ``p.dim()`` and ``p.numel()`` are
the model's, optimizers update the buffer in place, ``torch.nn.utils.clip_grad_norm_`` and
``torch.distributed.checkpoint`` read the parameter as they read FSDP2's, and the graph's
all-gathers read the flat buffer behind it without a copy (:func:`flat_shard`).

The runtime writes gradients the same way: a reduce-scattered chunk becomes ``p.grad``, a
``DTensor`` like ``p`` (:func:`accumulate_grad`).

Under a plan that shards some parameters and replicates others, the replicated ones are
DTensors too, ``Replicate()`` over the world (:func:`as_replicated`), as FSDP2 and torch's
``replicate`` present theirs: a foreach optimizer step or ``clip_grad_norm_`` (the default on a
GPU) takes one list of tensors, and refuses DTensors mixed with plain tensors. The graph reads
such a parameter's local tensor (:func:`local_param`), so its gradient becomes ``p.grad``, a
``Replicate()`` DTensor over the gradient autograd computed. Under a plan that replicates every
parameter they stay plain tensors, as DDP's.

Without a process group (world size 1, none initialised) there is no mesh: a sharded parameter
is then the whole tensor, a plain parameter of its shape over the one chunk.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.layout import row_numel, shard_layout, shard_numel
from .collectives import pad_flat
from .hierarchy import checkpoint_mesh


@functools.cache
def _dtensor_type() -> Any:
    """``DTensor``, imported on first use (``import osdp_fx`` stays light); cached: the runtime
    asks per parameter and step."""
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t: Any) -> bool:
    return isinstance(t, _dtensor_type())


def local_of(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local tensor, or ``t``."""
    return t._local_tensor if is_dtensor(t) else t  # type: ignore[attr-defined]


def padded_numel(t: torch.Tensor) -> int:
    """Elements of the padded flat chunk behind ``t`` (a DTensor: of its global shape)."""
    if not is_dtensor(t):
        return t.numel()
    chunks = t._spec.num_shards  # type: ignore[attr-defined]
    return shard_numel(t.numel(), chunks, row_numel(tuple(t.shape)))


def flat_shard(t: torch.Tensor) -> torch.Tensor:
    """The padded flat chunk behind ``t``: for a parameter :func:`as_dtensor` made, a view of
    its buffer (writes reach the parameter); for another DTensor laid out like one (a gradient,
    an optimizer state), a view too when its storage holds the padding, else a padded copy; a
    plain tensor flattened."""
    if not is_dtensor(t):
        return t.reshape(-1)
    local, n = local_of(t), padded_numel(t)
    offset = local.storage_offset()
    if local.is_contiguous() and local.untyped_storage().nbytes() >= (
            (offset + n) * local.element_size()):
        # a view of the local tensor's storage, padding included (a view, not a new storage,
        # to autograd and to the memory trackers)
        return local.as_strided((n,), (1,), offset)
    return pad_flat(local, n)


def as_dtensor(flat: torch.Tensor, shape: tuple[int, ...], strategy: str, *, world_size: int,
               ranks_per_node: int | None, rank: int) -> nn.Parameter:
    """A parameter of ``shape`` over this rank's padded flat chunk ``flat`` (a leaf parameter of
    the sharding pass): a DTensor sharded on dim 0 whose local tensor views ``flat``, or,
    without a process group, the whole tensor (one chunk) as a plain parameter."""
    requires_grad = flat.requires_grad
    data = flat.detach()
    numel = math.prod(shape)
    if not (dist.is_available() and dist.is_initialized()):
        return nn.Parameter(data[:numel].view(shape), requires_grad=requires_grad)
    from torch.distributed.tensor import DTensor

    layout = shard_layout(strategy, world_size=world_size, ranks_per_node=ranks_per_node,
                          rank=rank)
    row = row_numel(shape)
    rows = -(-numel // row) if numel else 0
    per_rank = data.numel() // row
    mine = max(0, min(per_rank, rows - layout.index * per_rank))
    local = data[:mine * row].view(mine, *shape[1:])
    mesh, placements = checkpoint_mesh(strategy, world_size=world_size,
                                       ranks_per_node=ranks_per_node,
                                       device_type=data.device.type)
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return nn.Parameter(DTensor.from_local(local, mesh, placements, shape=torch.Size(shape),
                                           stride=strides, run_check=False),
                        requires_grad=requires_grad)


def as_replicated(param: nn.Parameter, *, world_size: int) -> nn.Parameter:
    """A replicated parameter as a DTensor replicated over the world whose local tensor is
    ``param``'s data (no copy)."""
    from torch.distributed.tensor import DTensor

    data = param.detach()
    mesh, placements = checkpoint_mesh("replicate", world_size=world_size, ranks_per_node=None,
                                       device_type=data.device.type)
    return nn.Parameter(DTensor.from_local(data, mesh, placements, shape=data.shape,
                                           stride=data.stride(), run_check=False),
                        requires_grad=param.requires_grad)


def local_param(param: torch.Tensor) -> torch.Tensor:
    """What the graph computes with for a replicated parameter (``passes/shard.py``): a
    DTensor's local tensor, through ``to_local`` (differentiable: the gradient reaches the
    parameter as a DTensor of its placement), or the parameter itself."""
    return param.to_local() if is_dtensor(param) else param


def like(param: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (a padded flat chunk laid out like ``param``'s) as ``param`` holds it: a DTensor
    of the same placement viewing it, or the flat chunk itself viewed at ``param``'s shape."""
    if not is_dtensor(param):
        return flat[:param.numel()].view(param.shape)
    from torch.distributed.tensor import DTensor

    local = local_of(param)
    view = flat[:local.numel()].view(local.shape)
    if flat.dtype == param.dtype:
        # the parameter's own spec (mesh, placements, global shape, stride, dtype): a runtime
        # call per gradient and step, which from_local's checks and autograd make ~15x slower
        return DTensor(view, param._spec, requires_grad=False)  # type: ignore[attr-defined]
    return DTensor.from_local(view, param.device_mesh, param.placements,  # type: ignore[attr-defined]
                              shape=param.shape, stride=param.stride(), run_check=False)


def accumulate_grad(param: torch.Tensor, chunk: torch.Tensor) -> None:
    """Add this rank's reduced gradient ``chunk`` (padded flat, ``param``'s dtype) to
    ``param.grad``, or make it ``param.grad`` (viewing ``chunk``)."""
    if param.grad is None:
        param.grad = like(param, chunk)
    else:
        flat = local_of(param.grad).reshape(-1)
        flat.add_(chunk[:flat.numel()])


def whole_rows(full: torch.Tensor, *, world_size: int, rank: int) -> torch.Tensor:
    """A DTensor of ``full``'s shape sharded on dim 0 over the world (in rank order), this
    rank's ``torch.chunk`` rows of ``full`` copied as its local tensor."""
    from torch.distributed.tensor import DTensor

    rows = full.shape[0] if full.dim() else 1
    per_rank = -(-rows // world_size)
    mine = full.reshape(rows, *full.shape[1:])[rank * per_rank:(rank + 1) * per_rank].clone()
    mesh, placements = checkpoint_mesh("full_shard", world_size=world_size, ranks_per_node=None,
                                       device_type=full.device.type)
    return DTensor.from_local(mine, mesh, placements, shape=full.shape, stride=full.stride(),
                              run_check=False)

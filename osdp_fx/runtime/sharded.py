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

[Note: split parameters]
A weight the plan splits (``passes/split_linear.py``) is one parameter too, under its own name
and of its own shape: the graph reads its parts (``<weight>_part<i>``, each a group of the plan
with its own strategy), which are views of that parameter's storage, not parameters of the
module. Where no part holds a chunk (every part replicated, or one chunk each), the parameter
is the whole weight and each part a slice of it along the split dimension (a ``Replicate()``
DTensor where the plan shards other parameters, as replicated ones are). Otherwise this rank's
local tensor is its parts' local data concatenated, in order: a sharded part's padded flat
chunk, a replicated part's rows (:class:`SplitGrads`); the parameter is then a ``DTensor`` of the
weight's shape on the mesh of its first sharded part. That local tensor is not a ``Shard(0)``
chunk of the weight: elementwise operations (optimizers) and the runtime read it as they
should; ``full_tensor()`` does not, nor does ``torch.nn.utils.clip_grad_norm_`` where a part is
replicated (``osdp_fx.clip_grad_norm_`` does). ``state_dict()`` gives it with a local tensor that
tells ``torch.distributed.checkpoint`` where each part's rows lie (:class:`SplitChunks`).

Gradients land in the parameter's ``.grad``, laid out like it: a replicated part's gradient is
accumulated by autograd into its view of it (:meth:`SplitGrads.prepare`, which allocates the
gradient, zero, if there is none yet), a sharded part's reduced shard is added into its view,
or held until the gradient exists, at the latest until backward ends, when the held shards
make it (:meth:`SplitGrads.add`, :meth:`SplitGrads.join`). The parts never hold a ``.grad``
outside their accumulation, so ``zero_grad`` on the parameter (the module's or an
optimizer's) leaves nothing stale behind. Converting the module (``to()``, ``double()``)
points the parts at the converted storage again (``ParamTable.repoint``).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core.layout import row_numel, shard_layout, shard_numel
from .collectives import pad_flat
from .hierarchy import checkpoint_mesh
from .local_step import adopt
from .memory import note_resized


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
    """Elements of the padded flat chunk behind ``t`` (a DTensor: of its global shape). A
    parameter :func:`as_dtensor` made carries it (the runtime asks several times per parameter
    and step, and a DTensor's spec takes microseconds to count its shards)."""
    if not is_dtensor(t):
        return t.numel()
    known = t.__dict__.get(_PADDED)
    if known is not None:
        return known
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


def shaped(flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """The first ``prod(shape)`` elements of the 1-D contiguous ``flat`` viewed at ``shape``, in
    one operation (``flat[:n].view(shape)`` is two: the runtime does this per parameter and
    step)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return flat.as_strided(tuple(shape), tuple(reversed(strides)), flat.storage_offset())


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
    param = nn.Parameter(DTensor.from_local(local, mesh, placements, shape=torch.Size(shape),
                                            stride=strides, run_check=False),
                         requires_grad=requires_grad)
    setattr(param, _PADDED, data.numel())
    return adopt(param)


_PADDED = "_osdp_padded_numel"
"""The attribute of a parameter :func:`as_dtensor` made that holds :func:`padded_numel`."""


def as_replicated(param: nn.Parameter, *, world_size: int) -> nn.Parameter:
    """A replicated parameter as a DTensor replicated over the world whose local tensor is
    ``param``'s data (no copy)."""
    from torch.distributed.tensor import DTensor

    data = param.detach()
    mesh, placements = checkpoint_mesh("replicate", world_size=world_size, ranks_per_node=None,
                                       device_type=data.device.type)
    return adopt(nn.Parameter(DTensor.from_local(data, mesh, placements, shape=data.shape,
                                                 stride=data.stride(), run_check=False),
                              requires_grad=param.requires_grad))


def local_param(param: torch.Tensor) -> torch.Tensor:
    """What the graph computes with for a replicated parameter (``passes/shard.py``): a
    ``Replicate()`` DTensor's local tensor, the leaf of autograd :func:`read_locally` made it
    ([Note: a replicated parameter's local leaf]), or, for one it did not, the local tensor
    through ``to_local`` (differentiable); any other parameter itself."""
    if not is_dtensor(param):
        return param
    local = param._local_tensor  # type: ignore[attr-defined]
    if _OWNER not in local.__dict__:
        return param.to_local()  # type: ignore[attr-defined]
    if local.requires_grad != param.requires_grad:  # frozen, or thawed, since
        local.requires_grad_(param.requires_grad)
    return local


_OWNER = "_osdp_replica_of"
"""The attribute of a replicated parameter's local leaf that names the parameter whose
gradient it makes: (a weak reference to its module, its name there)."""


def read_locally(param: torch.Tensor, module: nn.Module, name: str) -> None:
    """Make the local tensor of ``param``, the ``Replicate()`` DTensor parameter ``name`` of
    ``module``, the leaf of autograd the graph reads (:func:`local_param`), whose gradient
    becomes ``param``'s ([Note: a replicated parameter's local leaf]). Again after a
    conversion gave the parameter a new local tensor; nothing when done already."""
    local = param._local_tensor  # type: ignore[attr-defined]
    if _OWNER in local.__dict__:
        return
    # the module, weakly, and the name, not the parameter: the local tensor is the
    # parameter's (no cycle), and a parameter with a weak reference cannot be converted in
    # place (``torch.utils.swap_tensors``, which ``module.to()`` uses for DTensors)
    owner = (weakref.ref(module), name)
    if local.is_floating_point() or local.is_complex():  # (others never need a gradient)
        # the hook, also on a frozen parameter's leaf: it runs once one is thawed
        local.requires_grad_(True)
        local.register_post_accumulate_grad_hook(functools.partial(_hand_grad, owner))
        local.requires_grad_(param.requires_grad)
    local.__dict__[_OWNER] = owner


def _hand_grad(owner: tuple[weakref.ref, str], local: torch.Tensor) -> None:
    """[Note: a replicated parameter's local leaf] The gradient autograd accumulated into
    ``local`` becomes its parameter's: ``p.grad``, a DTensor of ``p``'s spec over it, or added
    to the one there; then ``p``'s own post-accumulate-grad hooks run (the runtime's reducer,
    the user's), as autograd runs them for a parameter it accumulates into.

    Reading a replicated DTensor parameter through ``to_local`` (or any differentiable
    function of it) makes its gradient a DTensor inside autograd, which accumulates it through
    DTensor's dispatch (``detach``, ``add``): each costs a parameter tens of microseconds of
    Python in every step. The graph reads the local tensor itself, a leaf: autograd
    accumulates a plain tensor, and the DTensor is made once, from the parameter's spec."""
    grad, local.grad = local.grad, None
    module = owner[0]()
    param = None if module is None else module._parameters.get(owner[1])
    if param is None or grad is None:
        return
    if param.grad is None:
        param.grad = _dtensor_type()(grad, param._spec,  # type: ignore[attr-defined]
                                     requires_grad=False)
    else:
        local_of(param.grad).add_(grad)
    for hook in (param._post_accumulate_grad_hooks or {}).values():  # type: ignore[attr-defined]
        hook(param)


def like(param: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``flat`` (a padded flat chunk laid out like ``param``'s) as ``param`` holds it: a DTensor
    of the same placement viewing it, or the flat chunk itself viewed at ``param``'s shape."""
    if not is_dtensor(param):
        return shaped(flat, param.shape)
    from torch.distributed.tensor import DTensor

    local = local_of(param)
    view = shaped(flat, local.shape)
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


class SplitGrads:
    """Where the parts of one split weight lie in the parameter the user sees, and its
    gradient ([Note: split parameters]).

    ``param`` is that parameter; part ``i`` holds ``numels[i]`` elements of its local tensor
    from ``offsets[i]`` (``flat``), or, where the local tensor is the whole weight (not
    ``flat``), the slice ``[starts[i], starts[i] + sizes[i])`` along ``dim``. A part's view of
    a tensor laid out like the parameter is the part's own layout: a sharded part's padded flat
    chunk (1-D), a replicated part's tensor of its shape.

    The gradient: a replicated part's is accumulated by autograd into its view of it
    (:meth:`prepare`, which allocates it); a sharded part's reduced chunk is added into its
    view (:meth:`add`), or, while the parameter has no gradient yet, held until it gets one
    (a replicated part's accumulation) or until backward ends (:meth:`join`, one weight after
    another): so the gradient is allocated as late as its first replicated part, or once every
    sharded part is reduced, and a split weight's sharded parts hold no more than their
    shards meanwhile, as separate parameters did."""

    def __init__(self, param: nn.Parameter, *, flat: bool, dim: int,
                 shapes: Sequence[tuple[int, ...]], numels: Sequence[int],
                 sharded: Sequence[bool]) -> None:
        self.param = param
        self.flat, self.dim = flat, dim
        self.shapes, self.numels, self.sharded = tuple(shapes), tuple(numels), tuple(sharded)
        self.offsets = tuple(sum(numels[:i]) for i in range(len(numels)))
        self.starts = tuple(sum(s[dim] for s in shapes[:i]) for i in range(len(shapes)))
        self.held: dict[int, torch.Tensor] = {}
        """Sharded parts' reduced chunks waiting for the parameter's gradient."""

    def view(self, t: torch.Tensor, index: int) -> torch.Tensor:
        """Part ``index``'s view of ``t`` (laid out like the parameter: a DTensor, or plain)."""
        local = local_of(t)
        if not self.flat:
            return local.narrow(self.dim, self.starts[index], self.shapes[index][self.dim])
        part = local.reshape(-1)[self.offsets[index]:self.offsets[index] + self.numels[index]]
        return part if self.sharded[index] else part.view(self.shapes[index])

    def grad(self, index: int) -> torch.Tensor | None:
        """Part ``index``'s view of the parameter's gradient (None when it has none)."""
        grad = self.param.grad
        return None if grad is None else self.view(grad, index)

    def ensure_grad(self) -> torch.Tensor:
        """The parameter's gradient, allocated (zero, laid out like the parameter) if it has
        none, with the chunks held for it added (and released)."""
        grad = self.param.grad
        if grad is None:
            local = local_of(self.param)
            grad = like(self.param, torch.zeros(local.numel(), dtype=local.dtype,
                                                device=local.device))
            self.param.grad = grad
        held, self.held = self.held, {}
        for index, chunk in held.items():
            self._add(grad, index, chunk)
            _release(chunk)
        return grad

    def prepare(self, part: torch.Tensor, index: int) -> None:
        """Before autograd accumulates part ``index``'s gradient: its ``.grad`` is its view of
        the parameter's gradient (allocated if need be), which autograd adds into in place."""
        part.grad = self.view(self.ensure_grad(), index)

    def add(self, index: int, chunk: torch.Tensor) -> bool:
        """Add a sharded part's reduced gradient ``chunk`` (its layout, a tensor of its own) to
        its view of the gradient; held instead while the parameter has none (True: ``chunk`` is
        kept, not to be released)."""
        if self.param.grad is None:
            if index in self.held:  # a second backward without zero_grad in between
                self.held[index].add_(chunk)
                return False
            self.held[index] = chunk
            return True
        self._add(self.param.grad, index, chunk)
        return False

    def _add(self, grad: torch.Tensor, index: int, chunk: torch.Tensor) -> None:
        view = self.view(grad, index)
        view.add_(chunk[:view.numel()].view_as(view))

    def join(self) -> None:
        """End of backward: the chunks held make the parameter's gradient."""
        if self.held:
            self.ensure_grad()

    def drop(self) -> None:
        """Forget the chunks held (a failed backward)."""
        self.held.clear()


def _release(t: torch.Tensor) -> None:
    """Free the memory of ``t``'s storage now (gloo's worker may still refer to it)."""
    storage = t.untyped_storage()
    storage.resize_(0)
    note_resized(storage)


def split_of(t: torch.Tensor) -> tuple[SplitGrads, int] | None:
    """The split weight ``t`` is a part of, and which (None for any other tensor)."""
    return getattr(t, "_osdp_split", None)


def grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s gradient: for a part of a split weight, its view of the weight's gradient."""
    split = split_of(t)
    return t.grad if split is None else split[0].grad(split[1])


Chunk = tuple[tuple[int, ...], tuple[int, ...], int, int]
"""Where a split weight's part lies (:class:`SplitChunks`): its offsets and sizes in the
weight, and its first element and element count in the flat local tensor."""


class SplitChunks(torch.Tensor):
    """The local tensor of a split weight's DTensor as ``state_dict()`` gives it: the
    parameter's local tensor (the same storage; operations on it are a plain tensor's) that
    also tells ``torch.distributed.checkpoint`` where in the weight each of its parts' rows lie
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, which a
    DTensor asks its local tensor for), so DCP saves and loads each part's rows at their place
    in the weight: a checkpoint written from it loads under any plan, and it loads any."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    _osdp_chunks: tuple[Chunk, ...]
    _osdp_size: torch.Size

    @staticmethod
    def wrap(local: torch.Tensor, chunks: Sequence[Chunk], size: Sequence[int]) -> SplitChunks:
        out = local.as_subclass(SplitChunks)
        out._osdp_chunks = tuple(chunks)
        out._osdp_size = torch.Size(size)
        return out

    def _data(self, chunk: Chunk) -> torch.Tensor:
        _, sizes, start, count = chunk
        return self.as_subclass(torch.Tensor).reshape(-1)[start:start + count].view(sizes)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties.create_from_tensor(self._data(c)),
                size=self._osdp_size))
            for c in self._osdp_chunks for offsets, sizes, _, _ in [c]]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z))
                for o, z, _, _ in self._osdp_chunks]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for chunk in self._osdp_chunks:
            if torch.Size(chunk[0]) == index.offset:
                return self._data(chunk)
        raise ValueError(f"no part of this split weight lies at {tuple(index.offset)} "
                         f"({index.fqn})")


def is_split_chunks(t: torch.Tensor) -> bool:
    return isinstance(t, SplitChunks)


def split_signature(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What a :class:`SplitChunks` holds where (None for any other tensor)."""
    if not isinstance(t, SplitChunks):
        return None
    return (tuple(t._osdp_size), tuple((o, z) for o, z, _, _ in t._osdp_chunks))

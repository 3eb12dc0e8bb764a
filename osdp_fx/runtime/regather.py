"""Gathers of sharded parameters, and their re-gathers in backward.

:class:`StepContext` (entered by ``OSDPModule.forward`` through ``params.module_scope``)
installs saved-tensor hooks: when autograd wants to save a gathered full_shard parameter (or a
view of it, such as ``W.t()``) it keeps a small :class:`Handle` instead, and backward
re-gathers the parameter when it needs it (with the other saved members of its forward gather
bucket, in one all-gather), starting the re-gathers it will need next as it does. So no
gathered full_shard weight stays alive between forward and backward. The helpers here gather a
parameter (:func:`gather_full`) or a bucket (:func:`start_params`, :func:`split_gathered`).

[Note: region gathers]
A recomputed region (``runtime/recompute.py``) saves no activation of its own, only what
``torch.utils.checkpoint`` keeps to run it again: among that, the gathered parameters its
operators read, each packed as a :class:`Handle`. Forward runs the region inside
:meth:`StepContext.region`, which records the parameters packed there as one group. When
backward recomputes the region, the first of them it unpacks starts the re-gather of every
member of the group at once (``unpack``: ``self._groups``), so the recomputation waits for one
round of all-gathers rather than one per parameter. Those members are also left out of the
prefetch that unpacking starts for the parameters saved before: a region's gathers start when
the region is recomputed, not earlier, so at most one region's parameters are gathered ahead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .collectives import Pending
from .hierarchy import gather_shards_start, shard_chunks
from .memory import note_resized, storage_key
from .sharded import flat_shard, padded_numel, shaped


@dataclasses.dataclass(eq=False)
class Gathered:
    shard: torch.Tensor
    shape: tuple[int, ...]
    group: str
    dtype: torch.dtype | None = None
    bucket: tuple[torch.Tensor, ...] | None = None
    """The shards of the forward all-gather it rode in, when several: re-gathered together
    (the shards, not their ``Gathered``, which would make a reference cycle)."""


class Regather:
    """One all-gather of backward: a parameter, or the saved members of one bucket."""

    def __init__(self, unit: list[Gathered]) -> None:
        self.unit = unit
        g = unit[0]
        self.pending = (gather_shards_start(cast(flat_shard(g.shard).detach(), g.dtype), g.group)
                        if len(unit) == 1 else
                        start_params(tuple(m.shard for m in unit), g.group, g.dtype))

    def wait(self) -> list[torch.Tensor]:
        with torch.no_grad():
            if len(self.unit) == 1:
                g = self.unit[0]
                return [gather_full(g.shard, g.shape, g.group, self.pending)]
            g = self.unit[0]
            return list(split_gathered(self.pending.wait(), shard_chunks(g.group),
                                        tuple(m.shard for m in self.unit),
                                        tuple(m.shape for m in self.unit)))


@dataclasses.dataclass(frozen=True)
class Handle:
    """What autograd keeps instead of a view of a gathered parameter."""

    gathered: Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class StepContext:
    """Tracks this forward's gathered full_shard parameters and re-gathers them in backward.

    Backward needs the saved parameters in about the reverse of the order forward saved them,
    so when it unpacks one it starts gathering the one saved before it (``prefetch`` of them)
    asynchronously, to overlap that all-gather with this operator's backward. Parameters that
    forward gathered in one bucket are re-gathered in one all-gather too (those of its members
    that autograd saved): the first unpacked gets the whole bucket, the rest are kept until
    backward asks for them, as FSDP2 unshards a module's parameters at once.
    """

    def __init__(self, prefetch: int = 1) -> None:
        self.prefetch = prefetch
        # storage key -> (the gathered tensor, weakly, and what it was gathered from)
        self._live: dict[int, tuple[weakref.ref[torch.Tensor], Gathered]] = {}
        self._regathered: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )
        self._saved: list[Gathered] = []  # in the order forward first saved them
        self._index: dict[int, int] = {}
        self._started: set[int] = set()  # gathers started in backward (never twice per step)
        self._pending: dict[int, Regather] = {}
        self._ready: dict[int, torch.Tensor] = {}  # re-gathered with a bucket, not asked yet
        # shard id -> the parameters a recomputed region saved with it ([Note: region gathers])
        self._groups: dict[int, list[Gathered]] = {}
        self._group: list[Gathered] | None = None

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Group the parameters saved inside: re-gathered together in backward."""
        self._group = group = []
        try:
            yield
        finally:
            self._group = None
        for g in group:
            self._groups[id(g.shard)] = group

    def track(self, full: torch.Tensor, gathered: Gathered) -> None:
        self._live[storage_key(full)] = (weakref.ref(full), gathered)

    def release(self, full: torch.Tensor) -> bool:
        return self._live.pop(storage_key(full), None) is not None

    def pack(self, t: torch.Tensor) -> Any:
        entry = self._live.get(storage_key(t)) if t.device.type != "meta" else None
        if entry is None:
            # Kept as is, an output its own operator saves would hold that operator's graph
            # node in a reference cycle through C++ that only backward breaks: forwards without
            # a backward would never free their activations.
            return t.detach() if t.grad_fn is not None else t
        tracked, gathered = entry
        if tracked() is None:  # a gathered tensor that died unfreed: its storage key is reused
            del self._live[storage_key(t)]
            return t.detach() if t.grad_fn is not None else t
        if id(gathered.shard) not in self._index:
            self._index[id(gathered.shard)] = len(self._saved)
            self._saved.append(gathered)
        if self._group is not None:
            self._group.append(gathered)
        return Handle(gathered, tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, Handle):
            return packed
        g = packed.gathered
        key = id(g.shard)
        full = self._regathered.get(key)
        if full is None:
            self._start(g)
            for member in self._groups.get(key, ()):
                self._start(member)
            full = self._take(g)
            self._regathered[key] = full
            # the re-gathers (parameters or buckets) saved just before this one: prefetched,
            # but for a recomputed region's, which start when it is recomputed
            units = [id(g.bucket or g)]
            for index in range(self._index[key] - 1, -1, -1):
                earlier = self._saved[index]
                if id(earlier.shard) in self._groups:
                    continue
                if id(earlier.bucket or earlier) not in units:
                    if len(units) > self.prefetch:
                        break
                    units.append(id(earlier.bucket or earlier))
                    self._start(earlier)
        return full.as_strided(packed.size, packed.stride, packed.offset)

    def _start(self, g: Gathered) -> None:
        """Start re-gathering ``g`` and the saved members of its bucket not started yet (once
        per step)."""
        if id(g.shard) in self._started:
            return
        unit = [g if shard is g.shard else self._saved[self._index[id(shard)]]
                for shard in g.bucket or (g.shard,)
                if shard is g.shard or (id(shard) in self._index
                                        and id(shard) not in self._started)]
        job = Regather(unit)
        for m in unit:
            self._started.add(id(m.shard))
            self._pending[id(m.shard)] = job

    def _take(self, g: Gathered) -> torch.Tensor:
        """``g`` re-gathered: by the all-gather started for it (waited for; its bucket's other
        members are kept until backward asks for them), or by a new one."""
        key = id(g.shard)
        if key in self._ready:
            return self._ready.pop(key)
        job = self._pending.pop(key, None)
        if job is None:  # asked again after its first re-gather died: alone
            job = Regather([g])
        for m, full in zip(job.unit, job.wait()):
            if m is g:
                mine = full
            else:
                self._pending.pop(id(m.shard), None)
                self._ready[id(m.shard)] = full
        return mine


def cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def gather_full(shard: torch.Tensor, shape: tuple[int, ...], group: str,
                 pending: Pending | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    flat = (pending or gather_shards_start(cast(flat_shard(shard), dtype), group)).wait()
    return shaped(flat, shape)


def split_gathered(flat: torch.Tensor, world: int, shards: tuple[torch.Tensor, ...],
                   shapes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, ...]:
    """The full parameters from a gather of every rank's concatenated ``shards``: row r of
    ``flat.view(world, total)`` is rank r's concatenation; each parameter is a column block.
    Each result owns its storage (so one can be freed without the others), copied out of
    ``flat`` by one ``split_with_sizes_copy``; ``flat`` is freed."""
    table = flat.view(world, -1)
    as_bytes = _packed(shards, flat.dtype)
    sizes = [padded_numel(s) * (s.element_size() if as_bytes else 1) for s in shards]
    blocks = [torch.empty(world * n, dtype=flat.dtype, device=flat.device) for n in sizes]
    torch.split_with_sizes_copy(table, sizes, dim=1,
                                out=[b.view(world, n) for b, n in zip(blocks, sizes)])
    if as_bytes:  # each block is its own allocation, aligned for its dtype
        blocks = [b.view(s.dtype) for b, s in zip(blocks, shards)]
    fulls = tuple(shaped(block, shape) for block, shape in zip(blocks, shapes))
    # Every member is a copy now; gloo's worker may hold the gathered buffer a few milliseconds
    # longer: release its memory at once.
    storage = flat.untyped_storage()
    storage.resize_(0)
    note_resized(storage)
    return fulls


def _packed(shards: tuple[torch.Tensor, ...], dtype: torch.dtype | None) -> bool:
    """Whether a bucket is gathered as bytes: its shards, gathered uncast, differ in dtype (the
    tensors of a quantized weight, ``passes/shard.py``)."""
    return dtype in (None, torch.uint8) and len({s.dtype for s in shards}) > 1


def start_params(shards: tuple[torch.Tensor, ...], group: str,
                 dtype: torch.dtype | None) -> Pending:
    """Start gathering a bucket: its shards copied into one flat buffer of ``dtype`` (default:
    theirs) by one foreach copy, which casts as it copies; shards of several dtypes gathered
    uncast are copied as bytes into a byte buffer (:func:`split_gathered` views them back)."""
    with torch.no_grad():
        flats = [flat_shard(s) for s in shards]
        if dtype is None and _packed(shards, dtype):
            flats, dtype = [f.view(torch.uint8) for f in flats], torch.uint8
        elif dtype is None:
            dtype = flats[0].dtype
        buffer = torch.empty(sum(f.numel() for f in flats), dtype=dtype, device=flats[0].device)
        torch._foreach_copy_(list(buffer.split([f.numel() for f in flats])), flats)
    return gather_shards_start(buffer, group, consume=True)

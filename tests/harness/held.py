"""What a rank holds of a compiled module's parameter, measured by storage: a sharded
parameter (a DTensor) is backed by its padded flat shard, a replicated one by its own tensor."""

from __future__ import annotations

import torch

from osdp_fx.runtime.storage_tracker import dense_tensors


def held_numel(p: torch.Tensor) -> int:
    """Elements of the storage behind ``p`` on this rank (a shard's padding included)."""
    return sum(d.untyped_storage().nbytes() // d.element_size() for d in dense_tensors(p))


def held_bytes(p: torch.Tensor) -> int:
    return sum(d.untyped_storage().nbytes() for d in dense_tensors(p))


def storage_ptr(p: torch.Tensor) -> int:
    """Data pointer of the storage behind ``p`` (what a collective reading its shard sees)."""
    return dense_tensors(p)[0].untyped_storage().data_ptr()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local tensor (its rows), or ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t

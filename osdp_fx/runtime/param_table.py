"""One table of this rank's parameters: names, aliases, splits, strategies, shard layouts, and the
conversions between full tensors and what this rank holds.

Built once by ``compile_osdp`` (:class:`ParamTable`). The compiled module's state dicts
(``full_state_dict``, ``load_full_state_dict``), meta-device materialisation
(``training/materialize.py``) and checkpoints (``training/checkpoint.py``) all read it, instead of each rebuilding
shard layouts from the plan and the capture.

Names: a *key* is a name of ``model.state_dict()`` (a parameter, an alias of a tied one, or a
buffer); a *group* is a parameter's canonical name (tied names map to one); a *part* is a
parameter group of the plan: the group itself, or one of the parts it was split into
(``passes/split_linear.py``), each with its own strategy and shards.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import fx, nn

from ..core.layout import ShardLayout, SplitSpec, shard_layout
from ..core.strategies import traits
from ..plan.plan import Plan
from .params import make_shard
from .regather import gather_full
from .sharded import (
    as_dtensor,
    as_replicated,
    flat_shard,
    is_dtensor,
    like,
    local_of,
    whole_rows,
)


@dataclasses.dataclass(frozen=True)
class ParamEntry:
    """One parameter group of the plan, as this rank holds it."""

    name: str
    """The part's name (a canonical parameter name, or ``<weight>_part<i>``)."""
    strategy: str
    """Its strategy."""
    shape: tuple[int, ...]
    """Shape of the full part."""
    layout: ShardLayout
    """Which flat chunk this rank holds, over which group."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def sharded(self) -> bool:
        """Whether this rank holds a padded chunk of rows (else the full tensor)."""
        return traits(self.strategy).sharded


class ParamTable:
    """This rank's parameters of one compiled model (module docstring)."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, *, state_keys: tuple[str, ...],
                 alias_to_name: dict[str, str], splits: dict[str, SplitSpec], rank: int) -> None:
        self.gm = gm
        self.plan = plan
        self.state_keys = tuple(state_keys)
        """Keys of the original ``model.state_dict()``, in order."""
        self.alias_to_name = dict(alias_to_name)
        """Every parameter name (tied ones too) to its group's canonical name."""
        self.splits = dict(splits)
        """Split groups by canonical name."""
        self.rank = rank
        self.entries = {
            p.name: ParamEntry(p.name, p.strategy, tuple(p.shape), shard_layout(
                p.strategy, world_size=plan.world_size, ranks_per_node=plan.ranks_per_node,
                rank=rank))
            for p in plan.params
        }
        """Every part of the plan by name."""

    # ---- names ----------------------------------------------------------------------------
    @property
    def groups(self) -> list[str]:
        """Canonical parameter names, in the model's order."""
        return list(dict.fromkeys(self.alias_to_name.values()))

    @property
    def buffer_keys(self) -> list[str]:
        return [k for k in self.state_keys if k not in self.alias_to_name]

    def parts(self, group: str) -> tuple[str, ...]:
        """The plan's parameter groups that make up ``group``: its parts, or itself."""
        split = self.splits.get(group)
        return split.parts if split is not None else (group,)

    def full_shape(self, group: str) -> tuple[int, ...]:
        """Shape of a group as the model defines it (a split one before splitting)."""
        split = self.splits.get(group)
        if split is None:
            return self.entries[group].shape
        shape = list(self.entries[split.parts[0]].shape)
        shape[split.dim] = sum(split.sizes)
        return tuple(shape)

    # ---- tensors --------------------------------------------------------------------------
    def present(self) -> None:
        """Make each sharded part's parameter a DTensor of the part's shape over its padded
        flat shard, and, where the plan shards any, each replicated one a ``Replicate()``
        DTensor over its tensor (``runtime/sharded.py``), as ``compile_osdp`` hands them to the
        user: the sharding pass and meta-device materialisation leave plain tensors."""
        replicas = (any(e.sharded for e in self.entries.values()) and dist.is_available()
                    and dist.is_initialized())
        for part, entry in self.entries.items():
            param = self.local(part)
            if is_dtensor(param) or not entry.shape:
                continue
            if entry.sharded:
                present = as_dtensor(
                    param, entry.shape, entry.strategy, world_size=self.plan.world_size,
                    ranks_per_node=self.plan.ranks_per_node, rank=self.rank)
            elif replicas:
                present = as_replicated(param, world_size=self.plan.world_size)
            else:
                continue
            owner, _, leaf = part.rpartition(".")
            self.gm.get_submodule(owner)._parameters[leaf] = present

    def local(self, part: str) -> nn.Parameter:
        """What this rank holds of ``part``: a DTensor over its padded flat shard (a flat shard
        before :meth:`present`), or the full tensor."""
        return self.gm.get_parameter(part)

    def buffer(self, key: str) -> torch.Tensor:
        return self.gm.get_buffer(key)

    def pieces(self, group: str, full: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(part, its full tensor) for a full tensor of ``group``, cut along its split."""
        split = self.splits.get(group)
        if split is None:
            yield group, full
            return
        yield from zip(split.parts, full.split(split.sizes, split.dim))

    def flat_share(self, part: str, full: torch.Tensor) -> nn.Parameter:
        """This rank's padded flat shard of a full tensor of the sharded ``part``: a new leaf
        parameter."""
        entry = self.entries[part]
        return make_shard(full, world_size=entry.layout.chunks, rank=entry.layout.index)

    def to_local(self, part: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's share of a full tensor of ``part``, laid out as the part's parameter is:
        when the part is sharded, a DTensor over a new padded flat shard (or a flat shard); else
        ``full`` itself, as a ``Replicate()`` DTensor where the parameter is one."""
        local = self.local(part)
        if not self.entries[part].sharded:
            return like(local, full.reshape(-1)) if is_dtensor(local) else full
        return like(local, self.flat_share(part, full).detach())

    def load(self, part: str, full: torch.Tensor) -> None:
        """Copy a full tensor of ``part`` into this rank's parameter, in place."""
        local = self.local(part)
        with torch.no_grad():
            if self.entries[part].sharded:
                flat_shard(local).copy_(self.flat_share(part, full.to(local.dtype)).reshape(-1))
            else:
                local_of(local).copy_(full)

    def full(self, group: str, *, grad: bool = False) -> torch.Tensor | None:
        """The full tensor of ``group`` (or of its gradient: None when it has none), gathered
        from every rank's shard where sharded. Collective for sharded groups."""
        tensors = {}
        for part in self.parts(group):
            local = self.local(part)
            tensors[part] = local.grad if grad else local
            if tensors[part] is None:
                return None
        return self.full_from(group, tensors)

    def whole(self, group: str) -> torch.Tensor:
        """``group`` as a sharded state dict holds it: the parameter itself (a DTensor when
        sharded, else the full tensor); a split weight, whose parts are separate parameters,
        as a new tensor of the weight's shape: gathered (collective), then a DTensor of this
        rank's ``torch.chunk`` rows over the world when any part is sharded."""
        split = self.splits.get(group)
        if split is None:
            return self.local(group)
        full = self.full(group)
        assert full is not None, group
        if not any(self.entries[p].sharded and is_dtensor(self.local(p)) for p in split.parts):
            return full
        return whole_rows(full, world_size=self.plan.world_size, rank=self.rank)

    def full_from(self, group: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The full tensor of ``group`` from a tensor per part laid out like what this rank
        holds of it (the parameter, its gradient, an optimizer state): gathered where the part
        is sharded (collective), the parts joined along the split. A new tensor."""
        fulls = []
        with torch.no_grad():
            for part in self.parts(group):
                entry = self.entries[part]
                local = (tensors[part] if entry.sharded else local_of(tensors[part])).detach()
                fulls.append(gather_full(local, entry.shape, entry.layout.group).clone()
                             if entry.sharded else local.clone())
        split = self.splits.get(group)
        return fulls[0] if split is None else torch.cat(fulls, split.dim)

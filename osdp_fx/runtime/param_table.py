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

The module registers one parameter per group (:meth:`ParamTable.param`), under the group's name;
a split group's parts are views of its storage that the graph reads, attributes of the module
that are not its parameters ([Note: split parameters] in ``runtime/sharded.py``), made so by
:meth:`ParamTable.present`.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import fx, nn

from ..core.layout import ShardLayout, SplitSpec, shard_layout
from ..core.strategies import traits
from ..plan.plan import Plan
from .hierarchy import checkpoint_mesh
from .local_step import adopt
from .params import make_shard
from .regather import gather_full
from .sharded import (
    Chunk,
    SplitChunks,
    SplitGrads,
    as_dtensor,
    as_replicated,
    flat_shard,
    grad_of,
    is_dtensor,
    like,
    local_of,
    read_locally,
    split_of,
    split_signature,
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
        self._parts: dict[str, nn.Parameter] = {}
        """The parts of split groups once :meth:`present` made each group one parameter."""

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
        """Make each sharded parameter a DTensor of its shape over its padded flat shard, and,
        where the plan shards any, each replicated one a ``Replicate()`` DTensor over its
        tensor (``runtime/sharded.py``), and each split weight one parameter of its shape whose
        storage holds its parts, as ``compile_osdp`` hands them to the user: the sharding pass
        and meta-device materialisation leave plain tensors, a split weight's parts separate
        parameters. Once only."""
        if self._parts:
            return
        replicas = (any(e.sharded for e in self.entries.values()) and dist.is_available()
                    and dist.is_initialized())
        of_split = {part for split in self.splits.values() for part in split.parts}
        for part, entry in self.entries.items():
            if part in of_split:
                continue
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
            module = self.gm.get_submodule(owner)
            module._parameters[leaf] = present
            if not entry.sharded:
                read_locally(present, module, leaf)
        for group, split in self.splits.items():
            self._merge(group, split, replicas)
            signature = self.signature(group)
            if signature is not None:  # what load_state_dict compares (keep_vars=True)
                self.param(group)._osdp_signature = signature  # type: ignore[attr-defined]

    def _merge(self, group: str, split: SplitSpec, replicas: bool) -> None:
        """Make the parts of ``group`` views of one new parameter of the group's shape,
        registered under its name ([Note: split parameters]); the parts stay on their modules
        as attributes the graph reads, no longer parameters."""
        entries = [self.entries[p] for p in split.parts]
        tensors = [self.gm.get_parameter(p).detach() for p in split.parts]
        shape = self.full_shape(group)
        sharded = [e.sharded for e in entries]
        flat = any(e.sharded and e.layout.chunks > 1 for e in entries)
        first = next((e for e in entries if e.sharded), None)
        with torch.no_grad():
            if flat:  # this rank's parts, each in its own layout, one after another
                numels = [t.numel() for t in tensors]
                local = torch.cat([t.reshape(-1) for t in tensors])
                if split.dim == 0 and len(shape) > 1:
                    local = local.view(-1, *shape[1:])
            else:  # every part whole here: the weight itself
                numels = [e.numel for e in entries]
                local = torch.cat([t.reshape(-1)[:e.numel].view(e.shape)
                                   for t, e in zip(tensors, entries)], split.dim)
        requires_grad = self.gm.get_parameter(split.parts[0]).requires_grad
        distributed = dist.is_available() and dist.is_initialized()
        if first is not None and distributed:
            from torch.distributed.tensor import DTensor

            mesh, placements = checkpoint_mesh(
                first.strategy, world_size=self.plan.world_size,
                ranks_per_node=self.plan.ranks_per_node, device_type=local.device.type)
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            param = adopt(nn.Parameter(DTensor.from_local(
                local, mesh, placements, shape=torch.Size(shape), stride=strides,
                run_check=False), requires_grad=requires_grad))
        elif replicas:
            param = as_replicated(nn.Parameter(local, requires_grad=requires_grad),
                                  world_size=self.plan.world_size)
        else:
            param = nn.Parameter(local, requires_grad=requires_grad)
        layout = SplitGrads(param, flat=flat, dim=split.dim, shapes=[e.shape for e in entries],
                            numels=numels, sharded=sharded)
        owner_name, _, leaf = group.rpartition(".")
        owner = self.gm.get_submodule(owner_name)
        for i, part in enumerate(split.parts):
            view = nn.Parameter(layout.view(param, i), requires_grad=requires_grad)
            view._osdp_split = (layout, i)  # type: ignore[attr-defined]
            if requires_grad and not sharded[i]:  # autograd accumulates into the gradient
                view.register_hook(_prepare_hook(layout, view, i))
                view.register_post_accumulate_grad_hook(_release_grad)
            part_owner, _, part_leaf = part.rpartition(".")
            module = self.gm.get_submodule(part_owner)
            del module._parameters[part_leaf]
            module.__dict__[part_leaf] = view  # read by the graph's get_attr, not a parameter
            self._parts[part] = view
        owner._parameters[leaf] = param
        order = {name: i for i, name in enumerate(self.alias_to_name)}
        prefix = f"{owner_name}." if owner_name else ""
        kept = sorted(owner._parameters.items(),
                      key=lambda kv: order.get(prefix + kv[0], len(order)))
        owner._parameters.clear()  # in the model's order, in place (the module shares it)
        owner._parameters.update(kept)

    def repoint(self) -> None:
        """After the module's parameters were converted (``module.to(...)``, ``.double()``):
        each split weight's parts view its parameter's new storage again (the same part
        objects, which the graph, the hooks and the reducer hold); each replicated DTensor's
        new local tensor becomes the graph's leaf (``sharded.read_locally``)."""
        for part, entry in self.entries.items():
            param = None if entry.sharded or part in self._parts else self.gm.get_parameter(part)
            if param is not None and is_dtensor(param):
                owner, _, leaf = part.rpartition(".")
                read_locally(param, self.gm.get_submodule(owner), leaf)
        for group, split in self.splits.items():
            first = self._parts.get(split.parts[0])
            if first is None:
                continue
            layout, param = split_of(first)[0], self.param(group)  # type: ignore[index]
            layout.param = param
            signature = self.signature(group)
            if signature is not None:
                param._osdp_signature = signature  # type: ignore[attr-defined]
            with torch.no_grad():
                for i, part in enumerate(split.parts):
                    view, held = layout.view(param, i), self._parts[part]
                    if (held.dtype, held.device, held.untyped_storage().data_ptr()) != (
                            view.dtype, view.device, view.untyped_storage().data_ptr()):
                        held.data = view.detach()

    def param(self, group: str) -> nn.Parameter:
        """The parameter the module registers for ``group``: a split weight's one parameter,
        or the group's own (:meth:`local`)."""
        return self.gm.get_parameter(group)

    def local(self, part: str) -> nn.Parameter:
        """What this rank holds of ``part``: a DTensor over its padded flat shard (a flat shard
        before :meth:`present`), or the full tensor; a part of a split weight, a view of the
        weight's parameter (its padded flat shard, or its tensor) once presented."""
        view = self._parts.get(part)
        return view if view is not None else self.gm.get_parameter(part)

    def grad(self, part: str) -> torch.Tensor | None:
        """The gradient of ``part``, laid out like :meth:`local`: a split weight's part's view
        of the weight's gradient."""
        return grad_of(self.local(part))

    def chunks(self, group: str) -> list[Chunk] | None:
        """Where this rank's parts of the split ``group`` lie in the weight and in the flat
        local tensor of its parameter, rows without data left out (``SplitChunks``); None
        where that parameter is the whole weight (a DTensor whose placement says it all)."""
        split = self.splits[group]
        layout = split_of(self.local(split.parts[0]))
        if layout is None or not layout[0].flat:
            return None
        grads = layout[0]
        out: list[Chunk] = []
        for i, part in enumerate(split.parts):
            entry, start = self.entries[part], grads.offsets[i]
            at = [0] * len(entry.shape)
            at[split.dim] = grads.starts[i]
            if not entry.sharded:
                out.append((tuple(at), tuple(entry.shape), start, entry.numel))
                continue
            row = math.prod(entry.shape[1:])
            per_rank = grads.numels[i] // row
            rows = max(0, min(per_rank, entry.shape[0] - entry.layout.index * per_rank))
            if rows:
                at[0] += entry.layout.index * per_rank
                out.append((tuple(at), (rows, *entry.shape[1:]), start, rows * row))
        return out

    def checkpointable(self, group: str) -> torch.Tensor:
        """``group``'s parameter, detached, as ``state_dict()`` gives it: a split weight's
        whose parts are laid out one after another as a DTensor whose local tensor is a
        ``SplitChunks`` (the same storage), which ``torch.distributed.checkpoint`` reads."""
        param = self.param(group)
        chunks = self.chunks(group) if group in self.splits else None
        if chunks is None or not is_dtensor(param):
            return param.detach()
        from torch.distributed.tensor import DTensor

        local = SplitChunks.wrap(local_of(param).detach(), chunks, param.shape)
        return DTensor(local, param._spec, requires_grad=False)  # type: ignore[attr-defined]

    def signature(self, group: str) -> tuple[object, ...] | None:
        """What identifies the layout of a split ``group``'s parameter (``split_signature``)."""
        if group not in self.splits:
            return None
        return split_signature(local_of(self.checkpointable(group)))

    def views(self, group: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each part's view of ``t``, a tensor laid out like ``group``'s parameter (its
        gradient, an optimizer state), laid out like the part's :meth:`local`."""
        split = split_of(self.local(self.parts(group)[0])) if group in self.splits else None
        if split is None:
            return {group: t}
        return {part: split[0].view(t, i) for i, part in enumerate(self.parts(group))}

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

    def to_local(self, group: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's share of a full tensor of ``group``, a new tensor laid out as the
        group's parameter is: when sharded, a DTensor over a new padded flat shard (or a flat
        shard); else ``full`` itself, as a ``Replicate()`` DTensor where the parameter is one;
        a split weight's, its parts' shares in its parameter's layout."""
        if group in self.splits:
            return self.join(group, {part: self.to_local(part, piece)
                                     for part, piece in self.pieces(group, full)})
        if group in self._parts:  # a part of a split weight, in the part's layout
            sharded = self.entries[group].sharded
            return self.flat_share(group, full).detach() if sharded else full
        local = self.local(group)
        if not self.entries[group].sharded:
            return like(local, full.reshape(-1)) if is_dtensor(local) else full
        return like(local, self.flat_share(group, full).detach())

    def join(self, group: str, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """A new tensor laid out like the split ``group``'s parameter from one tensor per part
        laid out like the part's :meth:`local` (its dtype the first part's tensor's)."""
        param = self.param(group)
        local = local_of(param)
        dtype = next(iter(tensors.values())).dtype
        out = like(param, torch.zeros(local.numel(), dtype=dtype, device=local.device))
        for part, view in self.views(group, out).items():
            view.copy_(local_of(tensors[part]).reshape(view.shape))
        return out

    def load(self, part: str, full: torch.Tensor) -> None:
        """Copy a full tensor of ``part`` into this rank's parameter, in place."""
        local = self.local(part)
        with torch.no_grad():
            if self.entries[part].sharded:
                share = self.flat_share(part, full.to(local.dtype)).reshape(-1)
                if split_of(local) is not None:  # a view of the split weight's parameter
                    local.copy_(share.view(local.shape))
                else:
                    flat_shard(local).copy_(share)
            else:
                local_of(local).copy_(full)

    def full(self, group: str, *, grad: bool = False) -> torch.Tensor | None:
        """The full tensor of ``group`` (or of its gradient: None when it has none), gathered
        from every rank's shard where sharded. Collective for sharded groups."""
        tensors = {}
        for part in self.parts(group):
            value = self.grad(part) if grad else self.local(part)
            if value is None:
                return None
            tensors[part] = value
        return self.full_from(group, tensors)

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


def _prepare_hook(layout: SplitGrads, part: nn.Parameter,
                  index: int) -> Callable[[torch.Tensor], None]:
    """A replicated part's hook before autograd accumulates its gradient
    (:meth:`SplitGrads.prepare`). It holds the part weakly: the hook lives on the part."""
    ref = weakref.ref(part)

    def prepare(grad: torch.Tensor) -> None:
        part = ref()
        if part is not None:
            layout.prepare(part, index)

    return prepare


def _release_grad(part: torch.Tensor) -> None:
    """After autograd accumulated a part's gradient into its view of the weight's gradient:
    the part lets go of the view."""
    part.grad = None

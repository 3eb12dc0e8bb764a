"""Distributed checkpoints of a compiled model and its optimizer, with torch.distributed.checkpoint.

``save_checkpoint(path, compiled, optimizer)`` writes a DCP checkpoint directory in which every
rank writes only what it holds; ``load_checkpoint(path, compiled, optimizer)`` reads it back into
a model compiled under any plan at any world size.

Layout (one DCP state dict; the keys are strings, nothing is nested):

* ``model.<name>``: each parameter under its name in the model, at its shape in the model,
  whatever its strategy and whatever its splits (as FSDP2's sharded state dicts). A sharded
  parameter is a ``DTensor`` with placement ``Shard(0)`` on a 1-D mesh over the world: rank r's
  local shard minus its zero padding is exactly ``torch.chunk``'s r-th chunk of dim 0 (shards
  are whole rows, ``core/layout.py``; trailing ranks may hold fewer or no rows), so DCP knows
  each rank's offset. Under ``hierarchical`` the mesh lists the ranks in the order of the chunks they hold,
  under ``hybrid_shard`` it is the nodes x ranks mesh with the chunks replicated across nodes
  (``runtime.hierarchy.checkpoint_mesh``). A replicated parameter is a plain tensor (DCP
  writes it once). A weight split into parts (``<w>_part<i>``, ``passes/split_linear.py``) is
  saved whole, in the layout the model defines: its parts are gathered and joined, and rank r
  writes ``torch.chunk``'s r-th chunk of the weight's rows (``Shard(0)`` on the world);
  loading reads the chunk, gathers the weight and cuts it into this model's parts and shards.
  So a checkpoint loads into the model compiled with any splits or none.
* ``model.<buffer>``: buffers of ``model.state_dict()``, unchanged.
* ``optim.<name>.<key>``: optimizer state by parameter name, not index. A state tensor shaped like
  the parameter (AdamW ``exp_avg``, ``exp_avg_sq``; SGD ``momentum_buffer``) is laid out like the
  parameter (a split weight's whole); any other tensor (``step``) is saved as it is (a split
  weight's first part's, which its parts share).
* ``osdp``: bytes (``torch.save``) of a dict: format and version, the world size, each
  parameter's full shape, the splits, the plan, the optimizer's ``param_groups`` with parameter
  names instead of indices, what each state entry is, and the caller's ``extra``.

So a checkpoint depends on neither the strategy of any parameter, nor the splits, nor the world
size, and DCP reshards on load: each rank reads the byte ranges of its own shard. ``plan.json``
beside the DCP files is the saved plan. Versions 1 and 2 saved every tensor flat (1-D):
they load as well (each weight read whole, gathered and cut, as a split one). Version 1
(osdp-fx 0.1) saved split weights under their parts' names: such a checkpoint loads into a
model with the same splits, and is refused, with the way to convert it, into others.

``torch.distributed.checkpoint.state_dict.get_state_dict`` is not used: it takes the local
tensors of plain parameters as the full ones (it only knows FSDP's and DTensor parameters), so
every rank would present a different shard under the same key with no offsets, and DCP would
keep one of them.

Saving is atomic: DCP writes into ``<path>.saving``; only when every rank reports success does
rank 0 move it to ``path`` (the previous checkpoint is moved aside and deleted after). A save that
fails on any rank raises on every rank, removes the temporary directory and leaves the previous
checkpoint as it was.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..core.layout import row_numel, shard_numel
from ..core.strategies import traits
from ..errors import CheckpointError, InputError, OSDPError
from ..module import OSDPModule
from ..runtime.collectives import (
    WORLD,
    every_rank,
    group_rank,
    group_size,
    lost_peer,
)
from ..runtime.hierarchy import checkpoint_mesh
from ..runtime.param_table import ParamTable
from ..runtime.regather import gather_full
from ..runtime.sharded import is_dtensor, local_of

FORMAT = "osdp-fx-checkpoint"
VERSION = 3
"""3: tensors at their shapes in the model; 2: flat, a split weight saved whole under its own
name; 1: flat, a split weight under its parts' names."""
_INFO_KEY = "osdp"
_PLAN_FILE = "plan.json"
_SAVING_SUFFIX = ".saving"
_OLD_SUFFIX = ".old"


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where one parameter group's elements live on this rank."""

    local: torch.Tensor
    """The parameter as the compiled model holds it (a padded flat shard, or the full tensor)."""
    shape: tuple[int, ...]
    """Shape of the full parameter as saved (flat ``(numel,)`` in versions 1 and 2)."""
    sharded: bool
    """Whether ``local`` is this rank's flat shard (else it is the full, replicated tensor)."""
    strategy: str = ""
    """The parameter's strategy."""
    index: int = 0
    """Which flat chunk of the parameter ``local`` is (``layout.shard_layout``)."""
    ranks_per_node: int | None = None
    """The plan's ranks per node."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """A zero tensor of ``dtype`` laid out like ``local`` (a DTensor like the parameter)."""
        return torch.zeros_like(self.local, dtype=dtype).detach()

    def valid(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (laid out like the parameter) as the rows this rank owns, a view."""
        if is_dtensor(local):
            return local_of(local).detach()
        if not self.sharded:
            return local.detach().reshape(self.shape)
        flat, n = local.detach().reshape(-1), local.numel()
        start = min(self.index * n, self.numel)
        count = min(n, self.numel - start)
        return flat[:count].view(count // row_numel(self.shape), *self.shape[1:])

    def wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` as the global tensor DCP sees: a Shard(0) DTensor, or plain."""
        if is_dtensor(local):  # a parameter, or a gradient or state laid out like one
            return local.detach()
        if not self.sharded:
            return self.valid(local)
        from torch.distributed.tensor import DTensor, Shard

        mesh, placements = _mesh(local.device.type), [Shard(0)]
        if traits(self.strategy).needs_mesh:
            mesh, placements = checkpoint_mesh(
                self.strategy, world_size=group_size(WORLD), ranks_per_node=self.ranks_per_node,
                device_type=local.device.type)
        return DTensor.from_local(self.valid(local), mesh, placements, shape=self.shape,
                                  stride=_contiguous_strides(self.shape), run_check=False)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def _mesh(device_type: str) -> Any:
    """A 1-D DeviceMesh over the default process group. Made for each call (it wraps the group,
    with no collective): a mesh kept in a module-level cache would keep the group alive after
    ``destroy_process_group``, to be destroyed during the interpreter's shutdown, where gloo's
    worker threads can no longer take the GIL."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def _layouts(compiled: OSDPModule) -> dict[str, _Layout]:
    table = compiled.param_table
    return {name: _Layout(local=table.local(name), shape=_saved_shape(e.shape),
                          sharded=e.layout.chunks > 1,
                          strategy=e.strategy, index=e.layout.index,
                          ranks_per_node=compiled.plan.ranks_per_node)
            for name, e in table.entries.items()}


def _buffer_keys(compiled: OSDPModule) -> list[str]:
    return compiled.param_table.buffer_keys


def _units(compiled: OSDPModule, *, by_weight: bool) -> dict[str, tuple[str, ...]]:
    """What a checkpoint stores, each under its key name, with the parts of the compiled model
    that make it up: every weight of the model whole (``by_weight``, version 2), or every part
    (version 1)."""
    table = compiled.param_table
    if not by_weight:
        return {part: (part,) for part in table.entries}
    return {group: table.parts(group) for group in table.groups}


def _trainable(compiled: OSDPModule,
               units: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """The ``units`` that require grad (a LoRA model's adapters)."""
    table = compiled.param_table
    return {u: parts for u, parts in units.items() if table.local(parts[0]).requires_grad}


def _saved_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a tensor of ``shape`` is saved at: its own (a 0-d one as ``(1,)``, to be
    sharded on dim 0)."""
    return tuple(shape) or (1,)


def _whole_layout(shape: tuple[int, ...], like: torch.Tensor) -> _Layout:
    """Where this rank's elements of a weight saved whole at ``shape`` live: ``torch.chunk``'s
    chunk of its rows over the world (``local``: a zeroed padded chunk to fill)."""
    world, numel = group_size(WORLD), math.prod(shape)
    chunk = shard_numel(numel, world, row_numel(shape))
    return _Layout(local=local_of(like).new_zeros(chunk if world > 1 else numel),
                   shape=tuple(shape),
                   sharded=world > 1, strategy="full_shard", index=group_rank(WORLD))


def _to_save(compiled: OSDPModule, layouts: dict[str, _Layout], unit: str,
             parts: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """What DCP writes of ``unit`` from ``tensors`` (one per part, laid out like the part):
    a part as it is laid out, or a split weight's flat whole (gathered, collective)."""
    if parts == (unit,):
        return layouts[unit].wrap(tensors[unit])
    whole = compiled.param_table.full_from(unit, tensors)
    lay = _whole_layout(_saved_shape(whole.shape), whole)
    n, whole = lay.local.numel(), whole.reshape(-1)
    mine = whole[lay.index * n:(lay.index + 1) * n]
    lay.local[:mine.numel()] = mine
    return lay.wrap(lay.local)


def _param_names(compiled: OSDPModule, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each of the optimizer's param groups (raises on a stranger)."""
    names = {id(p): n for n, p in compiled.named_parameters()}
    groups = []
    for i, group in enumerate(optimizer.param_groups):
        strangers = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if strangers:
            raise InputError(
                f"the optimizer's param group {i} holds {len(strangers)} tensors that are not "
                f"parameters of the compiled model (shapes {strangers[:3]}); build the optimizer "
                "from compiled.parameters() after compile_osdp, not from the original model"
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def _unit_names(compiled: OSDPModule, optimizer: torch.optim.Optimizer,
                units: dict[str, tuple[str, ...]]) -> list[list[str]]:
    """The units of each of the optimizer's param groups (a split weight is one parameter of
    the module: its unit, or, in a version 1 checkpoint, its parts' units)."""
    of_group = _units_of_groups(compiled, units)
    # (a trainable_only checkpoint's units leave out the frozen parameters, which an optimizer
    # may hold but never updates)
    return [[u for n in names for u in of_group.get(n, ())]
            for names in _param_names(compiled, optimizer)]


def _units_of_groups(compiled: OSDPModule,
                     units: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """Each parameter (group) of the module and the units that hold it: itself, or (version
    1) a split weight's parts."""
    table = compiled.param_table
    out: dict[str, tuple[str, ...]] = {}
    for group in table.groups:
        if group in units:
            out[group] = (group,)
        else:  # a version 1 checkpoint's parts (or nothing: a frozen one, trainable_only)
            out[group] = tuple(p for p in table.parts(group) if p in units and p != group)
    return out


def _agree(error: str | None, what: str, *, cleanup: Any = None) -> None:
    """Raise CheckpointError on every rank when ``error`` is set on any rank (collective).
    Before it raises, rank 0 runs ``cleanup`` and the others wait for it."""
    distributed = dist.is_available() and dist.is_initialized() and group_size(WORLD) > 1
    everyone = [error]
    if distributed:
        everyone = [None] * group_size(WORLD)
        dist.all_gather_object(everyone, error)
    failed = {r: e for r, e in enumerate(everyone) if e is not None}
    if not failed:
        return
    if cleanup is not None:
        if group_rank(WORLD) == 0:
            cleanup()
        if distributed:
            dist.barrier()
    lines = "\n".join(f"  rank {r}: {e}" for r, e in failed.items())
    raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}:\n{lines}")


_FIX = ("Call save_checkpoint and load_checkpoint on every rank, with the same path; where one "
        "rank alone needs the state, use compiled.state_dict(), which is local.")


def _attempt(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """(fn's result, None), or (None, the error) when it raises; OSDPError messages verbatim.
    A collective of ``fn`` that the other ranks never joined raises at once (agreeing on the
    error would wait for them as long again): ``every_rank`` around the call makes it a
    CollectiveError."""
    try:
        return fn(*args, **kwargs), None
    except OSDPError as exc:
        return None, str(exc)
    except (Exception, CheckpointException) as exc:
        if lost_peer(exc):
            raise
        return None, _first_line(exc)


def _first_line(exc: BaseException) -> str:
    """One line for an error; for DCP's CheckpointException, the error of each failed rank."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and failures:
        return "; ".join(f"rank {r}: {_first_line(e[0] if isinstance(e, tuple) else e)}"
                         for r, e in failures.items())
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ---- saving ---------------------------------------------------------------------------------

def save_checkpoint(path: str | os.PathLike[str], compiled: OSDPModule,
                    optimizer: torch.optim.Optimizer | None = None, *, extra: Any = None,
                    trainable_only: bool = False) -> None:
    """Save the model's shards and buffers (and the optimizer's state) as a DCP checkpoint.

    Args:
        path: the checkpoint directory; replaced only when every rank has written its part.
        compiled: the module ``compile_osdp`` returned.
        optimizer: an optimizer over ``compiled.parameters()``, or None.
        extra: any picklable object (epoch, data loader position, RNG states), the same on
            every rank; ``load_checkpoint`` returns it.
        trainable_only: save the parameters that require grad alone (a LoRA model's adapters,
            as peft's ``save_pretrained`` does) and their optimizer state, no buffers;
            ``load_checkpoint`` then loads them and leaves the others as they are.

    Collective: every rank must call it. Raises CheckpointError on every rank when any rank
    fails; the previous checkpoint at ``path`` is then left unchanged. Called on some ranks
    only, it raises CollectiveError on those within the process group's timeout.
    """
    path = os.fspath(path)
    if not isinstance(compiled, OSDPModule):
        raise InputError(f"save_checkpoint needs the module compile_osdp returned, got "
                         f"{type(compiled).__name__}")
    with every_rank("save_checkpoint()", _FIX):
        _save(path, compiled, optimizer, extra, trainable_only)


def _save(path: str, compiled: OSDPModule, optimizer: torch.optim.Optimizer | None,
          extra: Any, trainable_only: bool) -> None:
    state, error = _attempt(_state_to_save, path, compiled, optimizer, extra, trainable_only)
    _agree(error, f"save_checkpoint({path!r})")
    saving = path.rstrip(os.sep) + _SAVING_SUFFIX
    rank = group_rank(WORLD)
    error = None
    if rank == 0:
        _, error = _attempt(_fresh_dir, saving, compiled)
    _agree(error, f"save_checkpoint({path!r}): creating {saving}")
    _, error = _attempt(dcp.save, state, checkpoint_id=saving)
    _agree(error, f"save_checkpoint({path!r}) (the previous checkpoint is unchanged)",
           cleanup=lambda: shutil.rmtree(saving, ignore_errors=True))
    error = None
    if rank == 0:
        _, error = _attempt(_replace_dir, saving, path)
    _agree(error, f"save_checkpoint({path!r}): moving {saving} to {path}")


def _state_to_save(path: str, compiled: OSDPModule, optimizer: torch.optim.Optimizer | None,
                   extra: Any, trainable_only: bool) -> dict[str, Any]:
    if os.path.exists(path) and not os.path.exists(os.path.join(path, ".metadata")) and (
            not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"{path!r} exists and is not a checkpoint, so save_checkpoint "
                              "would replace it; choose a new path or an earlier checkpoint's")
    table = compiled.param_table
    layouts = _layouts(compiled)
    units = _units(compiled, by_weight=True)
    if trainable_only:
        units = _trainable(compiled, units)
    state: dict[str, Any] = {
        f"model.{unit}": _to_save(compiled, layouts, unit, parts,
                                  {part: table.local(part) for part in parts})
        for unit, parts in units.items()}
    buffer_keys = [] if trainable_only else _buffer_keys(compiled)
    for key in buffer_keys:
        state[f"model.{key}"] = table.buffer(key).detach()
    optim_info = None
    if optimizer is not None:
        groups = _unit_names(compiled, optimizer, units)
        entries: dict[str, dict[str, Any]] = {}
        for unit in (u for names in groups for u in names):
            parts = units[unit]
            param = table.param(unit)
            entries[unit] = {}
            for key, value in optimizer.state.get(param, {}).items():
                if not isinstance(value, torch.Tensor):
                    entries[unit][key] = ("value", value)
                elif value.shape == param.shape and value.dim() > 0:
                    entries[unit][key] = ("like_param", None)
                    state[f"optim.{unit}.{key}"] = _to_save(compiled, layouts, unit, parts,
                                                            table.views(unit, value))
                else:
                    entries[unit][key] = ("tensor", None)
                    state[f"optim.{unit}.{key}"] = value.detach()
        optim_info = {
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": names}
                             for names, g in zip(groups, optimizer.param_groups)],
            "state": entries,
        }
    info = {
        "format": FORMAT, "version": VERSION, "world_size": group_size(WORLD),
        "params": {unit: table.full_shape(unit) for unit in units},
        "buffers": {k: tuple(state[f"model.{k}"].shape) for k in buffer_keys},
        "trainable_only": trainable_only,
        "splits": {name: len(s.parts) for name, s in table.splits.items()},
        "plan": compiled.plan.to_dict(), "optimizer": optim_info, "extra": extra,
    }
    blob = io.BytesIO()
    torch.save(info, blob)
    state[_INFO_KEY] = blob.getvalue()
    return state


def _fresh_dir(saving: str, compiled: OSDPModule) -> None:
    """An empty ``saving`` directory holding the plan (removes a failed save's leftovers)."""
    shutil.rmtree(saving, ignore_errors=True)
    os.makedirs(saving)
    compiled.plan.save(os.path.join(saving, _PLAN_FILE))


def _replace_dir(saving: str, path: str) -> None:
    """Move ``saving`` to ``path``; the previous ``path`` is moved aside first, then deleted."""
    old = path.rstrip(os.sep) + _OLD_SUFFIX
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(saving, path)
    shutil.rmtree(old, ignore_errors=True)


# ---- loading --------------------------------------------------------------------------------

def load_checkpoint(path: str | os.PathLike[str], compiled: OSDPModule,
                    optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Load a checkpoint written by :func:`save_checkpoint` into ``compiled`` (and ``optimizer``).

    The model may be compiled under another plan and the world may have another size: each rank
    reads its own shards. ``optimizer`` may be fresh (no state yet); it must have the same
    parameters in each param group as the saved one. Returns the ``extra`` that was saved.

    Collective: every rank must call it. Raises CheckpointError on every rank when the
    checkpoint is missing or does not fit; nothing is loaded then. Called on some ranks only,
    it raises CollectiveError on those within the process group's timeout.
    """
    path = os.fspath(path)
    reading = read_agreed("load_checkpoint", path, compiled, _FIX,
                          lambda: _Reading(path, compiled, optimizer))
    if optimizer is not None:
        optimizer.load_state_dict(reading.optimizer_state(optimizer))
    return reading.info["extra"]


def read_agreed(what: str, path: str, compiled: OSDPModule, fix: str, prepare: Any) -> Any:
    """Load a checkpoint collectively with every rank agreeing at each step: ``prepare()``
    makes the reading (its ``state``: the targets; its ``load_options``: ``dcp.load``'s
    keywords saying where to read), ``dcp.load`` fills them, its ``finish()``
    puts what is not in place. A failure on any rank raises CheckpointError on every rank
    before anything is put in place; a rank missing raises CollectiveError (``fix`` says
    what to do). Raises InputError when ``compiled`` is not a compiled module."""
    if not isinstance(compiled, OSDPModule):
        raise InputError(f"{what} needs the module compile_osdp returned, got "
                         f"{type(compiled).__name__}")
    with every_rank(f"{what}()", fix):
        reading, error = _attempt(prepare)
        _agree(error, f"{what}({path!r})")
        _, error = _attempt(dcp.load, reading.state, **reading.load_options)
        _agree(error, f"{what}({path!r})")
        reading.finish()
    return reading


class _Reading:
    """A checkpoint's description, checked against the model and optimizer, and the targets
    ``dcp.load`` fills: parameters in place (views of the shards), a split weight's chunk,
    buffers and optimizer state in new tensors; :meth:`finish` puts what is not in place."""

    def __init__(self, path: str, compiled: OSDPModule,
                 optimizer: torch.optim.Optimizer | None) -> None:
        self.compiled = compiled
        self.load_options: dict[str, Any] = {"checkpoint_id": path}
        self.info = _read_info(path)
        # a version 1 checkpoint without splits holds every weight whole too
        self.units = _units(compiled, by_weight=self.info["version"] >= 2
                            or not self.info["splits"])
        self.trainable_only = bool(self.info.get("trainable_only"))
        if self.trainable_only:  # the others are left as they are
            self.units = _trainable(compiled, self.units)
        _check_model(path, self.info, compiled, self.units, buffers=not self.trainable_only)
        self.layouts = _layouts(compiled)
        self.flat = self.info["version"] < 3
        """Versions 1 and 2 saved every tensor flat: each is read whole (``self.whole``)."""
        self.state: dict[str, Any] = {}
        self.whole: dict[tuple[str, str], _Layout] = {}
        """(unit, state key or "") -> the chunk loaded of a weight saved whole."""
        table = compiled.param_table
        for unit, parts in self.units.items():
            if parts == (unit,) and not self.flat:
                lay = self.layouts[unit]
                self.state[f"model.{unit}"] = lay.wrap(lay.local)
            else:
                self.whole[(unit, "")] = lay = _whole_layout(
                    self._shape(table.full_shape(unit)), table.local(parts[0]).detach())
                self.state[f"model.{unit}"] = lay.wrap(lay.local)
        self.buffers = ({} if self.trainable_only else
                        {k: torch.empty_like(table.buffer(k)) for k in _buffer_keys(compiled)})
        self.state.update({f"model.{k}": t for k, t in self.buffers.items()})
        self.optim: dict[tuple[str, str], torch.Tensor] = {}
        """(part, state key) -> its loaded state tensor."""
        if optimizer is not None:
            self._optimizer_targets(path, optimizer)

    def _shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a tensor of ``shape`` was saved at in this checkpoint."""
        return (math.prod(shape),) if self.flat else _saved_shape(shape)

    def _optimizer_targets(self, path: str, optimizer: torch.optim.Optimizer) -> None:
        saved = self.info["optimizer"]
        if saved is None:
            raise CheckpointError(f"the checkpoint at {path!r} has no optimizer state; load it "
                                  "with optimizer=None and start the optimizer afresh")
        groups = _unit_names(self.compiled, optimizer, self.units)
        saved_groups = [g["params"] for g in saved["param_groups"]]
        if [sorted(g) for g in groups] != [sorted(g) for g in saved_groups]:
            raise CheckpointError(
                f"the optimizer's param groups ({[len(g) for g in groups]} parameters) are not "
                f"the saved ones ({[len(g) for g in saved_groups]}); build the optimizer with "
                "the same param groups as when the checkpoint was saved")
        metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        for unit, entries in saved["state"].items():
            parts = self.units[unit]
            for key, (kind, _) in entries.items():
                if kind == "value":
                    continue
                meta = metadata[f"optim.{unit}.{key}"]
                assert isinstance(meta, TensorStorageMetadata), (unit, key)
                dtype = meta.properties.dtype
                if kind == "like_param" and parts == (unit,) and not self.flat:
                    lay = self.layouts[unit]
                    target = lay.zeros(dtype)
                    self.state[f"optim.{unit}.{key}"] = lay.wrap(target)
                    self.optim[(unit, key)] = target
                elif kind == "like_param":
                    self.whole[(unit, key)] = lay = _whole_layout(
                        tuple(meta.size), torch.empty(0, dtype=dtype,
                                                  device=self.layouts[parts[0]].local.device))
                    self.state[f"optim.{unit}.{key}"] = lay.wrap(lay.local)
                else:
                    target = torch.zeros(meta.size, dtype=dtype)
                    self.state[f"optim.{unit}.{key}"] = target
                    self.optim[(unit, key)] = target

    def finish(self) -> None:
        """After ``dcp.load``: buffers copied in; each weight loaded whole gathered from its
        chunks (collective, in the same order on every rank) and cut into this model's parts
        and shards, the parameters in place, their optimizer state in new tensors."""
        table = self.compiled.param_table
        with torch.no_grad():
            for key, loaded in self.buffers.items():
                table.buffer(key).copy_(loaded)
            for (unit, key), lay in self.whole.items():
                if key:  # laid out like the unit's parameter (a split weight's, or a part's)
                    full = _gathered(table, unit, lay)
                    self.optim[(unit, key)] = table.to_local(unit, full).detach().clone()
                else:
                    _put_whole(table, unit, lay)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The loaded state as a ``torch.optim`` state dict with this optimizer's indices
        (``load_state_dict`` pairs the indices of each group with its parameters in order)."""
        saved, table = self.info["optimizer"], self.compiled.param_table
        names_of = _param_names(self.compiled, optimizer)
        index = {name: i for i, name in enumerate(n for g in names_of for n in g)}
        state: dict[int, dict[str, Any]] = {}
        for group, units in _units_of_groups(self.compiled, self.units).items():
            units = tuple(u for u in units if saved["state"].get(u))
            if not units or group not in index:
                continue
            entries = saved["state"][units[0]]
            value: dict[str, Any] = {}
            for key, (kind, saved_value) in entries.items():
                if kind == "value":
                    value[key] = saved_value
                elif kind == "tensor" or units == (group,):
                    value[key] = self.optim[(units[0], key)]
                else:  # version 1: a split weight's parts, each saved as a unit
                    value[key] = table.join(group, {u: self.optim[(u, key)] for u in units})
            state[index[group]] = value
        param_groups = [{**{k: v for k, v in saved_group.items() if k != "params"},
                         "params": [index[n] for n in names]}
                        for saved_group, names in zip(saved["param_groups"], names_of)]
        return {"state": state, "param_groups": param_groups}


def _gathered(table: ParamTable, unit: str, lay: _Layout) -> torch.Tensor:
    """The whole of ``unit`` from the chunks of it loaded into ``lay`` on every rank
    (collective)."""
    flat = gather_full(lay.local, (lay.numel,), WORLD) if lay.sharded else local_of(lay.local)
    return flat.reshape(table.full_shape(unit)).contiguous()


def _put_whole(table: ParamTable, unit: str, lay: _Layout) -> None:
    """Put the weight ``unit``, loaded whole as chunks into ``lay``, into this model's parts and
    shards (collective)."""
    for part, piece in table.pieces(unit, _gathered(table, unit, lay)):
        table.load(part, piece.contiguous())


def _read_info(path: str) -> dict[str, Any]:
    """The checkpoint's ``osdp`` entry, read by this rank alone (no collective)."""
    if not os.path.exists(os.path.join(path, ".metadata")):
        hint = (f"; {path + _OLD_SUFFIX} exists: a save was interrupted while replacing the "
                "previous checkpoint, which is that directory"
                if os.path.isdir(path + _OLD_SUFFIX) else "")
        raise CheckpointError(f"no checkpoint at {path!r} (no .metadata file){hint}; pass the "
                              "directory that save_checkpoint wrote")
    box: dict[str, Any] = {_INFO_KEY: b""}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(box, checkpoint_id=path, no_dist=True)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"{path!r} is not an osdp-fx checkpoint ({_first_line(exc)}); "
                              "load it with torch.distributed.checkpoint directly") from exc
    info = torch.load(io.BytesIO(box[_INFO_KEY]), weights_only=False)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not an osdp-fx checkpoint; load it with "
                              "torch.distributed.checkpoint directly")
    return info


def _check_model(path: str, info: dict[str, Any], compiled: OSDPModule,
                 units: dict[str, tuple[str, ...]], *, buffers: bool = True) -> None:
    """Raise CheckpointError unless the checkpoint holds exactly this model's tensors (those of
    ``units``, and the buffers when ``buffers``)."""
    table = compiled.param_table
    splits = {n: len(s.parts) for n, s in table.splits.items()}
    if info["version"] < 2 and info["splits"] and info["splits"] != splits:
        raise CheckpointError(
            f"the checkpoint at {path!r} was saved by osdp-fx 0.1 from a model split as "
            f"{info['splits']}, under the parts' names, and this model is split as {splits}. "
            "Load it into the model compiled with the saved plan, compile_osdp(model, inputs, "
            f"plan={os.path.join(path, _PLAN_FILE)!r}), and save it again: a checkpoint saved "
            "now keeps split weights whole and loads under any splits")
    mine = {unit: table.full_shape(unit) for unit in units}
    saved = info["params"]
    missing = [n for n in mine if n not in saved]
    unexpected = [n for n in saved if n not in mine]
    wrong = [f"{n}: saved {tuple(saved[n])}, model {mine[n]}" for n in mine
             if n in saved and tuple(saved[n]) != tuple(mine[n])]
    held = {k: tuple(table.buffer(k).shape) for k in _buffer_keys(compiled)} if buffers else {}
    missing += [k for k in held if k not in info["buffers"]]
    unexpected += [k for k in info["buffers"] if k not in held]
    wrong += [f"{k}: saved {info['buffers'][k]}, model {s}" for k, s in held.items()
              if k in info["buffers"] and tuple(info["buffers"][k]) != s]
    if missing or unexpected or wrong:
        raise CheckpointError(
            f"the checkpoint at {path!r} does not fit this model (missing: {missing[:5]}, "
            f"unexpected: {unexpected[:5]}, other shapes: {wrong[:5]}); load it into the model "
            "it was saved from (the same class and configuration)")

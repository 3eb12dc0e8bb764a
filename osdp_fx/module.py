"""``OSDPModule``: a compiled model, called like the original, whose parameters are this rank's
shards. ``compile_osdp`` (``api.py``) builds it; this module holds what it owns per model: its
graph, plan, parameter table and runtime state (reducer, reduce-scatter queue, no_sync state)."""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.module import _IncompatibleKeys

from .core.io_spec import CallCheck
from .core.strategies import traits
from .errors import InputError
from .plan.plan import Plan
from .runtime.accumulation import GradSync, HeldGrads
from .runtime.collectives import WORLD, every_rank, group_rank
from .runtime.compile_support import release_graphs, run_eagerly, under_torch_compile
from .runtime.compiled_regions import CompiledRegions, build_regions
from .runtime.forward import ModuleRuntime
from .runtime.param_table import ParamTable
from .runtime.params import GradReduceScatters
from .runtime.reducer import GradReducer
from .runtime.sharded import is_dtensor, is_split_chunks, local_of, split_signature


def _grad_sync(table: ParamTable, reduce_dtype: torch.dtype | None) -> GradSync:
    """The reducer (all-reduce buckets of the plan's size), reduce-scatter queue and no_sync
    state of one compiled module."""
    plan = table.plan
    replicated = [table.local(p.name) for p in plan.params
                  if not traits(p.strategy).sharded and p.trainable]
    held = HeldGrads()
    return GradSync(GradReducer(replicated, WORLD, reduce_dtype=reduce_dtype,
                                bucket_bytes=plan.schedule.reduce_bucket_bytes,
                                max_in_flight=plan.schedule.scatters_in_flight),
                    GradReduceScatters(plan.schedule.scatters_in_flight, held=held), held)


class OSDPModule(nn.Module):
    """A compiled model: called like the original, parameters are this rank's shards.

    Parameter and buffer names and shapes are the model's own. ``parameters()`` yields a
    sharded parameter as a ``DTensor`` of its shape sharded on dim 0 (as FSDP2 does;
    ``runtime/sharded.py``) and a replicated one as the full tensor (a ``Replicate()``
    DTensor where the plan shards others). A weight the plan splits into parts
    (``docs/splitting.md``) is one parameter too, of its name and shape, whose storage holds
    this rank's parts (a DTensor whose local tensor is the parts' local data one after
    another where a part is sharded: [Note: split parameters]); ``plan[name]`` lists its
    parts. After ``backward()`` every ``.grad`` holds the gradient averaged over ranks, laid
    out like its parameter (``no_sync()`` accumulates without it).

    ``state_dict()`` is local (no collective), as FSDP2's; ``full_state_dict()``,
    ``full_grads()`` and checkpoints (``training/checkpoint.py``) are collective.
    """

    def __init__(self, table: ParamTable, *, captured_by: str,
                 reduce_dtype: torch.dtype | None = None, io: CallCheck | None = None) -> None:
        super().__init__()
        table.present()  # sharded parameters as DTensors of their shapes
        gm, plan = table.gm, table.plan
        object.__setattr__(self, "_gm", gm)
        # Share the graph module's attributes so names are the model's own.
        self._modules = gm._modules
        self._parameters = gm._parameters
        self._buffers = gm._buffers
        self._plan = plan
        self._table = table
        self._captured_by, self._io = captured_by, io  # io: calls -> graph inputs (io_spec)
        self._regions: CompiledRegions | None = None  # under torch.compile: built on first call
        self._runtime = ModuleRuntime(  # reducer, reduce-scatters, no_sync state
            _grad_sync(table, reduce_dtype), prefetch=plan.schedule.prefetch,
            regather=any(traits(p.strategy).freed_after_forward for p in plan.params))
        # A graph module and its graph refer to each other: cut that when this module goes, or
        # its shards outlive it until Python's collector runs (export nests graph modules).
        weakref.finalize(self, release_graphs, [
            m.graph for m in gm.modules() if isinstance(m, fx.GraphModule)])

    # ---- running ------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self._io(args, kwargs) if self._io else args  # io_spec.py; before any collective
        with self._runtime.forward() as scope:
            # under torch.compile, the graph's regions ([Note: measured regions])
            scope.output = (self._compiled_regions() if under_torch_compile()
                            else self._gm)(*inputs)
        return scope.end()

    def _compiled_regions(self) -> CompiledRegions:
        if self._regions is None:
            self._regions = build_regions(self._gm)
            weakref.finalize(self, self._regions.release)
        return self._regions

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """The backwards of forwards run inside this context run no collective: gradients
        accumulate on this rank, and the next backward of a forward run outside reduces their
        sum once, as DDP's ``no_sync()``. Sharded parameters hold a full gradient meanwhile;
        plan for it with ``compile_osdp(..., grad_accumulation=k)`` (``docs/training.md``)."""
        return self._runtime.grad_sync.no_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Also drops what an unfinished ``no_sync()`` accumulation holds."""
        self._runtime.grad_sync.drop()
        super().zero_grad(set_to_none)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # ``to()``, ``double()``, ...: a split weight's parts view its converted storage
        out = super()._apply(fn, recurse)
        self._table.repoint()
        return out

    def train(self, mode: bool = True) -> OSDPModule:
        self._gm.training = mode
        if self._regions is not None:
            self._regions.train(mode)
        return super().train(mode)

    # ---- inspection ---------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan in force; ``print(compiled.plan)`` shows it as a table."""
        return self._plan

    @property
    def param_table(self) -> ParamTable:
        """This rank's parameters: names, aliases, splits, strategies, shard layouts."""
        return self._table

    @property
    def compiled_regions(self) -> str:
        """Under torch.compile: its regions, their operators, median times compiled and eager
        (forward plus backward) and the way each runs."""
        if self._regions is None:
            return "not run under torch.compile yet: no regions"
        return self._regions.table()

    @property
    def graph_module(self) -> fx.GraphModule:
        """The rewritten torch.fx GraphModule."""
        return self._gm

    @property
    def captured_by(self) -> str:
        """How the model was captured: ``"symbolic_trace"`` or ``"export"``."""
        return self._captured_by

    @property
    def code(self) -> str:
        """Python code of the rewritten graph, with its collectives as calls."""
        return self._gm.code

    def print_readable(self, print_output: bool = True) -> str:
        return self._gm.print_readable(print_output=print_output)

    # ---- state --------------------------------------------------------------------------
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> Any:
        """The sharded state dict, as FSDP2's, local: no collective, so one rank may call it
        alone. The keys of the original ``model.state_dict()`` (a tied weight under each of its
        names); each parameter as the module holds it, sharing its storage: a sharded one as
        its ``DTensor`` (global shape and placement: ``torch.distributed.checkpoint`` saves and
        loads it, each rank its rows), a replicated one and the buffers as they are. A weight
        the plan splits is its one parameter (a DTensor as held, whose local tensor tells
        ``torch.distributed.checkpoint`` where each part's rows lie: ``SplitChunks`` in
        ``runtime/sharded.py``; ``keep_vars=True`` gives the parameters themselves, whose local
        tensor does not: save the default one). ``full_state_dict()`` gives full tensors
        instead (collective)."""
        if args:
            raise InputError("OSDPModule.state_dict takes keyword arguments only "
                             "(destination=, prefix=, keep_vars=)")
        table = self._table
        out: Any = OrderedDict() if destination is None else destination
        for key in table.state_keys:
            canon = table.alias_to_name.get(key)
            value = table.buffer(key) if canon is None else table.param(canon)
            if not keep_vars:
                value = table.checkpointable(canon) if canon in table.splits else value.detach()
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict keyed like the original model's: the sharded one ``state_dict()``
        returns (DTensors, loaded shard by shard, or gathered first where the placement
        differs, collective then; a split weight's from a model under other splits or
        strategies is refused, before anything is loaded: ``dcp.load`` it into this module's
        ``state_dict()``, or use ``load_checkpoint`` or ``load_full_state_dict``) or full
        tensors (``full_state_dict()``, the plain model's).
        A tied weight needs one of its names. ``strict``: missing or unexpected keys raise
        InputError; otherwise they are returned, as ``nn.Module.load_state_dict`` does."""
        if assign:
            raise InputError("OSDPModule.load_state_dict(assign=True) is not supported: the "
                             "parameters are this rank's shards; load with assign=False")
        table = self._table
        canon_of = table.alias_to_name
        have = {canon_of.get(k, k) for k in state_dict}
        missing = [k for k in table.state_keys if canon_of.get(k, k) not in have]
        unexpected = [k for k in state_dict if k not in table.state_keys]
        if strict and (missing or unexpected):
            raise InputError(
                f"load_state_dict: the state dict does not match the model (missing: "
                f"{missing[:5]}, unexpected: {unexpected[:5]}); pass compiled.state_dict(), "
                "compiled.full_state_dict() or the original model's state_dict()")
        foreign = [k for k, v in state_dict.items()
                   if k in canon_of and is_dtensor(v) and (
                       is_split_chunks(local_of(v)) or hasattr(v, "_osdp_signature"))
                   and not _same_layout(table.param(canon_of[k]), v,
                                        table.signature(canon_of[k]))]
        if foreign:  # its local tensor is not a chunk of the weight: full_tensor() would lie
            raise InputError(
                f"load_state_dict: {foreign[:3]} hold split weights' state from a model "
                "compiled under other splits or strategies, which this one cannot take shard "
                "by shard; load it through torch.distributed.checkpoint (dcp.save it, then "
                "dcp.load into this module's state_dict()), with osdp_fx.load_checkpoint, or "
                "pass full tensors (the source's full_state_dict()) to load_full_state_dict")
        done: set[str] = set()
        with torch.no_grad(), every_rank("load_state_dict() of DTensors laid out otherwise than "
                                         "the module's (gathered)", _FIX_LOAD):
            for key, value in state_dict.items():
                canon = canon_of.get(key)
                if key in unexpected or canon in done:
                    continue
                if canon is None:
                    table.buffer(key).copy_(value)
                    continue
                done.add(canon)
                shape = table.full_shape(canon)
                if tuple(value.shape) != tuple(shape):
                    raise InputError(f"load_state_dict: {key!r} has shape {tuple(value.shape)}, "
                                     f"the model expects {shape}")
                param = table.param(canon)
                if _same_layout(param, value, table.signature(canon)):
                    local_of(param).copy_(local_of(value))
                    continue
                full = value.full_tensor() if is_dtensor(value) else value
                for part, piece in table.pieces(canon, full):
                    table.load(part, piece)
        return _IncompatibleKeys(missing, unexpected)

    def full_state_dict(self, *, rank0_only: bool = False, cpu_offload: bool = False,
                        ignore_frozen_params: bool = False) -> OrderedDict[str, torch.Tensor]:
        """Full tensors under exactly the keys of the original ``model.state_dict()``, loadable
        into the original, unwrapped model class.

        Collective: every rank must call it (``state_dict()`` is the local one). Tied
        parameters are one tensor under each name. ``rank0_only``: other ranks return an empty
        dict (they still take part in the gathers). ``cpu_offload``: the tensors are moved to
        the CPU one by one as they are gathered. ``ignore_frozen_params``: only the parameters
        that require grad (a LoRA model's adapters), no frozen parameter and no buffer, so that
        the frozen base is never gathered (as torch's ``StateDictOptions`` of the same name).
        Called on some ranks only, it raises ``CollectiveError`` on those within the process
        group's timeout.
        """
        table = self._table
        keep = not rank0_only or group_rank(WORLD) == 0
        gathered: dict[str, torch.Tensor] = {}
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        with every_rank("full_state_dict()", _FIX_FULL):
            for key in table.state_keys:
                canon = table.alias_to_name.get(key)
                if ignore_frozen_params and (canon is None or not self._requires_grad(canon)):
                    continue
                if canon is None:
                    value = table.buffer(key).detach().clone()
                else:
                    if canon not in gathered:
                        full = table.full(canon)
                        assert full is not None, canon
                        gathered[canon] = full.cpu() if cpu_offload else full
                    value = gathered[canon]
                if keep:
                    out[key] = value.cpu() if cpu_offload else value
        return out

    def _requires_grad(self, name: str) -> bool:
        return self._table.local(self._table.parts(name)[0]).requires_grad

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Full averaged gradients by canonical parameter name (collective; for inspection)."""
        with every_rank("full_grads()", "Call it on every rank, after the same backward."):
            return {name: self._table.full(name, grad=True) for name in self._table.groups}

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors (keys of the original ``model.state_dict()``) into this rank's shards."""
        table = self._table
        missing = [k for k in table.state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in table.state_keys]
        if missing or unexpected:
            raise InputError(
                f"load_full_state_dict: state dict does not match the model (missing: "
                f"{missing[:5]}, unexpected: {unexpected[:5]}); pass the dict returned by "
                "full_state_dict() or the original model's state_dict()"
            )
        wrong = _wrong_shapes(table, state_dict)
        if wrong:  # checked before anything is loaded, so a failed load changes nothing
            raise InputError(
                f"load_full_state_dict: tensors of the wrong shape ({'; '.join(wrong[:5])}); "
                "pass full tensors as returned by full_state_dict() or model.state_dict()"
            )
        with torch.no_grad():
            for key in table.state_keys:
                canon = table.alias_to_name.get(key)
                if canon is None:
                    table.buffer(key).copy_(state_dict[key])
                elif key == canon:
                    for part, full in table.pieces(canon, state_dict[key]):
                        table.load(part, full)


_FIX_FULL = ("Call full_state_dict() on every rank (rank0_only=True keeps the result on rank 0 "
             "alone), or state_dict() where one rank alone needs the state: it is local.")
_FIX_LOAD = ("Call load_state_dict() on every rank, or pass each rank the state_dict() of a "
             "module compiled under the same plan (loaded without a collective).")


def _same_layout(param: torch.Tensor, value: torch.Tensor,
                 signature: tuple[Any, ...] | None = None) -> bool:
    """Whether ``value`` holds on this rank exactly what ``param`` does (the same placement over
    the same mesh and the same local shape, or both plain; a split weight's, whose layout is
    ``signature``, the same parts where ``value`` says which)."""
    if is_dtensor(param) != is_dtensor(value):
        return False
    if not is_dtensor(param):
        return True
    if local_of(param).shape != local_of(value).shape:
        return False
    # a split weight's state from state_dict(), or (keep_vars=True) its parameter itself
    theirs = split_signature(local_of(value)) or getattr(value, "_osdp_signature", None)
    if theirs is not None and theirs != signature:
        return False
    if signature is not None and theirs is None and (
            local_of(param).untyped_storage().data_ptr()
            != local_of(value).untyped_storage().data_ptr()):
        return False  # a plain DTensor of this shape is a Shard(0) chunk, not these parts
    return (tuple(value.placements) == tuple(param.placements)  # type: ignore[attr-defined]
            and value.device_mesh == param.device_mesh)  # type: ignore[attr-defined]


def _wrong_shapes(table: ParamTable, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """What in a full state dict (with every key of ``table``) has the wrong shape."""
    expected = {
        key: table.full_shape(table.alias_to_name[key]) if key in table.alias_to_name
        else tuple(table.buffer(key).shape)
        for key in table.state_keys
    }
    return [f"{k!r} has shape {tuple(getattr(state_dict[k], 'shape', ()))}, the model "
            f"expects {shape}" for k, shape in expected.items()
            if not isinstance(state_dict[k], torch.Tensor) or tuple(state_dict[k].shape) != shape]


# Under torch.compile the step's set-up runs as it is, and so does all it calls but the regions
# ([Note: torch.compile]).
run_eagerly(OSDPModule.forward)
run_eagerly(OSDPModule._compiled_regions)
run_eagerly(CallCheck.__call__, recursive=True)
run_eagerly(ModuleRuntime.forward, recursive=True)

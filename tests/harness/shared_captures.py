"""Test cases share torch.export captures of the same Hugging Face model: each is exported once
per process (a test rank, or the pytest process) and later cases get a copy of its graph.

Why: exporting a Hugging Face model with dynamic batch and sequence (``Dim.AUTO``) takes 2-3 s
of CPU even for a two-layer test model, and the suite compiles such models many times, most of
them the same model built again for another case. Every case still runs the rest of
``compile_osdp`` (normalisation, profile, plan, shard) on its own model.

What is shared: the graph module ``osdp_fx.passes.capture._export_module`` returns (before
``capture`` normalises it), keyed by :func:`model_key`. A later case gets a deep copy whose
parameters and buffers are the new model's own (by name; the stored copy keeps none of the
first model's tensors, only meta stand-ins) and whose other tensors (constants export lifted from
the forward's code) are copies of the first capture's.

When it is the same model: the key holds, for the model and every submodule, its class, its
training flag, and the value of every attribute that is not a tensor (Hugging Face and peft
configurations field by field, hooks and other functions by their code and the values they
close over), every parameter's and buffer's name, shape, dtype, device and ``requires_grad``
(and which are tied), and the example inputs' shapes, dtypes and devices. Only models with a
``transformers`` or ``peft`` module are shared, and only where every module's class is defined
at a module's top level (its name then says which class it is); a model with a tensor held as
a plain attribute, or an attribute of a kind the key cannot read, is exported afresh. Tests of
capture itself see the real export on its first call for a model, and an export that fails is
not stored. ``tests/test_shared_captures.py`` tests the sharing itself.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import types
import warnings
from typing import Any

import torch
from torch import fx, nn

_SHARED_LIBRARIES = ("transformers", "peft")
_KEPT = 32
_graphs: collections.OrderedDict[tuple[Any, ...], fx.GraphModule] = collections.OrderedDict()


class _Unkeyable(Exception):
    """An attribute the key cannot read: the model is exported afresh."""


def _freeze(value: Any, seen: frozenset[int] = frozenset()) -> Any:
    """A hashable stand-in of ``value`` that is equal for equal values (see the module
    docstring); raises :class:`_Unkeyable` for what it cannot read."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.Size, enum.Enum)):
        return (type(value).__qualname__, str(value))
    if isinstance(value, torch.Tensor):
        raise _Unkeyable("a tensor held as a plain attribute")
    if id(value) in seen:
        return ("cycle",)
    seen = seen | {id(value)}
    if isinstance(value, dict):
        return ("dict", tuple((_freeze(k, seen), _freeze(v, seen)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v, seen) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_freeze(v, seen)) for v in value)))
    if isinstance(value, functools.partial):
        return ("partial", _freeze(value.func, seen), _freeze(value.args, seen),
                _freeze(value.keywords, seen))
    if isinstance(value, types.MethodType):  # its object's state is keyed where it is held
        return ("method", _freeze(value.__func__, seen), type(value.__self__).__qualname__)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        code = getattr(value, "__code__", None)
        cells = tuple(_contents(c) for c in getattr(value, "__closure__", None) or ())
        return ("function", value.__module__, value.__qualname__, id(code),
                _freeze(getattr(value, "__defaults__", None), seen), _freeze(cells, seen))
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if isinstance(value, nn.Module):
        return ("module", id(value))  # its own entry of the key describes it
    if dataclasses.is_dataclass(value) or type(value).__module__.split(".")[0] in (
            *_SHARED_LIBRARIES, "torch"):
        if hasattr(value, "__dict__"):
            return (type(value).__module__, type(value).__qualname__,
                    _freeze(vars(value), seen))
    raise _Unkeyable(f"an attribute of type {type(value).__qualname__}")


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return ("empty cell",)


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.dtype, t.device.type, t.requires_grad


def model_key(model: nn.Module, example_inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What a capture of ``model`` on ``example_inputs`` depends on (the module docstring), or
    None when it is not to be shared."""
    classes = {type(m) for m in model.modules()}
    if (not any(c.__module__.split(".")[0] in _SHARED_LIBRARIES for c in classes)
            or any("<locals>" in c.__qualname__ for c in classes)):
        return None  # no Hugging Face module, or a class a name does not identify
    try:
        modules = tuple(
            (name, type(m).__module__, type(m).__qualname__, m.training,
             _freeze({k: v for k, v in vars(m).items()
                      if k not in ("_parameters", "_buffers", "_modules")}))
            for name, m in model.named_modules(remove_duplicate=False))
        inputs = tuple(_tensor_key(x) if isinstance(x, torch.Tensor) else _freeze(x)
                       for x in example_inputs)
    except _Unkeyable:
        return None
    tensors = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]
    first: dict[int, str] = {}
    state = tuple((n, first.setdefault(id(t), n), *_tensor_key(t)) for n, t in tensors)
    return modules, state, inputs


def _model_tensors(gm: fx.GraphModule, model: nn.Module) -> dict[str, torch.Tensor]:
    """The graph module's parameters and buffers that are the model's (by name)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    return {n: t for n, t in (*gm.named_parameters(remove_duplicate=False),
                              *gm.named_buffers(remove_duplicate=False)) if n in own}


def _stored(gm: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """A copy of ``gm`` whose parameters and buffers of the model are meta tensors."""
    memo: dict[int, Any] = {}
    for t in _model_tensors(gm, model).values():
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return _copy(gm, memo)


def _bound(stored: fx.GraphModule, model: nn.Module) -> fx.GraphModule:
    """A copy of ``stored`` whose parameters and buffers are ``model``'s own."""
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    memo = {id(t): own[n] for n, t in _model_tensors(stored, model).items()}
    return _copy(stored, memo)


def _copy(gm: fx.GraphModule, memo: dict[int, Any]) -> fx.GraphModule:
    with warnings.catch_warnings():  # copying the input spec asks a deprecated isinstance
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm, memo)


def shared_export(real: Any) -> Any:
    """``real`` (``_export_module``) with its graphs shared across cases (the module
    docstring)."""
    def export(model: nn.Module, example_inputs: tuple[Any, ...]) -> fx.GraphModule:
        key = model_key(model, example_inputs)
        if key is None:
            return real(model, example_inputs)
        stored = _graphs.get(key)
        if stored is None:
            gm = real(model, example_inputs)
            _graphs[key] = _stored(gm, model)
            while len(_graphs) > _KEPT:
                _graphs.popitem(last=False)
            return gm
        _graphs.move_to_end(key)
        return _bound(stored, model)

    export.__wrapped__ = real  # type: ignore[attr-defined]
    return export


def install() -> None:
    """Share the captures of this process (idempotent)."""
    from osdp_fx.passes import capture

    if not hasattr(capture._export_module, "__wrapped__"):
        capture._export_module = shared_export(capture._export_module)

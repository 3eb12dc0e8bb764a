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
a plain attribute, or an attribute of a kind the key cannot read, is exported afresh. The
session's first capture of a model is a real export, and an export that fails is not stored.
``tests/test_shared_captures.py`` tests the sharing itself; :func:`uninstalled` undoes it for
the tests that need the real export (``tests/passes/test_export_real.py``).

Across processes: the test ranks of every world and the pytest workers each export a model
their process has not seen, most of them one another process of the session exported already
(the ranks of a world export the same model at the same time). So the exported programs are also
kept on disk, in the directory ``CAPTURE_DIR_ENV`` names (``conftest.py`` makes one per session
and removes it), under a digest of the same key: a process that finds one loads it
(``torch.export.load``, about a quarter of an export's CPU time) instead of exporting, and binds
the model's own parameters and buffers to it. A lock per key makes the ranks of a world that
export the same model together wait for the first instead of exporting it each.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import enum
import fcntl
import functools
import hashlib
import importlib.metadata
import os
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

_SHARED_LIBRARIES = ("transformers", "peft")
CAPTURE_DIR_ENV = "OSDP_TEST_CAPTURE_DIR"
"""The environment variable naming the directory the processes of a test session keep exported
programs in (unset: each process exports on its own)."""
_LOCK_WAIT_S = 300.0
_KEPT = 32
_graphs: collections.OrderedDict[tuple[Any, ...], fx.GraphModule] = collections.OrderedDict()


class _Unkeyable(Exception):
    """An attribute the key cannot read: the model is exported afresh."""


def _freeze(value: Any, paths: dict[int, str], seen: frozenset[int] = frozenset()) -> Any:
    """A hashable stand-in of ``value`` that is equal for equal values (see the module
    docstring), the same in every process (no object's identity: a module by its path in the
    model, ``paths``; a function's code by its file, line and bytecode); raises
    :class:`_Unkeyable` for what it cannot read."""
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
        return ("dict", tuple((_freeze(k, paths, seen), _freeze(v, paths, seen)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v, paths, seen) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_freeze(v, paths, seen)) for v in value)))
    if isinstance(value, functools.partial):
        return ("partial", _freeze(value.func, paths, seen), _freeze(value.args, paths, seen),
                _freeze(value.keywords, paths, seen))
    if isinstance(value, types.MethodType):  # its object's state is keyed where it is held
        return ("method", _freeze(value.__func__, paths, seen), type(value.__self__).__qualname__)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        code = getattr(value, "__code__", None)
        cells = tuple(_contents(c) for c in getattr(value, "__closure__", None) or ())
        return ("function", value.__module__, value.__qualname__, _code_key(code),
                _freeze(getattr(value, "__defaults__", None), paths, seen),
                _freeze(cells, paths, seen))
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if isinstance(value, nn.Module):
        if id(value) not in paths:
            raise _Unkeyable("a module outside the model")
        return ("module", paths[id(value)])  # its own entry of the key describes it
    if dataclasses.is_dataclass(value) or type(value).__module__.split(".")[0] in (
            *_SHARED_LIBRARIES, "torch"):
        if hasattr(value, "__dict__"):
            return (type(value).__module__, type(value).__qualname__,
                    _freeze(vars(value), paths, seen))
    raise _Unkeyable(f"an attribute of type {type(value).__qualname__}")


def _code_key(code: Any) -> Any:
    """A function's code, the same in every process that loaded the same source."""
    if code is None:
        return None
    return (code.co_filename, code.co_firstlineno, code.co_name,
            hashlib.sha256(code.co_code).hexdigest())


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
    paths: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name)
    try:
        modules = tuple(
            (name, type(m).__module__, type(m).__qualname__, m.training,
             _freeze({k: v for k, v in vars(m).items()
                      if k not in ("_parameters", "_buffers", "_modules")}, paths))
            for name, m in model.named_modules(remove_duplicate=False))
        inputs = tuple(_tensor_key(x) if isinstance(x, torch.Tensor) else _freeze(x, paths)
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


def program_path(model: nn.Module, example_inputs: tuple[Any, ...]) -> Path | None:
    """Where the session keeps the exported program of ``model`` on ``example_inputs`` (None:
    no directory, or a model not shared)."""
    directory = os.environ.get(CAPTURE_DIR_ENV)
    key = model_key(model, example_inputs) if directory else None
    if key is None:
        return None
    versions = [torch.__version__] + [_version(lib) for lib in _SHARED_LIBRARIES]
    digest = hashlib.sha256(repr((versions, key)).encode()).hexdigest()[:32]
    return Path(directory) / f"{digest}.pt2"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the lock file ``path`` (waiting at most ``_LOCK_WAIT_S``, then going on without)."""
    with open(path, "a") as f:
        deadline = time.monotonic() + _LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load(path: Path, model: nn.Module) -> torch.export.ExportedProgram | None:
    """The program kept at ``path`` with ``model``'s own parameters and buffers, or None."""
    if not path.exists():
        return None
    try:
        program = torch.export.load(path)
    except Exception:  # written by another version, or cut short: export afresh
        return None
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    if set(program.state_dict) - set(own):
        return None
    for table in (program.state_dict, program.constants):
        for name in table:
            if name in own:
                table[name] = own[name]
    return program


def _save(program: torch.export.ExportedProgram, path: Path) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        torch.export.save(program, tmp)
        os.replace(tmp, path)
    except Exception:  # a program export cannot save (meta weights, say): not kept
        tmp.unlink(missing_ok=True)


def kept_program(real: Any) -> Any:
    """``real`` (``_export_program``) with its programs kept across the processes of a session
    (the module docstring)."""
    def export(model: nn.Module, example_inputs: tuple[Any, ...]) -> torch.export.ExportedProgram:
        path = program_path(model, example_inputs)
        if path is None:
            return real(model, example_inputs)
        with _locked(path.with_suffix(".lock")):
            program = _load(path, model)
            if program is None:
                program = real(model, example_inputs)
                _save(program, path)
        return program

    export.__wrapped__ = real  # type: ignore[attr-defined]
    return export


_PATCHED = ("_export_module", "_export_program")
"""The functions of ``osdp_fx.passes.capture`` that :func:`install` wraps."""


def install() -> None:
    """Share the captures of this process, and of the session's processes (idempotent)."""
    from osdp_fx.passes import capture

    if not hasattr(capture._export_module, "__wrapped__"):
        capture._export_module = shared_export(capture._export_module)
    if not hasattr(capture._export_program, "__wrapped__"):
        capture._export_program = kept_program(capture._export_program)


@contextlib.contextmanager
def uninstalled() -> Iterator[None]:
    """The real ``_export_module`` and ``_export_program`` of ``osdp_fx.passes.capture`` for the
    duration (every capture a real ``torch.export``, nothing read from or written to the shared
    graphs and programs); the wrappers :func:`install` put in place are put back after."""
    from osdp_fx.passes import capture

    wrappers = {name: getattr(capture, name) for name in _PATCHED}
    for name, wrapper in wrappers.items():
        setattr(capture, name, getattr(wrapper, "__wrapped__", wrapper))
    try:
        yield
    finally:
        for name, wrapper in wrappers.items():
            setattr(capture, name, wrapper)

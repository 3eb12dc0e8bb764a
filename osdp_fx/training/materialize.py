"""Meta-device initialisation: give a model built under ``torch.device("meta")`` real values,
one module at a time, keeping only this rank's shards.

A model built on the meta device has shapes but no storage, so it can be captured, profiled
(``fake=True``) and planned whatever its size. ``compile_osdp`` then shards the meta parameters
(the shards are meta too) and calls :func:`materialize_meta_model`, which walks the model's
modules in ``model.named_modules()`` order and, for each module that owns parameters or buffers
directly:

1. allocates them on the device (``module.to_empty(device=..., recurse=False)``),
2. fills them with values the module cannot mean (NaN for floating point, the dtype's minimum
   for integers) and calls ``init_fn(module)`` if given, else ``module.reset_parameters()``,
3. checks that the initialisation overwrote every tensor (a sentinel left in a whole tensor is
   an error naming it: buffers computed in ``__init__`` are not recomputed by
   ``reset_parameters``, see below),
4. hands each parameter to the compiled graph module: a sharded one as this rank's flat shard
   (``ParamTable.flat_share``), after which the full tensor is dropped; a replicated one as
   it is (the model and the compiled module then share it, as for a model built on the CPU);
   buffers are shared the same way.

So the peak is about one module's own full tensors plus the shards made so far. Every rank
computes the same full values, because every rank initialises the same modules in the same order
from the same random state (checked across ranks before the first module, see
:func:`check_same_rng_state`), so nothing is broadcast from rank 0.

Same values as a model built on the CPU: ``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm`` and
most torch modules initialise themselves in ``__init__`` by calling ``reset_parameters()``; a model
made of such modules, constructed in ``named_modules()`` order, gets bitwise the values it would
get on the CPU from the same seed. Initialisation a model applies in its own ``__init__`` after
building its submodules (a loop of ``nn.init.normal_``, Hugging Face ``post_init``) is not
replayed: pass it as ``init_fn``. A tied parameter is initialised by its first owner; a later
owner's initialisation runs on a scratch tensor in its place (its RNG draws happen, as they did
when it was built before the weights were tied) and is then discarded.

Buffers: a buffer is allocated empty like a parameter, and only the module's
``reset_parameters()`` or ``init_fn`` gives it a value. Buffers computed in ``__init__`` (a
rotary-embedding cache, a causal mask, position ids) must be recomputed by ``init_fn``; a float
or integer buffer left unset is an error, a bool buffer cannot be checked.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import InputError
from ..runtime.collectives import WORLD, group_size
from ..runtime.param_table import ParamTable

log = logging.getLogger(__name__)

InitFn = Callable[[nn.Module], None]


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in (*module._parameters.items(), *module._buffers.items())
            if t is not None}


def materialize_device(inputs: tuple[Any, ...]) -> torch.device:
    """Where a meta model's tensors are allocated: the device of the first example input that
    is not on the meta device, else the current GPU, else the CPU."""
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            return x.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(model: nn.Module, inputs: tuple[Any, ...]) -> torch.device:
    """The device a model that is not on the meta device runs on: that of its first parameter
    or buffer, else of its first tensor input, else the CPU."""
    for t in (*model.parameters(), *model.buffers(), *inputs):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def check_initializable(model: nn.Module, init_fn: InitFn | None, *, on_meta: bool) -> None:
    """Raise InputError when a meta module would have no way to get its values, or when
    ``init_fn`` is given for a model that is not on the meta device."""
    if init_fn is not None:
        if not on_meta:
            raise InputError("init_fn initialises a model built on the meta device, and this "
                             "model has no meta tensors; initialise it yourself and drop "
                             "init_fn, or build it under torch.device('meta')")
        if not callable(init_fn):
            raise InputError(f"init_fn must be a function of one module, got "
                             f"{type(init_fn).__name__}")
        return
    if not on_meta:
        return
    lacking = [f"{name or '<root>'} ({type(m).__name__}: {', '.join(_own_tensors(m))})"
               for name, m in model.named_modules()
               if any(t.device.type == "meta" for t in _own_tensors(m).values())
               and not callable(getattr(m, "reset_parameters", None))]
    if lacking:
        raise InputError(
            f"the model is on the meta device and {len(lacking)} of its modules have no "
            f"reset_parameters() to initialise their tensors: {'; '.join(lacking[:4])}. Pass "
            "compile_osdp(..., init_fn=f) where f(module) initialises the tensors a module owns "
            "directly (for Hugging Face models: init_fn=model._init_weights), or build the "
            "model on the CPU"
        )


def check_same_rng_state(device: torch.device) -> None:
    """Raise InputError on every rank unless all ranks' random states are equal (collective)."""
    if group_size(WORLD) == 1:
        return
    state = torch.get_rng_state()
    if device.type == "cuda":
        state = torch.cat([state, torch.cuda.get_rng_state(device)])
    mine = hashlib.sha256(state.numpy().tobytes()).hexdigest()
    everyone: list[Any] = [None] * group_size(WORLD)
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) > 1:
        raise InputError(
            "the model is on the meta device and the ranks' random states differ, so each rank "
            "would initialise different values: call torch.manual_seed(seed) with the same seed "
            "on every rank before building the model and compile_osdp"
        )


def materialize_meta_model(model: nn.Module, table: ParamTable, *, device: torch.device,
                           init_fn: InitFn | None) -> None:
    """Initialise ``model``'s meta tensors module by module and put them, sharded as the plan
    says, into the compiled graph module of ``table`` (module docstring)."""
    done: dict[int, torch.Tensor] = {}  # id of a meta tensor -> what replaced it (tied weights)
    n_modules = 0
    for prefix, module in model.named_modules():
        if any(t.device.type == "meta" for t in _own_tensors(module).values()):
            # one module at a time: its full tensors die when the call returns
            _materialize_module(prefix, module, done, table, device=device, init_fn=init_fn)
            n_modules += 1
    log.info("materialised %d modules of a meta model on %s", n_modules, device)


def _materialize_module(prefix: str, module: nn.Module, done: dict[int, torch.Tensor],
                        table: ParamTable, *, device: torch.device,
                        init_fn: InitFn | None) -> None:
    own = {n: t for n, t in _own_tensors(module).items() if t.device.type == "meta"}
    tied = {n: done[id(t)] for n, t in own.items() if id(t) in done}
    real = {n: t for n, t in _own_tensors(module).items() if n not in own}
    module.to_empty(device=device, recurse=False)
    for n in own:
        _fill_sentinel(_own_tensors(module)[n])
    with torch.no_grad():
        init_fn(module) if init_fn is not None else module.reset_parameters()
    for n, t in real.items():  # tensors the model built off the meta device keep their values
        _put(module, n, t)
    qual = f"{prefix}." if prefix else ""
    unset = [qual + n for n in own if n not in tied and _is_sentinel(_own_tensors(module)[n])]
    if unset:
        how = "init_fn" if init_fn is not None else f"{type(module).__name__}.reset_parameters()"
        raise InputError(
            f"{how} did not initialise {', '.join(unset)} (still empty after it ran on the "
            "meta model's module). Pass init_fn=f to compile_osdp where f(module) sets every "
            "parameter and buffer a module owns directly, including buffers the model "
            "computes in __init__"
        )
    for n, t in own.items():
        if n in tied:  # its first owner initialised it; this module's values are discarded
            _put(module, n, tied[n])
            continue
        done[id(t)] = _hand_over(qual + n, _own_tensors(module)[n], table)
        _put(module, n, done[id(t)])


def _fill_sentinel(t: torch.Tensor) -> None:
    with torch.no_grad():
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).min)


def _is_sentinel(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(torch.isnan(t).all())
    return bool((t == torch.iinfo(t.dtype).min).all())


def _put(module: nn.Module, name: str, value: torch.Tensor) -> None:
    if name in module._parameters:
        module._parameters[name] = value  # type: ignore[assignment]
    else:
        module._buffers[name] = value


def _hand_over(name: str, value: torch.Tensor, table: ParamTable) -> torch.Tensor:
    """Put one materialised tensor into the compiled graph module; return what the model keeps
    in its place: the tensor itself when the graph module shares it, else a meta placeholder
    (so the full tensor is freed)."""
    gm = table.gm
    canon = table.alias_to_name.get(name)
    if canon is None:  # a buffer
        if _has_tensor(gm, name):
            _replace(gm, name, value)
        return value
    whole = canon not in table.splits
    shared = False
    for part, full in table.pieces(canon, value.detach()):
        if table.entries[part].sharded:
            shard = table.flat_share(part, full)
            shard.requires_grad_(value.requires_grad)
            _replace(gm, part, shard)
        elif whole:
            _replace(gm, part, value)
            shared = True
        else:
            _replace(gm, part, nn.Parameter(full.clone(), requires_grad=value.requires_grad))
    if shared:
        return value
    placeholder = torch.empty_like(value, device="meta")
    return nn.Parameter(placeholder, requires_grad=value.requires_grad) if isinstance(
        value, nn.Parameter) else placeholder


def _owner(root: nn.Module, qualname: str) -> tuple[nn.Module, str]:
    *path, leaf = qualname.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    return module, leaf


def _has_tensor(root: nn.Module, qualname: str) -> bool:
    try:
        module, leaf = _owner(root, qualname)
    except AttributeError:
        return False
    return leaf in module._parameters or leaf in module._buffers


def _replace(root: nn.Module, qualname: str, value: torch.Tensor) -> None:
    """Replace the parameter or buffer ``qualname`` of ``root``, keeping its kind."""
    module, leaf = _owner(root, qualname)
    if leaf in module._parameters:
        module._parameters[leaf] = value  # type: ignore[assignment]
    else:
        assert leaf in module._buffers, qualname
        module._buffers[leaf] = value

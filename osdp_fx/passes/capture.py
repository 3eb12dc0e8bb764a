"""Capture a model as a torch.fx graph and normalise it.

Capture tries ``torch.fx.symbolic_trace`` first (a readable, module-level graph) and falls back to
``torch.export.export(..., strict=False)`` (aten-level; the only way in for Hugging Face
transformers 5.x models). Normalisation then gives every later pass one form to rely on:

* each parameter of the model is read by exactly one ``get_attr`` node whose target is the
  parameter's canonical name (its first name in ``model.named_parameters()``); tied parameters
  (an embedding shared with an LM head) are therefore one node with several users;
* consumers of parameters are ``call_function`` nodes (torch.nn modules that own parameters are
  traced through, so ``nn.Linear`` becomes ``get_attr weight/bias`` + ``F.linear``);
* the graph module owns every parameter and buffer of the model under its original name, and
  nothing else (stale aliases such as ``lm_head.weight`` are removed), so replacing a parameter on
  the graph module replaces it everywhere.

Before::

    fc = self.fc(x)                      # call_module Linear

After::

    fc_weight = self.fc.weight           # get_attr
    fc_bias = self.fc.bias
    linear = torch._C._nn.linear(x, fc_weight, fc_bias)
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn

from ..core.node_meta import NodeRole, set_osdp_meta
from ..core.precision import CONVERSIONS, cast_input, conversion_dtype
from ..errors import CaptureError, InputError
from .pipeline import properties
from .quantized import (AONF4Linear, BnbLinear4bit, replace_ao_nf4_linears,
                        replace_bnb_linears)

log = logging.getLogger(__name__)

META_REJECTED = (
    ". The model is on the meta device, where it must either run on meta tensors or be captured "
    "by torch.export (which skips code that asks for values, such as Hugging Face's mask checks)"
)


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter group of the model: a parameter and every name it is reachable by."""

    name: str
    """Canonical name: the first name of the parameter in ``model.named_parameters()``."""
    aliases: tuple[str, ...]
    """Every other name of the same tensor (tied weights), in ``named_parameters`` order."""
    shape: tuple[int, ...]
    """Shape of the full parameter."""
    dtype: torch.dtype
    """Element type of the parameter."""
    requires_grad: bool
    """False for frozen parameters, which are never reduced."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def trainable(self) -> bool:
        """It gets a gradient: it requires grad and is of a float dtype."""
        return self.requires_grad and self.dtype.is_floating_point


@dataclasses.dataclass
class Captured:
    """The normalised graph of a model and what later passes need to know about the model."""

    gm: fx.GraphModule
    """The graph module; owns the model's parameters and buffers under their original names."""
    method: str
    """'symbolic_trace' or 'export'."""
    params: dict[str, ParamInfo]
    """Parameter groups by canonical name, in ``named_parameters`` order."""
    state_keys: tuple[str, ...]
    """Keys of ``model.state_dict()``, in order."""
    alias_to_name: dict[str, str]
    """Every parameter name (canonical or alias) to its canonical name."""
    materialize_device: torch.device | None = None
    """For a model on the meta device: where its tensors will be materialised, which the
    graph's tensor factories name when export captured it; None for other models."""
    splits: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Parameters split into parts (``passes.split_linear.SplitSpec`` by original name); their
    parts replace them in ``params``."""


class _ParamTracer(fx.Tracer):
    """Traces through every module that owns parameters, so parameters become get_attr nodes.

    Buffers are proxied too, so an expression on a buffer stays in the graph instead of being
    frozen into a constant.
    """

    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        owns_params = next(m.parameters(recurse=False), None) is not None
        return super().is_leaf_module(m, module_qualified_name) and not owns_params


def is_on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return isinstance(model, nn.Module) and any(
        t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def as_input_tuple(example_inputs: Any) -> tuple[Any, ...]:
    """Accept a tuple/list of inputs or a single tensor."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise InputError(
        f"example_inputs must be a tuple of the model's positional inputs or a single tensor, "
        f"got {type(example_inputs).__name__}; wrap it: compile_osdp(model, (x,))"
    )


def capture(model: nn.Module, example_inputs: tuple[Any, ...], *,
            device: torch.device | str = "cpu",
            compute_dtype: torch.dtype | None = None) -> Captured:
    """Capture ``model`` on ``example_inputs`` and normalise it (see the module docstring).

    A model on the meta device is run on meta inputs. If it cannot run there eagerly (its
    forward asks for a value, as Hugging Face models do), it is captured by torch.export alone,
    and the meta device that export writes into the graph's tensor factories (``arange``,
    ``to``, ...) is replaced by ``device``, where the model's tensors will be materialised.

    Every bitsandbytes ``Linear4bit`` (nf4) of ``model`` is first replaced, in place and under
    its name, by a ``BnbLinear4bit``, and every ``nn.Linear`` whose weight is a torchao
    ``NF4Tensor`` by an ``AONF4Linear`` (``passes/quantized.py``): the user's model holds them
    afterwards, and still runs eagerly with the same outputs.

    ``compute_dtype``: the dtype mixed precision will compute in, if any. torch.export then
    traces the model with its floating parameters and inputs in that dtype, as it will compute
    ([Note: conversions in low precision], ``passes/precision.py``).
    """
    if not isinstance(model, nn.Module):
        raise InputError(
            f"compile_osdp needs a torch.nn.Module, got {type(model).__name__}; "
            "wrap your function in an nn.Module whose parameters are attributes"
        )
    replace_bnb_linears(model)  # before any forward: bitsandbytes repacks on a no-grad one
    replace_ao_nf4_linears(model)
    _check_plain_tensors(model)
    on_meta = is_on_meta(model)
    rejection = _rejection(model, example_inputs)
    if rejection is None:
        gm, method = _trace(model, example_inputs, compute_dtype)
    elif on_meta:
        gm, method = _export(model, example_inputs, rejection, compute_dtype), "export"
    else:
        raise rejection
    if on_meta and method == "export":
        _retarget_meta_device(gm, torch.device(device))
    captured = _normalize(model, gm, method)
    if on_meta:
        captured.materialize_device = torch.device(device)
    return captured


@contextlib.contextmanager
def unchanged_state(module: nn.Module) -> Iterator[None]:
    """Run trial forwards without a trace: restore buffers (BatchNorm statistics) and the RNG."""
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    rng = torch.get_rng_state()
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.set_rng_state(rng)


def _check_plain_tensors(model: nn.Module) -> None:
    """Refuse a parameter or buffer that is a tensor subclass (a ``DTensor``, a torchao
    ``NF4Tensor`` anywhere but as an ``nn.Linear``'s weight): osdp-fx broadcasts, shards and
    gathers plain tensors."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            if type(t.data) is not torch.Tensor:
                raise InputError(
                    f"{kind} {name!r} is a {type(t.data).__name__}, a tensor subclass; osdp-fx "
                    "shards, gathers and broadcasts plain tensors only. Store a quantized "
                    "weight in its packed form as a plain parameter (for example int8 or "
                    "uint8 with requires_grad=False) with its scales beside it, and dequantize "
                    "it in forward: it is then sharded and gathered packed "
                    "(docs/finetuning.md, 'Quantized weights'). A bitsandbytes Linear4bit and "
                    "an nn.Linear whose weight is a torchao NF4Tensor are taken as they are")


def _rejection(model: nn.Module, example_inputs: tuple[Any, ...]) -> InputError | None:
    """The error to raise if the model's forward rejects the example inputs, else None."""
    try:
        with torch.no_grad(), unchanged_state(model):
            model(*example_inputs)
    except Exception as exc:  # the user's model rejected the user's inputs
        error = InputError(
            f"{type(model).__name__} rejected the example inputs "
            f"({_describe(example_inputs)}): {type(exc).__name__}: {exc}. Pass example_inputs "
            "as a tuple of the positional arguments the model's forward accepts, for one rank's "
            "batch" + (META_REJECTED if is_on_meta(model) else "")
        )
        error.__cause__ = exc
        return error
    return None


def _retarget_meta_device(gm: fx.GraphModule, device: torch.device) -> None:
    """Replace the meta device in the arguments of ``gm``'s nodes by ``device``.

    Before (a model on the meta device, captured by export)::

        arange = torch.ops.aten.arange.default(16, device=device(type='meta'), pin_memory=False)

    After (``device="cpu"``)::

        arange = torch.ops.aten.arange.default(16, device=device(type='cpu'), pin_memory=False)
    """
    def retarget(value: Any) -> Any:
        if isinstance(value, torch.device) and value.type == "meta":
            return device
        return value

    # export nests graph modules (e.g. the body of a wrap_with_set_grad_enabled region)
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                node.args = fx.node.map_aggregate(node.args, retarget)
                node.kwargs = fx.node.map_aggregate(node.kwargs, retarget)
            module.recompile()


def _describe(inputs: tuple[Any, ...]) -> str:
    parts = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"Tensor{tuple(x.shape)}:{str(x.dtype).replace('torch.', '')}")
        else:
            parts.append(type(x).__name__)
    return ", ".join(parts) or "no inputs"


def _trace(model: nn.Module, example_inputs: tuple[Any, ...],
           compute_dtype: torch.dtype | None) -> tuple[fx.GraphModule, str]:
    try:
        tracer = _ParamTracer()
        graph = tracer.trace(model)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        return gm, "symbolic_trace"
    except Exception as exc:
        fx_reason = _reason(exc)
        log.info("symbolic_trace failed (%s); trying torch.export", fx_reason)
    try:
        return _export_in(model, example_inputs, compute_dtype), "export"
    except Exception as exc:
        raise CaptureError(
            f"could not capture {type(model).__name__} as a graph.\n"
            f"  torch.fx.symbolic_trace: {fx_reason}\n"
            f"  torch.export.export(strict=False): {_reason(exc)}\n"
            + (_CACHE_FIX if "Cache'> in output" in str(exc) else
               "Make the failing line traceable (no Python control flow on tensor values, no "
               "data-dependent shapes), or move it out of the model's forward.")
        ) from exc


_CACHE_FIX = (
    "The model returns a key/value cache for generation (a transformers Cache), which a graph "
    "cannot output: for training, turn it off with model.config.use_cache = False before "
    "compile_osdp (or pass use_cache=False in example_kwargs and in every call).")


def _export(model: nn.Module, example_inputs: tuple[Any, ...], rejection: InputError,
            compute_dtype: torch.dtype | None) -> fx.GraphModule:
    """Capture a meta-device model that cannot run eagerly with torch.export; if export fails
    too, the inputs (or the model's use of values) are the problem: raise ``rejection``."""
    try:
        return _export_in(model, example_inputs, compute_dtype)
    except Exception as exc:
        raise InputError(f"{rejection}; torch.export failed too: {_reason(exc)}") from exc


def _export_program(model: nn.Module,
                    example_inputs: tuple[Any, ...]) -> torch.export.ExportedProgram:
    """``torch.export.export`` of the model, non-strict, batch and sequence dynamic."""
    return torch.export.export(model, example_inputs, strict=False,
                               dynamic_shapes=dynamic_shapes(example_inputs, model.forward))


def _export_module(model: nn.Module, example_inputs: tuple[Any, ...]) -> fx.GraphModule:
    with unchanged_state(model):
        gm = _export_program(model, example_inputs).module()
    # ExportedProgram.module() binds train() and eval() (which only raise) to the module itself,
    # a reference cycle that would keep a dropped compiled model's tensors until Python's
    # collector runs; OSDPModule.train switches modes itself.
    for name in ("train", "eval"):
        gm.__dict__.pop(name, None)
    return gm


def _export_in(model: nn.Module, example_inputs: tuple[Any, ...],
               compute_dtype: torch.dtype | None) -> fx.GraphModule:
    """torch.export's graph of ``model``. Under mixed precision (``compute_dtype``) the model is
    traced with its floating parameters and inputs in that dtype, as it will compute, and each
    dtype conversion of the graph is marked with whether it converts to that dtype ([Note:
    conversions in low precision], ``passes/precision.py``); where that trace fails, the model
    is traced as it is, and the conversions take the precision pass's other rules."""
    if compute_dtype is not None:
        inputs = tuple(cast_input(x, compute_dtype) for x in example_inputs)
        try:
            with _parameters_in(model, compute_dtype):
                gm = _export_module(model, inputs)
        except Exception as exc:  # noqa: BLE001 - traced as it is below
            log.info("tracing in %s failed (%s); tracing the model as it is", compute_dtype,
                     _reason(exc))
        else:
            for module in gm.modules():
                if isinstance(module, fx.GraphModule):
                    for node in module.graph.nodes:
                        if node.op == "call_function" and node.target in CONVERSIONS:
                            set_osdp_meta(node, converts_to_compute_dtype=(
                                conversion_dtype(node) == compute_dtype))
            return gm
    return _export_module(model, example_inputs)


@contextlib.contextmanager
def _parameters_in(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """``model``'s floating parameters holding uninitialised data of ``dtype`` on their device
    (tracing reads shapes and dtypes alone: on the CPU those pages are never touched, on a GPU
    they are held until the trace ends), their own data put back on exit. The parameters stay
    the same objects, so ties and references hold; the device stays too, as a model's code may
    take other paths on another. A 4-bit layer's parameters, read in their stored dtypes,
    stay."""
    kept = {id(p) for m in model.modules() if isinstance(m, (BnbLinear4bit, AONF4Linear))
            for p in m.parameters()}
    swapped = [(p, p.data) for p in model.parameters()
               if p.is_floating_point() and id(p) not in kept]
    try:
        for p, data in swapped:
            p.data = torch.empty(data.shape, dtype=dtype, device=data.device)
        yield
    finally:
        for p, data in swapped:
            p.data = data


def dynamic_shapes(example_inputs: tuple[Any, ...],
                   forward: Callable[..., Any] | None = None) -> tuple[Any, ...]:
    """torch.export's ``dynamic_shapes`` for positional inputs: the batch (dimension 0) and
    sequence (dimension 1) of every tensor are ``Dim.AUTO``, so one graph takes any batch size
    and sequence length; a dimension the model fixes (a size of 1 in the example, a feature
    dimension a weight fixes) stays static ([Note: input shapes] in ``core/io_spec.py``). Where
    ``forward`` takes ``*args`` (a peft ``PeftModel``'s does), the inputs it collects are one
    tuple of specs, as torch.export matches them to the signature."""
    auto = torch.export.Dim.AUTO
    specs = tuple({d: auto for d in range(min(x.dim(), 2))} if isinstance(x, torch.Tensor)
                  else None for x in example_inputs)
    if forward is None:
        return specs
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for i, param in enumerate(inspect.signature(forward).parameters.values()):
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            return (*specs[:i], specs[i:])
        if param.kind not in positional:
            break
    return specs


def _reason(exc: BaseException) -> str:
    """The exception and the innermost frame of user code where it was raised."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if "/torch/" not in f.filename and "/osdp_fx/" not in f.filename
    ]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first_line}{where}"


def _normalize(model: nn.Module, gm: fx.GraphModule, method: str) -> Captured:
    named = list(model.named_parameters(remove_duplicate=False))
    canonical_by_id: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    for name, p in named:
        canon = canonical_by_id.setdefault(id(p), name)
        if canon != name:
            aliases[canon].append(name)
        else:
            aliases[name] = []
    alias_to_name = {name: canonical_by_id[id(p)] for name, p in named}
    params = {
        canon: ParamInfo(
            name=canon, aliases=tuple(aliases[canon]), shape=tuple(p.shape), dtype=p.dtype,
            requires_grad=p.requires_grad,
        )
        for canon, p in ((c, model.get_parameter(c)) for c in aliases)
    }

    # One get_attr node per parameter group, targeting the canonical name.
    kept: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or node.target not in alias_to_name:
            continue
        canon = alias_to_name[node.target]
        if canon in kept:
            node.replace_all_uses_with(kept[canon])
            gm.graph.erase_node(node)
        elif not node.users:
            gm.graph.erase_node(node)
        else:
            node.target = canon
            kept[canon] = node
            set_osdp_meta(node, role=NodeRole.PARAM, param=canon)

    # The graph module owns exactly the model's parameters and buffers, under original names.
    for module in gm.modules():
        for pname in list(module._parameters):
            del module._parameters[pname]
    for canon in params:
        set_attr(gm, canon, model.get_parameter(canon))
    for bname, buf in model.named_buffers():
        if not _has_attr(gm, bname):
            set_attr(gm, bname, buf, buffer=True)

    gm.graph.lint()
    gm.recompile()
    log.info(
        "captured %s with %s: %d nodes, %d parameter groups (%d tied)", type(model).__name__,
        method, len(gm.graph.nodes), len(params), sum(bool(p.aliases) for p in params.values()),
    )
    properties(gm).add("normalized")  # what the passes of passes/pipeline.py require
    return Captured(
        gm=gm, method=method, params=params, state_keys=tuple(model.state_dict().keys()),
        alias_to_name=alias_to_name,
    )


def _has_attr(root: nn.Module, qualname: str) -> bool:
    obj: Any = root
    for part in qualname.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def set_attr(root: nn.Module, qualname: str, value: torch.Tensor, *, buffer: bool = False) -> None:
    """Set ``root.<qualname>`` to a parameter or buffer, creating empty parent modules."""
    *path, leaf = qualname.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(value, nn.Parameter):
        module._parameters[leaf] = value
    elif buffer:
        module.register_buffer(leaf, value)
    else:
        setattr(module, leaf, value)

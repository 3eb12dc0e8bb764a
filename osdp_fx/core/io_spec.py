"""What a compiled model is called with: keyword inputs, and the shapes its plan covers.

[Note: keyword inputs] ``compile_osdp(model, args, example_kwargs={...})`` binds the example's
positional and keyword arguments to the names of ``model.forward``'s parameters (in the
signature's order). Tensor arguments become the graph's inputs, in that order; other values
(``return_dict=True``, ``use_cache=False``) are constants of the capture. The model is captured
through :func:`keyword_forward`, a module whose ``forward`` takes those tensors positionally and
calls ``model.forward`` with them by name; it shares the model's modules, parameters and
buffers (so every name stays the model's own). A compiled module binds each call the same way
(:meth:`InputSpec.flatten`): the same arguments must be present, non-tensor values must be
equal, and an argument absent from the example (an ``attention_mask``) must stay absent, since
the graph was captured without it. Outputs keep the model's structure: ``torch.export`` returns
them through its output pytree spec (a Hugging Face ``ModelOutput`` is a registered pytree
node), ``symbolic_trace`` keeps the model's own return expression.

[Note: input shapes] One graph serves every batch size and sequence length the model accepts:
``torch.export`` captures with dynamic batch (dimension 0) and sequence (dimension 1)
dimensions (``Dim.AUTO``: a dimension the model fixes stays fixed), and ``symbolic_trace``
graphs read sizes at run time. The plan is made for the largest per-rank shape declared
(``compile_osdp(max_shape=(batch, seq))``, default the example's), and its memory prediction is
a function of both. :class:`ShapeGuard` checks every call whose shape is larger in either
dimension against that prediction before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import keyword
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import InputError
from ..units import format_bytes


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """How a call's arguments map to the graph's inputs."""

    names: tuple[str, ...] | None
    """The forward's arguments the graph takes, in signature order; None: the model was
    compiled from positional inputs only and is called with them as they are."""
    constants: tuple[tuple[str, Any], ...] = ()
    """Non-tensor arguments of the example, fixed in the capture: (name, value)."""
    signature: inspect.Signature | None = dataclasses.field(default=None, compare=False)
    """``model.forward``'s signature, to bind calls with."""
    num_positional: int = 0
    """Positional example inputs (compiled from positional inputs only)."""

    def flatten(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """The graph's positional inputs for a call; InputError if the call does not match."""
        if self.names is None:
            if kwargs:
                raise InputError(
                    f"the model was compiled from positional inputs only, so it takes no keyword "
                    f"arguments (got {', '.join(sorted(kwargs))}): pass example_kwargs to "
                    "compile_osdp with the keywords you call it with")
            if len(args) != self.num_positional:
                raise InputError(
                    f"the model was compiled with {self.num_positional} positional inputs and "
                    f"called with {len(args)}: call it with the inputs it was compiled with")
            return args
        assert self.signature is not None
        given = _bind(self.signature, args, kwargs)
        expected = set(self.names) | {n for n, _ in self.constants}
        if set(given) != expected:
            extra, missing = sorted(set(given) - expected), sorted(expected - set(given))
            raise InputError(
                "the compiled model takes the arguments it was compiled with ("
                + ", ".join(sorted(expected)) + ")"
                + (f"; got {', '.join(extra)}, absent from the example, so the graph was "
                   "captured without them: compile with them in example_kwargs" if extra else "")
                + (f"; missing {', '.join(missing)}: pass them as in the example" if missing
                   else ""))
        for name, value in self.constants:
            if not _same(given[name], value):
                raise InputError(
                    f"{name}={given[name]!r}, but the model was compiled with {name}={value!r}, "
                    "a constant of the captured graph: pass the same value, or compile again")
        return tuple(given[n] for n in self.names)


def _bind(signature: inspect.Signature, args: tuple[Any, ...],
          kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments by name; the entries of a ``**kwargs`` parameter by their own names."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise InputError(f"the model's forward does not accept these arguments: {exc}") from exc
    out: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise InputError(
                    f"the model's forward takes *{name}, which keyword capture cannot name: pass "
                    "those inputs positionally without example_kwargs")
        else:
            out[name] = value
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values without a plain equality
        return a is b


class _KeywordForward(nn.Module):
    """Calls a model's forward by keyword; shares its modules, parameters and buffers."""

    def __init__(self, model: nn.Module, call: Callable[..., Any]) -> None:
        super().__init__()
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        object.__setattr__(self, "_call", call)


def bind_example(model: nn.Module, example_inputs: tuple[Any, ...],
                 example_kwargs: Mapping[str, Any] | None) -> tuple[InputSpec, nn.Module,
                                                                    tuple[Any, ...]]:
    """(the input spec, the module to capture, its positional example inputs).

    Without ``example_kwargs`` that is ``model`` itself and its inputs. With them, the
    tensors of the bound example in signature order, and a module that calls ``model.forward``
    with them by name (see [Note: keyword inputs])."""
    if not example_kwargs:
        return InputSpec(None, num_positional=len(example_inputs)), model, example_inputs
    if not isinstance(example_kwargs, Mapping):
        raise InputError(f"example_kwargs must be a dict of keyword arguments, got "
                         f"{type(example_kwargs).__name__}")
    signature = inspect.signature(model.forward)
    given = _bind(signature, example_inputs, example_kwargs)
    names = tuple(n for n, v in given.items() if isinstance(v, torch.Tensor))
    constants = tuple((n, v) for n, v in given.items() if not isinstance(v, torch.Tensor))
    bad = [n for n in names if not n.isidentifier() or keyword.iskeyword(n)]
    if bad:
        raise InputError(f"keyword inputs {bad} are not Python names; pass them positionally")
    call = functools.partial(model.forward, **dict(constants))
    params = ", ".join(names)
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {params}):\n"  # noqa: S102 (names checked above)
         f"    return self._call({', '.join(f'{n}={n}' for n in names)})\n", namespace)
    cls = type(type(model).__name__, (_KeywordForward,), {"forward": namespace["forward"]})
    spec = InputSpec(names, constants, signature)
    return spec, cls(model, call), tuple(given[n] for n in names)


def input_shape(inputs: tuple[Any, ...]) -> tuple[int, int | None]:
    """(batch, sequence length) of positional graph inputs: dimension 0 of the first tensor, and
    dimension 1 of the first tensor with two dimensions or more (None if there is none)."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0]
    batch = int(tensors[0].shape[0]) if tensors else 1
    seq = next((int(x.shape[1]) for x in tensors if x.dim() >= 2), None)
    return batch, seq


@dataclasses.dataclass(frozen=True)
class ShapeGuard:
    """Refuses a call whose predicted peak memory exceeds the limit, before it runs."""

    max_batch: int
    """Largest per-rank batch the plan was made for."""
    max_seq: int | None
    """Largest sequence length the plan was made for (None: not modelled)."""
    limit_bytes: int
    """The per-rank memory limit."""
    peak_bytes_at: Callable[[int, int | None], int] = dataclasses.field(compare=False)
    """Predicted peak bytes at (batch, sequence length)."""

    def check(self, inputs: tuple[Any, ...]) -> None:
        """InputError naming the shape, the prediction and the limit if the call's shape is
        larger than the plan's and its predicted peak exceeds the limit. It reads only this
        rank's shape (no collective); every rank given the same shape decides the same."""
        batch, seq = input_shape(inputs)
        if batch <= self.max_batch and (seq is None or self.max_seq is None
                                        or seq <= self.max_seq):
            return
        peak = self.peak_bytes_at(batch, seq if self.max_seq is not None else None)
        if peak > self.limit_bytes:
            shape = f"batch {batch}" + (f" x sequence {seq}" if seq is not None else "")
            planned = f"batch {self.max_batch}" + (
                f" x sequence {self.max_seq}" if self.max_seq is not None else "")
            raise InputError(
                f"an input of {shape} per rank is predicted to need {format_bytes(peak)} per "
                f"rank, over the memory limit of {format_bytes(self.limit_bytes)} (the plan was "
                f"made for at most {planned}); nothing ran. Split the batch, truncate the "
                "sequences, or compile with max_shape= set to the largest shape you feed "
                "(the search then plans for it)")


def check_max_shape(max_shape: Any) -> tuple[int, int | None] | None:
    """``max_shape`` as (batch, sequence length or None); InputError if it is not one."""
    if max_shape is None:
        return None
    shape = tuple(max_shape) if isinstance(max_shape, (tuple, list)) else (max_shape,)
    if not 1 <= len(shape) <= 2 or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise InputError(
            f"max_shape={max_shape!r} is not a shape: pass (batch, sequence length), the "
            "largest per-rank batch size and sequence length you will feed (or (batch,))")
    return shape[0], (shape[1] if len(shape) == 2 else None)


@dataclasses.dataclass(frozen=True)
class CallCheck:
    """What a compiled module does with a call's arguments before anything runs."""

    spec: InputSpec
    """How the call maps to the graph's inputs."""
    guard: ShapeGuard | None
    """Checks the call's shape against the memory limit (None: no prediction to check)."""

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """The graph's positional inputs; InputError for a call that does not fit."""
        flat = self.spec.flatten(args, kwargs)
        if self.guard is not None:
            self.guard.check(flat)
        return flat

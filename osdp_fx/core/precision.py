"""Mixed precision: parameters kept and optimised in their own dtype (fp32), computed in a lower
one (bf16 or fp16), gradients reduced in ``reduce_dtype`` (fp32 unless asked otherwise).

As with FSDP2's ``MixedPrecisionPolicy``: floating parameters are cast to ``param_dtype`` where
the graph reads them (a sharded parameter's shard is cast before its all-gather, so the
collective moves half the bytes), floating inputs of the forward are cast to ``param_dtype``,
buffers and the outputs are left as they are, and gradients reach the fp32 parameters (shards)
after a reduction in ``reduce_dtype``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import InputError

_SHORT = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Compute in ``param_dtype``; reduce gradients in ``reduce_dtype``."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32


def resolve_mixed_precision(value: Any) -> MixedPrecision | None:
    """``compile_osdp``'s ``mixed_precision`` argument as a MixedPrecision (or None)."""
    if value is None or isinstance(value, MixedPrecision):
        ok = value is None or all(d.is_floating_point for d in (value.param_dtype, value.reduce_dtype))
        if ok:
            return value
    elif isinstance(value, str) and value in _SHORT:
        return MixedPrecision(param_dtype=_SHORT[value])
    elif isinstance(value, torch.dtype) and value.is_floating_point:
        return MixedPrecision(param_dtype=value)
    raise InputError(
        f"mixed_precision must be None, 'bf16', 'fp16', a floating torch.dtype or "
        f"osdp_fx.MixedPrecision(param_dtype=..., reduce_dtype=...); got {value!r}"
    )


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """torch.bfloat16 for 'bfloat16'."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise InputError(f"unknown dtype {name!r}; use e.g. 'bfloat16', 'float16' or 'float32'")
    return dtype


def cast_param(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating parameter in the compute dtype (differentiable: the gradient comes back in the
    parameter's own dtype)."""
    return param.to(dtype)


def cast_input(value: Any, dtype: torch.dtype) -> Any:
    """A floating tensor input of the forward in the compute dtype; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


CONVERSIONS = frozenset({torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout,
                         torch.ops.aten.to.device, torch.ops.aten._to_copy.default})
"""The ATen conversions a graph captured by torch.export holds (``x.to(...)``, ``x.float()``)."""


def conversion_dtype(node: Any) -> torch.dtype | None:
    """The dtype a conversion node of :data:`CONVERSIONS` converts to, if it names one."""
    if node.target in (torch.ops.aten.to.dtype, torch.ops.aten.to.device):
        index = 1 if node.target is torch.ops.aten.to.dtype else 2
        if len(node.args) > index and isinstance(node.args[index], torch.dtype):
            return node.args[index]
        return node.kwargs.get("dtype")
    return node.kwargs.get("dtype")

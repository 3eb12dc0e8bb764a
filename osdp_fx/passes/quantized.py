"""bitsandbytes 4-bit (nf4, fp4) and torchao NF4 linears as plain frozen tensors and custom ops
(issue 59).

A ``bitsandbytes.nn.Linear4bit`` keeps its quantization state (the scales) in a Python object
hanging off its weight, which osdp-fx cannot see, shard or broadcast, and its forward does not
survive ``torch.export``. :func:`replace_bnb_linears` (run by capture, before any forward)
replaces each by a :class:`BnbLinear4bit`, in place and under the same name, whose packed weight
and every quant-state tensor are registered frozen parameters (``requires_grad=False``): the
planner plans, shards and gathers them like any frozen group. Its forward is one node,
``torch.ops.osdp.linear_bnb4bit``, whose autograd saves the packed weight and its scales (not the
dequantized weight) and dequantizes again in backward, as bitsandbytes' ``MatMul4Bit`` does.

One 4-bit weight ``W [N, K]`` (blocks of ``blocksize`` consecutive row-major elements):

=================  =========  ==========================  ==========================
parameter          dtype      shape                       what
=================  =========  ==========================  ==========================
``weight``         uint8      ``[N*K/2, 1]``              two codes a byte, high nibble first
``absmax``         float32    ``[N*K/blocksize]``         one scale a block
nested (double quantization): ``absmax`` is uint8 codes of ``scale - offset``, and
``absmax2``        float32    ``[ceil(N*K/blocksize/256)]``  a scale per 256 codes
``absmax_code``    float32    ``[256]``                   bitsandbytes' dynamic 8-bit map
``absmax_offset``  float32    ``[]``                      the mean scale
=================  =========  ==========================  ==========================

The op reads these in their stored dtypes, so the mixed-precision pass leaves a parameter whose
every user is this op uncast (:func:`reads_stored_dtype`, ``passes/precision.py``).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from ..errors import InputError

NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230492591858, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
FP4_CODE = (0.0, 1 / 192, 2 / 3, 1.0, 1 / 3, 0.5, 1 / 6, 0.25,
            0.0, -1 / 192, -2 / 3, -1.0, -1 / 3, -0.5, -1 / 6, -0.25)
"""bitsandbytes' fp4 values, the exact fractions its kernels compute (its Python table rounds
them to four decimals)."""
CODES = {"nf4": NF4_CODE, "fp4": FP4_CODE}


def _blockwise(values: Tensor, scales: Tensor, block: int) -> Tensor:
    """``values[i] * scales[i // block]`` in float32 (the last block may be short)."""
    n = values.numel()
    full = n - n % block
    out = torch.empty(n, dtype=torch.float32, device=values.device)
    out[:full] = (values[:full].view(-1, block) * scales[: full // block].view(-1, 1)).reshape(-1)
    if full < n:
        out[full:] = values[full:] * scales[full // block]
    return out


def dequantize_bnb4bit(weight: Tensor, absmax: Tensor, absmax2: Tensor | None,
                       absmax_code: Tensor | None, absmax_offset: Tensor | None, blocksize: int,
                       shape: tuple[int, int] | list[int], dtype: torch.dtype,
                       quant_type: str = "nf4") -> Tensor:
    """The weight of ``shape`` in ``dtype`` (``quant_type`` "nf4" or "fp4"): bitsandbytes' own
    ``functional.dequantize_4bit`` where bitsandbytes is installed (its kernels: on the CPU
    several times faster than the portable :func:`dequantize_bnb4bit_torch`, to which it is
    bitwise equal), else that one."""
    torch._check(absmax.dtype in (torch.float32, torch.uint8),
                 lambda: f"NF4 absmax must stay float32 or uint8, got {absmax.dtype}")
    torch._check(absmax2 is None or absmax2.dtype == torch.float32,
                 lambda: f"NF4 absmax2 must stay float32, got {absmax2.dtype}")
    functional = _bnb_functional()
    if functional is None:
        return dequantize_bnb4bit_torch(weight, absmax, absmax2, absmax_code, absmax_offset,
                                        blocksize, shape, dtype, quant_type)
    code = _code(quant_type, weight.device)
    nested = None
    if absmax2 is not None:
        nested = functional.QuantState(absmax=absmax2, code=absmax_code, blocksize=256,
                                       dtype=torch.float32)
    state = functional.QuantState(
        absmax=absmax, shape=torch.Size(shape), code=code, blocksize=blocksize,
        quant_type=quant_type, dtype=dtype, offset=absmax_offset, state2=nested)
    packed = weight if weight.dtype == torch.uint8 else weight.view(torch.uint8)
    return functional.dequantize_4bit(packed.reshape(-1, 1), state)


@functools.cache
def _bnb_functional() -> Any:
    """``bitsandbytes.functional``, or None where bitsandbytes is not installed."""
    try:
        import bitsandbytes.functional as functional
    except ImportError:
        return None
    return functional


@functools.cache
def _code(quant_type: str, device: torch.device) -> Tensor:
    return torch.tensor(CODES[quant_type], dtype=torch.float32, device=device)


@functools.cache
def _pairs(quant_type: str, device: torch.device) -> Tensor:
    """The two code values of each of the 256 bytes, high nibble first: ``[256, 2]``."""
    code = _code(quant_type, device)
    return torch.stack((code.repeat_interleave(16), code.repeat(16)), dim=1)


def dequantize_bnb4bit_torch(weight: Tensor, absmax: Tensor, absmax2: Tensor | None,
                             absmax_code: Tensor | None, absmax_offset: Tensor | None,
                             blocksize: int, shape: tuple[int, int] | list[int],
                             dtype: torch.dtype, quant_type: str = "nf4") -> Tensor:
    """:func:`dequantize_bnb4bit` in plain PyTorch, bitwise equal to bitsandbytes'
    ``functional.dequantize_4bit`` (float32 arithmetic, then the cast): each byte looked up
    as its two code values at once."""
    n = math.prod(shape)
    scales = absmax
    if absmax2 is not None:
        assert absmax_code is not None and absmax_offset is not None
        codes = torch.index_select(absmax_code.float(), 0, absmax.reshape(-1).int())
        scales = _blockwise(codes, absmax2.float(), 256) + absmax_offset.float()
    flat = weight.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    values = torch.index_select(_pairs(quant_type, weight.device), 0, flat.int()).view(-1)[:n]
    return _blockwise(values, scales.reshape(-1).float(), blocksize).view(*shape).to(dtype)


@torch.library.custom_op("osdp::linear_bnb4bit", mutates_args=())
def linear_bnb4bit(x: Tensor, weight: Tensor, absmax: Tensor, absmax2: Tensor | None,
                   absmax_code: Tensor | None, absmax_offset: Tensor | None, blocksize: int,
                   out_features: int, in_features: int, quant_type: str) -> Tensor:
    """``F.linear(x, W)`` with ``W`` the dequantized 4-bit (nf4 or fp4) weight, in ``x``'s
    dtype."""
    w = dequantize_bnb4bit(weight, absmax, absmax2, absmax_code, absmax_offset, blocksize,
                           (out_features, in_features), x.dtype, quant_type)
    return F.linear(x, w)


@linear_bnb4bit.register_fake
def _linear_bnb4bit_fake(x: Tensor, weight: Tensor, absmax: Tensor, absmax2: Tensor | None,
                         absmax_code: Tensor | None, absmax_offset: Tensor | None,
                         blocksize: int, out_features: int, in_features: int,
                         quant_type: str) -> Tensor:
    torch._check(x.shape[-1] == in_features)
    torch._check(weight.numel() * 2 >= out_features * in_features)
    return x.new_empty((*x.shape[:-1], out_features))


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    _, weight, absmax, absmax2, code, offset, blocksize, n, k, quant_type = inputs
    ctx.meta = (blocksize, n, k, absmax2 is not None, quant_type)
    # the packed weight and its scales, not the dequantized weight (4x the bytes)
    ctx.save_for_backward(weight, absmax, *((absmax2, code, offset) if absmax2 is not None else ()))


def _backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    blocksize, n, k, nested, quant_type = ctx.meta
    weight, absmax, *rest = ctx.saved_tensors
    absmax2, code, offset = rest if nested else (None, None, None)
    w = dequantize_bnb4bit(weight, absmax, absmax2, code, offset, blocksize, (n, k), grad.dtype,
                           quant_type)
    grad_x = grad @ w if ctx.needs_input_grad[0] else None
    return (grad_x,) + (None,) * 9


linear_bnb4bit.register_autograd(_backward, setup_context=_setup_context)



def dequantize_ao_nf4(quantized_data: Tensor, quantized_scalers: Tensor,
                      quantization_factor: Tensor, scaler_mean: Tensor, nf4: Tensor,
                      block_size: int, scaler_block_size: int,
                      shape: tuple[int, int] | list[int]) -> Tensor:
    """The weight of ``shape`` in the NF4 table's dtype, bitwise equal to torchao's
    ``NF4Tensor.get_original_weight()``: the codes two a byte (high nibble first) looked up in
    ``nf4``, each block of ``block_size`` scaled by its scaler, the scalers themselves int8
    codes of ``scaler - scaler_mean`` in blocks of ``scaler_block_size`` with a factor each."""
    first = nf4[(quantized_data >> 4).to(torch.long)]
    second = nf4[(quantized_data & 0b1111).to(torch.long)]
    blocks = quantized_scalers.numel() // scaler_block_size
    scalers = (quantized_scalers.view(blocks, scaler_block_size)
               / quantization_factor.unsqueeze(-1)).flatten().to(nf4.dtype) + scaler_mean
    repeated = scalers.unsqueeze(-1).expand(scalers.size(0), block_size // 2).flatten()
    scaled_first = (first * repeated).unsqueeze(-1).transpose(0, 1)
    scaled_second = (second * repeated).unsqueeze(-1).transpose(0, 1)
    return torch.stack([scaled_first, scaled_second], dim=-1).reshape(shape)


@torch.library.custom_op("osdp::linear_ao_nf4", mutates_args=())
def linear_ao_nf4(x: Tensor, quantized_data: Tensor, quantized_scalers: Tensor,
                  quantization_factor: Tensor, scaler_mean: Tensor, nf4: Tensor,
                  block_size: int, scaler_block_size: int, out_features: int,
                  in_features: int) -> Tensor:
    """``F.linear(x, W.to(x.dtype))`` with ``W`` the dequantized torchao NF4 weight, as
    torchao's ``linear_nf4``."""
    w = dequantize_ao_nf4(quantized_data, quantized_scalers, quantization_factor, scaler_mean,
                          nf4, block_size, scaler_block_size, (out_features, in_features))
    return F.linear(x, w.to(x.dtype))


@linear_ao_nf4.register_fake
def _linear_ao_nf4_fake(x: Tensor, quantized_data: Tensor, quantized_scalers: Tensor,
                        quantization_factor: Tensor, scaler_mean: Tensor, nf4: Tensor,
                        block_size: int, scaler_block_size: int, out_features: int,
                        in_features: int) -> Tensor:
    torch._check(x.shape[-1] == in_features)
    torch._check(quantized_data.numel() * 2 == out_features * in_features)
    return x.new_empty((*x.shape[:-1], out_features))


def _ao_setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    ctx.meta = inputs[6:]
    # the packed weight and its scalers, not the dequantized weight
    ctx.save_for_backward(*inputs[1:6])


def _ao_backward(ctx, grad: Tensor):  # noqa: ANN001, ANN202
    block_size, scaler_block_size, n, k = ctx.meta
    w = dequantize_ao_nf4(*ctx.saved_tensors, block_size, scaler_block_size, (n, k))
    grad_x = grad @ w.to(grad.dtype) if ctx.needs_input_grad[0] else None
    return (grad_x,) + (None,) * 9


linear_ao_nf4.register_autograd(_ao_backward, setup_context=_ao_setup_context)

_STORED_DTYPE_OPS = (torch.ops.osdp.linear_bnb4bit.default, torch.ops.osdp.linear_ao_nf4.default)


def _format(user: fx.Node) -> str | None:
    """The 4-bit format an operator reads its quantized parameters in, or None."""
    if user.op != "call_function":
        return None
    if user.target is torch.ops.osdp.linear_bnb4bit.default:
        return f"{user.args[9]}, bitsandbytes"
    if user.target is torch.ops.osdp.linear_ao_nf4.default:
        return "nf4, torchao"
    return None


def quantized_format(node: fx.Node) -> str:
    """The 4-bit format a parameter node is stored in ("nf4, bitsandbytes", "fp4,
    bitsandbytes", "nf4, torchao"), where every user is the op that reads it; "" for any other
    parameter."""
    formats = {_format(u) for u in node.users}
    return (formats.pop() or "") if len(formats) == 1 else ""


def reads_stored_dtype(node: fx.Node) -> bool:
    """Whether every user of parameter node ``node`` is a quantized op that reads it in its
    stored dtype (an NF4 weight's scales): mixed precision must not cast it."""
    return bool(node.users) and all(u.op == "call_function" and u.target in _STORED_DTYPE_OPS
                                    for u in node.users)


def _frozen(t: Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t.detach().clone(), requires_grad=False)


class BnbLinear4bit(nn.Module):
    """A bitsandbytes ``Linear4bit`` (nf4 or fp4, ``quant_type``) as plain frozen parameters (the
    module docstring's table) and one ``osdp::linear_bnb4bit`` call. Computes in
    ``compute_dtype`` (the input's when None) and returns the input's dtype, as ``Linear4bit``
    does; the bias stays outside the op and keeps its ``requires_grad``."""

    def __init__(self, weight: Tensor, absmax: Tensor, *, blocksize: int, out_features: int,
                 in_features: int, compute_dtype: torch.dtype | None = None,
                 bias: nn.Parameter | None = None, absmax2: Tensor | None = None,
                 absmax_code: Tensor | None = None, absmax_offset: Tensor | None = None,
                 quant_type: str = "nf4") -> None:
        super().__init__()
        if quant_type not in CODES:
            raise InputError(f"a bitsandbytes 4-bit weight's quant_type is 'nf4' or 'fp4', got "
                             f"{quant_type!r}")
        self.quant_type = quant_type
        self.weight = _frozen(weight)
        self.absmax = _frozen(absmax)
        self.absmax2 = _frozen(absmax2)
        self.absmax_code = _frozen(absmax_code)
        self.absmax_offset = _frozen(absmax_offset)
        self.bias = bias
        self.blocksize, self.out_features, self.in_features = blocksize, out_features, in_features
        self.compute_dtype = compute_dtype

    @classmethod
    def from_bnb(cls, module: nn.Module, name: str = "") -> BnbLinear4bit:
        """The BnbLinear4bit of bitsandbytes ``Linear4bit`` ``module`` (named ``name``)."""
        weight = module.weight
        state = getattr(weight, "quant_state", None) or getattr(module, "quant_state", None)
        if state is None:
            raise InputError(
                f"Linear4bit {name!r} has no quantization state (its weight was never "
                "quantized); load the model with BitsAndBytesConfig(load_in_4bit=True) or move "
                "it to its device before compile_osdp")
        n, k = state.shape
        packed = weight.data
        if packed.dtype != torch.uint8 and packed.is_contiguous():
            # bnb_4bit_quant_storage=bfloat16 and the like (the FSDP-QLoRA recipe): the same
            # bytes held in another dtype
            packed = packed.view(torch.uint8).reshape(-1, 1)
        if getattr(state, "packing_format_for_cpu", False) or tuple(packed.shape) != (
                math.ceil(n * k / 2), 1):
            raise InputError(
                f"Linear4bit {name!r}'s packed weight is in bitsandbytes' CPU layout (shape "
                f"{tuple(weight.shape)}, dtype {weight.dtype}): bitsandbytes repacks it in place "
                "on a CPU forward in eval mode or under no_grad, and osdp-fx reads the standard "
                "layout [N*K/2, 1] uint8. Call compile_osdp before running the model under "
                "no_grad or in eval mode (load it again if it has run)")
        nested = bool(state.nested)
        return cls(packed, state.absmax, blocksize=state.blocksize, out_features=n,
                   in_features=k, compute_dtype=getattr(module, "compute_dtype", None),
                   bias=module.bias,
                   absmax2=state.state2.absmax if nested else None,
                   absmax_code=state.state2.code if nested else None,
                   absmax_offset=state.offset if nested else None,
                   quant_type=state.quant_type)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        y = linear_bnb4bit(x, self.weight, self.absmax, self.absmax2, self.absmax_code,
                           self.absmax_offset, self.blocksize, self.out_features,
                           self.in_features, self.quant_type)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"quant_type={self.quant_type}, blocksize={self.blocksize}, "
                f"nested={self.absmax2 is not None}")


def replace_bnb_linears(model: nn.Module) -> int:
    """Replace every ``bitsandbytes.nn.Linear4bit`` in ``model`` by a :class:`BnbLinear4bit`, in
    place and under its name (a peft LoRA layer around it keeps its ``base_layer``); returns
    how many. Without bitsandbytes imported there is none, and nothing is imported."""
    bnb = sys.modules.get("bitsandbytes")
    linear4bit = getattr(getattr(bnb, "nn", None), "Linear4bit", None)
    if linear4bit is None:
        return 0
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, linear4bit):
                full = f"{parent_name}.{name}" if parent_name else name
                setattr(parent, name, BnbLinear4bit.from_bnb(child, full))
                count += 1
    return count


class AONF4Linear(nn.Module):
    """A linear whose weight is a torchao ``NF4Tensor`` as plain frozen parameters (its packed
    codes ``quantized_data`` uint8, ``quantized_scalers`` int8, ``quantization_factor``,
    ``scaler_mean`` and the ``nf4`` table in the weight's dtype) and one ``osdp::linear_ao_nf4``
    call, computing in the input's dtype as torchao's ``linear_nf4`` does; the bias stays
    outside the op."""

    def __init__(self, weight: Tensor, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        for name in _AO_NF4_TENSORS:
            setattr(self, name, _frozen(getattr(weight, name)))
        self.block_size, self.scaler_block_size = weight.block_size, weight.scaler_block_size
        self.out_features, self.in_features = weight.shape
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        y = linear_ao_nf4(x, self.quantized_data, self.quantized_scalers,
                          self.quantization_factor, self.scaler_mean, self.nf4, self.block_size,
                          self.scaler_block_size, self.out_features, self.in_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_size={self.block_size}, scaler_block_size={self.scaler_block_size}")


_AO_NF4_TENSORS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean",
                   "nf4")


def is_ao_nf4(t: object) -> bool:
    """Whether ``t`` is a torchao ``NF4Tensor`` (told without importing torchao)."""
    cls = type(t)
    return cls.__name__ == "NF4Tensor" and cls.__module__.startswith("torchao")


def replace_ao_nf4_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose weight is a torchao ``NF4Tensor`` (as
    ``to_nf4`` makes it, and torchtune's ``FrozenNF4Linear``) by an :class:`AONF4Linear`, in
    place and under its name; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and is_ao_nf4(child.weight):
                if child.weight.dim() != 2:
                    raise InputError(
                        f"the NF4Tensor weight of {name!r} has shape {tuple(child.weight.shape)};"
                        " osdp-fx reads 2-d NF4 linear weights only")
                setattr(parent, name, AONF4Linear(child.weight, child.bias))
                count += 1
    return count

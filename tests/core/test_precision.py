"""Mixed precision (osdp_fx/core/precision.py): what ``compile_osdp(mixed_precision=...)``
accepts, dtype names both ways, and the casts of parameters and inputs."""

from __future__ import annotations

import pytest
import torch

from osdp_fx.core.precision import (
    MixedPrecision,
    cast_input,
    cast_param,
    dtype_from_name,
    dtype_name,
    resolve_mixed_precision,
)
from osdp_fx.errors import InputError


@pytest.mark.parametrize(("value", "expected"), [
    (None, None),
    ("bf16", MixedPrecision(torch.bfloat16, torch.float32)),
    ("bfloat16", MixedPrecision(torch.bfloat16, torch.float32)),
    ("fp16", MixedPrecision(torch.float16, torch.float32)),
    ("float16", MixedPrecision(torch.float16, torch.float32)),
    (torch.float16, MixedPrecision(torch.float16, torch.float32)),
    (MixedPrecision(torch.float16, torch.bfloat16), MixedPrecision(torch.float16, torch.bfloat16)),
])
def test_accepted_forms(value, expected):
    assert resolve_mixed_precision(value) == expected


@pytest.mark.parametrize("value", ["fp8", "BF16", torch.int8, 16,
                                   MixedPrecision(torch.bfloat16, torch.int32)])
def test_refused_forms_name_the_accepted_ones(value):
    with pytest.raises(InputError, match="mixed_precision must be None, 'bf16', 'fp16', a "
                                         "floating torch.dtype or osdp_fx.MixedPrecision"):
        resolve_mixed_precision(value)


def test_dtype_names_both_ways():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int64):
        assert dtype_from_name(dtype_name(dtype)) is dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    for bad in ("bf17", "nn"):  # no such attribute; an attribute that is not a dtype
        with pytest.raises(InputError, match=f"unknown dtype '{bad}'"):
            dtype_from_name(bad)


def test_casts():
    param = torch.randn(3, requires_grad=True)
    low = cast_param(param, torch.bfloat16)
    assert low.dtype == torch.bfloat16
    low.float().sum().backward()
    assert param.grad.dtype == torch.float32  # the gradient comes back in the param's dtype
    torch.testing.assert_close(param.grad, torch.ones(3))
    x, ids = torch.randn(2), torch.arange(2)
    assert cast_input(x, torch.float16).dtype == torch.float16
    assert cast_input(ids, torch.float16) is ids and cast_input("text", torch.float16) == "text"

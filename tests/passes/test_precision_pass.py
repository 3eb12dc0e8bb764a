"""The mixed-precision pass on graphs with nested regions (``passes/precision.py``,
[Note: conversions in low precision]): a rotary embedding that reads a float32 buffer inside a
no-grad region and computes inside an autocast-disabled one, as Hugging Face's Qwen2, Gemma and
Phi-3 do. torch.export nests both regions as graph modules with their own dtype assertions."""

from __future__ import annotations

import pytest
import torch
from harness.models import batches, with_loss
from torch import nn

from osdp_fx import Devices, compile_osdp
from osdp_fx.core.node_meta import osdp_meta
from osdp_fx.passes.capture import capture


class Rotary(nn.Module):
    """Features scaled by the cosines of a rotary embedding at positions up to ``seq``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.lin = nn.Linear(dim, dim)

    @torch.no_grad()
    def cosines(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        inv = self.inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1).to(x.device)
        pos = positions[:, None, :].float()
        with torch.autocast(device_type=x.device.type, enabled=False):
            freqs = (inv.float() @ pos.float()).transpose(1, 2)
            cos = torch.cat((freqs, freqs), dim=-1).cos()
        return cos.to(dtype=x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        return self.lin(x * self.cosines(x, positions))


def reference(model: Rotary, x: torch.Tensor, buffer_dtype: torch.dtype) -> torch.Tensor:
    """The output as FSDP2's mixed precision computes it: parameters and input in bf16, the buffer
    in ``buffer_dtype`` (float32: as the model holds it)."""
    state = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
    state["inv_freq"] = model.inv_freq.to(buffer_dtype)
    return torch.func.functional_call(model, state, (x.to(torch.bfloat16),))


def test_a_buffer_read_in_nested_regions_keeps_float32_under_bf16():
    torch.manual_seed(0)
    model, x = Rotary(), torch.randn(2, 300, 8)
    exported = torch.export.export(model, (x,), strict=False).graph_module
    assert any(isinstance(m, torch.fx.GraphModule) for n, m in exported.named_modules() if n)
    compiled = compile_osdp(model, (x,), Devices(world_size=1), plan="replicate",
                            mixed_precision="bf16")
    out = compiled(x)
    assert out.dtype == torch.bfloat16
    expected = reference(model, x, torch.float32)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # a bf16 inv_freq (the buffer cast with the parameters) gives other cosines at these positions
    assert (reference(model, x, torch.bfloat16) - expected).abs().max() > 1e-2
    out.float().square().mean().backward()
    grad, = torch.autograd.grad(expected.float().square().mean(), [model.lin.weight])
    torch.testing.assert_close(compiled.lin.weight.grad, grad, rtol=0, atol=1e-2)


@pytest.mark.parametrize("name", ["hf_gemma", "hf_phi3", "hf_llama_lora"])
def test_a_hugging_face_model_computes_in_bf16_as_it_does_with_bf16_parameters(name):
    """[Note: conversions in low precision]: captured with its parameters in bf16, the model
    keeps its RMSNorms' statistics and the loss's logits in float32 (traced in float32,
    ``x.float()`` and ``x.to(input_dtype)`` look alike), Gemma's norm reads its input again
    after ``x.float()`` (which returns ``x`` itself in float32), and peft casts a LoRA layer's
    input only where the dtypes differ. The loss is bitwise the model's own with its parameters
    and input in bf16, as FSDP2's mixed precision runs it."""
    model = with_loss(name)
    x = batches(name, global_batch=2, steps=1)[0][0]
    cast = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
    expected = torch.func.functional_call(model, cast, (x,))
    compiled = compile_osdp(model, (x,), Devices(world_size=1), plan="replicate",
                            mixed_precision="bf16")
    torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)


class RotaryFloat32Only(Rotary):
    """:class:`Rotary` whose forward refuses any other dtype: traced in bf16 it fails, and it is
    traced as it is, in float32, its conversions dtyped by the precision pass's other rules."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError("float32 only")
        return super().forward(x)


def test_a_model_that_fails_to_trace_in_bf16_keeps_the_buffer_in_float32():
    torch.manual_seed(0)
    model, x = RotaryFloat32Only(), torch.randn(2, 300, 8)
    captured = capture(model, (x,), compute_dtype=torch.bfloat16)
    assert captured.method == "export"
    assert all(osdp_meta(n).converts_to_compute_dtype is None for m in captured.gm.modules()
               if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)
    compiled = compile_osdp(model, (x,), Devices(world_size=1), plan="replicate",
                            mixed_precision="bf16")
    plain = Rotary()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(compiled(x), reference(plain, x, torch.float32), rtol=0, atol=0)

"""The harness's shared captures (``harness/shared_captures.py``): a case that gets a copy of an
earlier case's graph computes with its own model's weights, and a model that differs in what
its forward reads is exported afresh."""

from __future__ import annotations

import pytest
import torch
from harness import shared_captures
from harness.models import build

from osdp_fx import compile_osdp

pytest.importorskip("transformers")


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits


def test_a_shared_graph_computes_with_the_new_models_weights():
    x = torch.randint(0, 67, (2, 16))
    first, _ = build("hf_llama", seed=0)
    second, _ = build("hf_llama", seed=1)
    key = shared_captures.model_key(second, (x,))
    assert key is not None and key == shared_captures.model_key(first, (x,))
    expected = _logits(second, x)
    compile_osdp(first, (x,), plan="replicate")
    assert key in shared_captures._graphs  # stored by the first compile (or an earlier case)
    stored = shared_captures._graphs[key]
    assert all(t.device.type == "meta" for t in (*stored.parameters(), *stored.buffers()))
    compiled = compile_osdp(second, (x,), plan="replicate")
    torch.testing.assert_close(_logits(compiled, x), expected)


def test_what_the_forward_reads_is_in_the_key():
    x = torch.randint(0, 67, (2, 16))
    model, _ = build("hf_llama")
    key = shared_captures.model_key(model, (x,))
    assert shared_captures.model_key(model, (torch.randint(0, 67, (2, 8)),)) != key
    model.config.rms_norm_eps = 1e-3
    assert shared_captures.model_key(model, (x,)) != key
    model.config.rms_norm_eps = build("hf_llama")[0].config.rms_norm_eps
    assert shared_captures.model_key(model, (x,)) == key
    model.eval()
    assert shared_captures.model_key(model, (x,)) != key
    model.train()
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    assert shared_captures.model_key(model, (x,)) != key
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(True)
    model.model.layers[0].register_forward_hook(lambda *args: None)
    assert shared_captures.model_key(model, (x,)) != key
    model, _ = build("hf_llama")
    model.model.scale = torch.ones(1)  # a tensor held as a plain attribute: not shared
    assert shared_captures.model_key(model, (x,)) is None
    assert shared_captures.model_key(build("mlp")[0], (torch.randn(2, 8),)) is None

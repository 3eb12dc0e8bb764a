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


def _two_llamas() -> tuple[torch.Tensor, torch.nn.Module, torch.nn.Module]:
    """A batch and two test Llamas that differ in their weights alone."""
    return (torch.randint(0, 67, (2, 16)), build("hf_llama", seed=0)[0],
            build("hf_llama", seed=1)[0])


def test_a_shared_graph_computes_with_the_new_models_weights():
    x, first, second = _two_llamas()
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


def test_a_kept_program_is_bound_to_the_new_model_and_gives_the_same_graph():
    from osdp_fx.passes import capture

    x, first, second = _two_llamas()
    path = shared_captures.program_path(second, (x,))
    assert path is not None and path == shared_captures.program_path(first, (x,))
    assert path != shared_captures.program_path(second, (torch.randint(0, 67, (2, 8)),))
    fresh = capture._export_program.__wrapped__(first, (x,)).module()
    capture._export_program(first, (x,))  # exports, or loads what an earlier case kept
    assert path.exists()
    kept = capture._export_program(second, (x,))  # loads
    gm = kept.module()
    assert gm.code == fresh.code
    assert [n.meta.get("nn_module_stack") for n in gm.graph.nodes] == [
        n.meta.get("nn_module_stack") for n in fresh.graph.nodes]
    own = dict(second.named_parameters())
    assert all(p is own[n] for n, p in gm.named_parameters())
    torch.testing.assert_close(gm(x).logits, second(x).logits)
    compiled = compile_osdp(second, (x,), plan="replicate")
    torch.testing.assert_close(_logits(compiled, x), second(x).logits)

"""The real torch.export path on a Hugging Face model: with the suite's shared captures
(``harness/shared_captures.py``) undone, ``compile_osdp`` of a tiny random-weight Llama at world
size 1 (no process group) calls ``torch.export.export`` itself, and one SGD step of the compiled
model gives eager's loss, gradients and updated parameters."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from harness import shared_captures

from osdp_fx import compile_osdp
from osdp_fx.passes import capture

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _llama() -> torch.nn.Module:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@pytest.fixture
def real_exports(monkeypatch):
    """The number of ``torch.export.export`` calls made, with the shared captures undone."""
    calls: list[type] = []
    export = torch.export.export

    def counted(model, *args, **kwargs):
        calls.append(type(model))
        return export(model, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    with shared_captures.uninstalled():
        assert not hasattr(capture._export_module, "__wrapped__")
        assert not hasattr(capture._export_program, "__wrapped__")
        yield calls
    assert hasattr(capture._export_module, "__wrapped__")  # the suite's sharing is back


@pytest.mark.parametrize("plan", ["replicate", "full_shard"])
def test_one_sgd_step_through_torch_export_equals_eager(real_exports, plan):
    model = _llama()
    eager = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))

    compiled = compile_osdp(model, (ids,), plan=plan)
    assert compiled.captured_by == "export"
    assert real_exports == [transformers.LlamaForCausalLM]  # one real export, of this model
    assert "torch.ops.aten" in compiled.code  # an aten-level graph, as export writes it
    sharded = {entry.sharded for entry in compiled.param_table.entries.values()}
    assert sharded == {plan == "full_shard"}  # every parameter sharded, or none
    assert ("all_gather" in compiled.code) == (plan == "full_shard")

    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (compiled, eager)]
    losses = [_loss(m, ids) for m in (compiled, eager)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for loss in losses:
        loss.backward()
    grads = compiled.full_grads()
    assert set(grads) == {n for n, _ in eager.named_parameters()}
    for name, p in eager.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    for opt in opts:
        opt.step()
    after = compiled.full_state_dict()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(after[name], p.detach(), rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the step changed the loss, and both alike
        again = [_loss(m, ids) for m in (compiled, eager)]
    torch.testing.assert_close(again[0], again[1], rtol=1e-5, atol=1e-6)
    assert not torch.isclose(again[1], losses[1])

"""clip_grad_norm_ (osdp_fx/training/clip.py) in one process, world size 1 (no process group):
the norm and the clipped gradients are torch's, frozen parameters are skipped, and bad
arguments raise InputError. Across ranks: tests/distributed/test_clip.py."""

from __future__ import annotations

import math

import pytest
import torch
from harness import clip_cases as cc

from osdp_fx import clip_grad_norm_, compile_osdp
from osdp_fx.errors import InputError

INF = math.inf


def test_one_process_and_input_errors():
    """World size 1 (no process group): the same as torch; bad arguments raise InputError."""
    net, loss_fn = cc.build("gpt")
    ref, _ = cc.build("gpt")
    (batch,) = cc.batches("gpt", global_batch=2, steps=1)
    compiled = compile_osdp(net, batch[:1], plan="full_shard")
    loss_fn(compiled(*batch[:1]), batch).backward()
    loss_fn(ref(*batch[:1]), batch).backward()
    norm = clip_grad_norm_(compiled, 0.1, "inf")
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, INF))
    full = compiled.full_grads()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(full[name], p.grad, rtol=0, atol=1e-7)

    with pytest.raises(InputError, match="module returned by compile_osdp.*got TinyGPT.*"
                                         "torch.nn.utils.clip_grad_norm_"):
        clip_grad_norm_(ref, 1.0)
    with pytest.raises(InputError, match="got list"):
        clip_grad_norm_(list(ref.parameters()), 1.0)
    with pytest.raises(InputError, match="norm_type must be a positive number or inf"):
        clip_grad_norm_(compiled, 1.0, 0)
    with pytest.raises(InputError, match="max_norm must be a number"):
        clip_grad_norm_(compiled, "big")
    with pytest.raises(InputError, match="max_norm must be >= 0"):
        clip_grad_norm_(compiled, -1.0)


def test_frozen_parameters_are_skipped_and_the_rest_clipped_as_torch_does():
    net, loss_fn = cc.build("mlp_frozen")
    ref, _ = cc.build("mlp_frozen")
    (batch,) = cc.batches("mlp_frozen", global_batch=4, steps=1)
    compiled = compile_osdp(net, batch[:1], plan="replicate")
    loss_fn(compiled(batch[0]), batch).backward()
    loss_fn(ref(batch[0]), batch).backward()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    expected = torch.nn.utils.clip_grad_norm_(trainable, 1e-3, 2.0)
    assert expected > 1e-3  # so clipping happens
    norm = clip_grad_norm_(compiled, torch.tensor(1e-3))  # a 0-d tensor is a number
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    grads = compiled.full_grads()
    assert grads["layers.0.weight"] is None
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-6, atol=1e-9, msg=name)


def test_a_model_without_trainable_parameters_has_norm_zero():
    net, _ = cc.build("mlp")
    net.requires_grad_(False)
    x = torch.randn(2, 13)
    compiled = compile_osdp(net, (x,), plan="replicate")
    assert clip_grad_norm_(compiled, 1.0).item() == 0.0

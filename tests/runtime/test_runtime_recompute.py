"""A recomputed region (osdp_fx/runtime/recompute.py) in one process: its body runs again in
backward, the outputs and gradients are the body's own, dropout draws the same mask twice, and
``selective`` keeps the matrix products ([Note: recompute policies]). The pass that makes
regions: tests/passes/test_recompute_pass.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils.checkpoint import CheckpointPolicy

from osdp_fx.runtime.recompute import RecomputedRegion, _selective_policy


class Block(nn.Module):
    def forward(self, x, w):
        h = F.dropout(torch.relu(x @ w), p=0.5, training=True)
        return (h @ w.t()).tanh()


def _body() -> tuple[fx.GraphModule, list[int]]:
    body = fx.symbolic_trace(Block())
    runs: list[int] = []
    body.register_forward_pre_hook(lambda *_: runs.append(1))
    return body, runs


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_backward_reruns_the_body_and_gets_its_gradients(policy):
    body, runs = _body()
    region = RecomputedRegion(body, policy)
    assert region.extra_repr() == f"policy={policy}"
    x0, w0 = torch.randn(4, 8), torch.randn(8, 8)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    torch.manual_seed(3)
    out = region(x, w)
    torch.manual_seed(3)
    ref = Block()(xr, wr)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the same dropout mask
    assert len(runs) == 1
    out.sum().backward()
    ref.sum().backward()
    assert len(runs) == 2  # recomputed in backward
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.grad, wr.grad, rtol=0, atol=1e-6)


def test_without_grad_the_body_runs_once_as_it_is():
    body, runs = _body()
    with torch.no_grad():
        out = RecomputedRegion(body, "full")(torch.randn(2, 8), torch.randn(8, 8))
    assert out.grad_fn is None and len(runs) == 1


def test_a_saved_region_is_not_wrapped_and_an_unknown_policy_is_refused():
    body, _ = _body()
    with pytest.raises(AssertionError, match="not wrapped"):
        RecomputedRegion(body, "save")
    with pytest.raises(ValueError, match="'sometimes'"):
        RecomputedRegion(body, "sometimes")


def test_selective_saves_matrix_products_and_recomputes_the_rest():
    aten = torch.ops.aten
    assert _selective_policy(None, aten.mm.default) == CheckpointPolicy.MUST_SAVE
    assert _selective_policy(None, aten.addmm.default) == CheckpointPolicy.MUST_SAVE
    assert (_selective_policy(None, aten._scaled_dot_product_flash_attention_for_cpu.default)
            == CheckpointPolicy.MUST_SAVE)
    for op in (aten.relu.default, aten.tanh.default, aten._softmax.default):
        assert _selective_policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE

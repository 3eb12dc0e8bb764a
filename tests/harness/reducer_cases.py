"""GradReducer on a plain model (no compile): when its buckets start and what they compute."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from osdp_fx.runtime.reducer import GradReducer


def overlapped_buckets(rank: int, world: int, *, width: int = 64, depth: int = 4,
                       steps: int = 2) -> dict[str, Any]:
    """One bucket per Linear; records how many buckets had started when backward reached the
    first layer's output, and returns the averaged gradients."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    layer_bytes = (width * width + width) * 4
    reducer = GradReducer(list(layers.parameters()), "world", bucket_bytes=layer_bytes)
    started_at_first_layer = []
    for _ in range(steps):
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
        h = layers[0](x)
        h.register_hook(lambda g: started_at_first_layer.append(reducer._next))
        out = layers[1:](h)
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in layers.named_parameters()}
        layers.zero_grad(set_to_none=True)
    return {"buckets": len(reducer.buckets), "started_at_first_layer": started_at_first_layer,
            "grads": grads}


def local_grads(rank: int, width: int = 64, depth: int = 4) -> dict[str, torch.Tensor]:
    """The same model's gradients on rank ``rank``'s batch alone (run in the test process)."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))
    layers(x).square().mean().backward()
    return {n: p.grad for n, p in layers.named_parameters()}

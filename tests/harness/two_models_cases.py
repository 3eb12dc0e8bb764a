"""Two compiled models in one process whose forwards and backwards interleave (a teacher and a
student, a GAN's generator and discriminator): each keeps its own pending collectives."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from osdp_fx import compile_osdp


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 40), nn.Tanh())
    second = nn.Sequential(nn.Linear(40, 32), nn.GELU(), nn.Linear(32, 8))
    return first, second


def _data(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(4 * world, 24, generator=gen), torch.randn(4 * world, 8, generator=gen))
            for _ in range(steps)]


def _mixed(model: nn.Module) -> dict[str, str]:
    names = [n for n, _ in model.named_parameters()]
    cycle = ["full_shard", "replicate", "shard_grad_op"]
    return {"format": "osdp-fx-plan", "version": 1,
            "params": {n: cycle[i % 3] for i, n in enumerate(names)}}


def _losses(a: Any, b: Any, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """A's output through B, and (as a GAN's discriminator sees real data) B on its own."""
    return [F.mse_loss(b(a(x)), y), F.mse_loss(b(torch.tanh(torch.cat([x, x[:, :16]], 1))), y)]


def train_two(rank: int, world: int, *, plan: str, steps: int = 3,
              two_backwards: bool = False) -> dict[str, Any]:
    """Forward A, forward B on A's output, forward B on other data, then one backward of both
    losses or (``two_backwards``) one backward each; SGD on both; the losses and full states
    after ``steps`` steps."""
    import json
    import tempfile

    first, second = _models()
    data = _data(world, steps)
    x0 = data[0][0][rank * 4:(rank + 1) * 4]
    plans = []
    for model in (first, second):
        if plan == "mixed":
            f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
            json.dump(_mixed(model), f)
            f.close()
            plans.append(f.name)
        else:
            plans.append(plan)
    a = compile_osdp(first, (x0,), plan=plans[0])
    b = compile_osdp(second, (first(x0).detach(),), plan=plans[1])
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    losses = []
    for x, y in data:
        x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        parts = _losses(a, b, x, y)
        if two_backwards:
            for part in parts:
                part.backward()
        else:
            sum(parts).backward()
        loss = sum(parts).detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "a": a.full_state_dict(), "b": b.full_state_dict()}


def reference_two(world: int, steps: int = 3) -> dict[str, Any]:
    """Single-process training on the global batch (one backward of both losses)."""
    first, second = _models()
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    losses = []
    for x, y in _data(world, steps):
        loss = sum(_losses(first, second, x, y))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "a": first.state_dict(), "b": second.state_dict()}

"""Functions that run on every rank of a test world (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch

from osdp_fx import compile_osdp

from .models import batches, build, local


def train(rank: int, world: int, *, model: str, plan: Any, steps: int = 5, lr: float = 0.05,
          local_batch: int = 2, seed: int = 0) -> dict[str, Any]:
    """Train ``model`` with SGD under ``plan`` for ``steps``; return losses and final state."""
    net, loss_fn = build(model, seed)
    data = [local(b, rank, world) for b in batches(model, global_batch=local_batch * world,
                                                    steps=steps)]
    compiled = compile_osdp(net, data[0][:1], plan=plan)
    opt = torch.optim.SGD(compiled.parameters(), lr=lr)
    losses = []
    for batch in data:
        loss = loss_fn(compiled(*batch[:1]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {
        "losses": losses,
        "state": compiled.full_state_dict(),
        "plan": compiled.plan.to_dict(),
        "local_numel": {n: p.numel() for n, p in compiled.named_parameters()},
    }


def reference_train(model: str, *, world: int, steps: int = 5, lr: float = 0.05,
                    local_batch: int = 2, seed: int = 0) -> dict[str, Any]:
    """Single-process training on the full global batch (run in the test process)."""
    net, loss_fn = build(model, seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for batch in batches(model, global_batch=local_batch * world, steps=steps):
        loss = loss_fn(net(*batch[:1]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": net.state_dict()}

"""Autotuning cases, run on every rank of a test world."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from osdp_fx import compile_osdp
from osdp_fx.planner.detect import _detected

from .cases import sgd_losses
from .models import batches, build, local


def train_autotuned(rank: int, world: int, *, model: str, limit: int, autotune: int,
                    steps: int = 5, lr: float = 0.05, local_batch: int = 2,
                    margin: float | None = None) -> dict[str, Any]:
    """Compile with the search and ``autotune``, then train like ``cases.train`` (SGD); also
    report whether compiling changed the model's values. ``margin``: the detected devices'
    ``memory_margin`` replaced (a GPU's, on this CPU)."""
    net, loss_fn = build(model)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    data = [local(b, rank, world) for b in batches(model, global_batch=local_batch * world,
                                                    steps=steps)]
    devices = None
    if margin is not None:
        devices = dataclasses.replace(_detected(world), memory_margin=margin)
    compiled = compile_osdp(net, data[0][:1], memory_limit=limit, optimizer="adamw",
                            autotune=autotune, devices=devices)
    unchanged = all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    return {"losses": sgd_losses(compiled, loss_fn, data, lr), "state": compiled.full_state_dict(),
            "plan": compiled.plan.to_dict(), "hash": compiled.plan.hash(),
            "model_unchanged": unchanged, "table": str(compiled.plan)}

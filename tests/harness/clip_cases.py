"""Gradient clipping cases: run on every rank of a test world, and their single-process twins.

Model sizes are chosen so that almost no parameter's element count divides the world size (2 or
4): the last ranks' shards end in zero padding, which the norm must not count twice or miss.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from osdp_fx import clip_grad_norm_, compile_osdp
from osdp_fx.examples import MLP, TinyGPT, lm_loss

from .held import local_tensor
from .models import local

Batch = tuple[torch.Tensor, ...]


def build(name: str, seed: int = 0) -> tuple[nn.Module, Callable[[Any, Batch], torch.Tensor]]:
    """(model, loss_fn(output, batch)) for ``name``; identical in every process."""
    torch.manual_seed(seed)
    if name == "mlp":  # 13x27, 27, 27x11, 11, 11x5, 5 elements: all odd
        return MLP((13, 27, 11, 5)), lambda out, batch: F.mse_loss(out, batch[1])
    if name == "mlp_frozen":  # the first layer frozen: skipped by the norm, never scaled
        net = MLP((13, 27, 11, 5))
        net.layers[0].requires_grad_(False)
        return net, lambda out, batch: F.mse_loss(out, batch[1])
    if name == "gpt":  # tied tok/head 67x15, pos 13x15, qkv 45x15, proj 15x15: odd sizes
        return (TinyGPT(vocab=67, dim=15, depth=1, heads=3, max_seq=13),
                lambda out, batch: lm_loss(out, batch[0]))
    raise ValueError(name)


def batches(name: str, *, global_batch: int, steps: int, seed: int = 1) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    if name.startswith("mlp"):
        return [(torch.randn(global_batch, 13, generator=gen),
                 torch.randn(global_batch, 5, generator=gen)) for _ in range(steps)]
    return [(torch.randint(0, 67, (global_batch, 12), generator=gen),) for _ in range(steps)]


MIXED = ["full_shard", "replicate", "shard_grad_op"]


def mixed_plan(name: str, strategies: list[str] = MIXED) -> dict[str, Any]:
    """A plan file's contents cycling through ``strategies`` parameter by parameter."""
    net, _ = build(name)
    return {"format": "osdp-fx-plan", "version": 1,
            "params": {n: strategies[i % len(strategies)]
                       for i, (n, _) in enumerate(net.named_parameters())}}


def write_mixed_plan(name: str, path: str, strategies: list[str] = MIXED) -> str:
    with open(path, "w") as f:
        json.dump(mixed_plan(name, strategies), f)
    return path


def write_split_plan(path: str) -> str:
    """The MLP's middle linear (11x27) split in 3 uneven parts (4, 4, 3 rows), one part per
    strategy, the rest full_shard (docs/splitting.md): the weight stays one parameter holding
    its parts, and each part counts once."""
    parts = {f"layers.1.{kind}_part{i}": s for kind in ("weight", "bias")
             for i, s in enumerate(["full_shard", "replicate", "shard_grad_op"])}
    with open(path, "w") as f:
        json.dump({"format": "osdp-fx-plan", "version": 1, "splits": {"layers.1.weight": 3},
                   "default": "full_shard", "params": parts}, f)
    return path


def train_clipped(rank: int, world: int, *, model: str, plan: Any, max_norm: float,
                  norm_type: float, steps: int = 3, lr: float = 0.5, local_batch: int = 2,
                  seed: int = 0, devices: Any = None) -> dict[str, Any]:
    """SGD with clipping for ``steps``: the norms, the clipped full gradients, the final state."""
    net, loss_fn = build(model, seed)
    data = [local(b, rank, world) for b in batches(model, global_batch=local_batch * world,
                                                    steps=steps)]
    compiled = compile_osdp(net, data[0][:1], devices, plan=plan)
    del net
    opt = torch.optim.SGD(compiled.parameters(), lr=lr)
    norms, grads = [], []
    for batch in data:
        loss_fn(compiled(*batch[:1]), batch).backward()
        norms.append(clip_grad_norm_(compiled, max_norm, norm_type))
        grads.append(compiled.full_grads())  # collective: every rank gathers
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = compiled.full_state_dict()  # collective
    return {
        "norms": torch.stack(norms),
        "grads": grads if rank == 0 else None,  # the same on every rank: ship one copy
        "state": state if rank == 0 else None,
        "strategies": sorted({p.strategy for p in compiled.plan.params}),
        "params": [p.name for p in compiled.plan.params],
    }


def reference_train_clipped(model: str, *, world: int, max_norm: float, norm_type: float,
                            steps: int = 3, lr: float = 0.5, local_batch: int = 2,
                            seed: int = 0) -> dict[str, Any]:
    """Single-process twin of :func:`train_clipped` on the global batch, with torch's clipping."""
    net, loss_fn = build(model, seed)
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr)
    norms, grads = [], []
    for batch in batches(model, global_batch=local_batch * world, steps=steps):
        loss_fn(net(*batch[:1]), batch).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm, norm_type))
        grads.append({n: None if p.grad is None else p.grad.clone()
                      for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"norms": torch.stack(norms), "grads": grads, "state": net.state_dict()}


def nonfinite(rank: int, world: int, *, plan: str, norm_type: float) -> dict[str, Any]:
    """One rank's gradient holds a nan: every rank must see a nan norm, and with
    ``error_if_nonfinite=True`` every rank must raise (none may be left in a collective)."""
    net, loss_fn = build("mlp")
    batch = local(batches("mlp", global_batch=2 * world, steps=1)[0], rank, world)
    compiled = compile_osdp(net, batch[:1], plan=plan)
    out: dict[str, Any] = {}
    for raise_ in (True, False):
        loss_fn(compiled(*batch[:1]), batch).backward()
        # layers.0.weight has 351 elements: real elements on every rank at world 2 and 4.
        grad = compiled.get_parameter("layers.0.weight").grad
        if plan == "replicate" or rank == world - 1:  # replicated grads are equal on all ranks
            local_tensor(grad).view(-1)[0] = float("nan")  # a DTensor when sharded
        try:
            out["norm" if not raise_ else "unexpected"] = clip_grad_norm_(
                compiled, 1.0, norm_type, error_if_nonfinite=raise_)
        except RuntimeError as exc:
            out["error"] = str(exc)
        compiled.zero_grad(set_to_none=True)
    torch.distributed.barrier()  # still in step with the others
    return out

"""Cases of activation recomputation on a test world: training with recomputed regions, and the
all-gathers a step runs (importable by spawned processes)."""

from __future__ import annotations

import collections
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch

from osdp_fx import compile_osdp
from osdp_fx.runtime import params as runtime_params
from osdp_fx.runtime import regather as runtime_regather

from .held import storage_ptr
from .models import batches, build, local

STRATEGY_CYCLE = ["full_shard", "replicate", "shard_grad_op"]


def plan_file(model: str, path: Any, strategy: str, recompute: dict[str, str]) -> str:
    """A plan file: every parameter under ``strategy`` ('mixed': the three strategies in turn),
    the regions ``recompute`` names recomputed."""
    net, _ = build(model)
    cycle = STRATEGY_CYCLE if strategy == "mixed" else [strategy]
    params = {name: cycle[i % len(cycle)] for i, (name, _) in enumerate(net.named_parameters())}
    with open(path, "w") as f:
        json.dump({"format": "osdp-fx-plan", "version": 1, "params": params,
                   **({"recompute": recompute} if recompute else {})}, f)
    return str(path)


COLLECTIVES = -1
"""The key of :func:`counting_gathers`'s count of all-gather collectives."""


@contextlib.contextmanager
def counting_gathers() -> Iterator[collections.Counter[int]]:
    """Count the all-gathers the runtime starts, forward and backward, by wrapping the real
    functions it calls: per parameter, keyed by the storage of its shard (each member of a
    bucket gathered in one collective counts once), and the collectives under
    :data:`COLLECTIVES`."""
    real, real_bucket = runtime_params.gather_shards_start, runtime_regather.start_params
    count: collections.Counter[int] = collections.Counter()
    in_bucket = [False]

    def counted(shard: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not in_bucket[0]:
            count[storage_ptr(shard)] += 1
            count[COLLECTIVES] += 1
        return real(shard, *args, **kwargs)

    def counted_bucket(shards: tuple[torch.Tensor, ...], *args: Any, **kwargs: Any) -> Any:
        for shard in shards:  # parameters (DTensors): the storage of their shards
            count[storage_ptr(shard)] += 1
        count[COLLECTIVES] += 1
        in_bucket[0] = True
        try:
            return real_bucket(shards, *args, **kwargs)
        finally:
            in_bucket[0] = False

    modules = (runtime_params, runtime_regather)  # forward's gathers, backward's re-gathers
    for module in modules:
        module.gather_shards_start, module.start_params = counted, counted_bucket
    try:
        yield count
    finally:
        for module in modules:
            module.gather_shards_start, module.start_params = real, real_bucket


def train(rank: int, world: int, *, model: str, plan: str, steps: int = 5, lr: float = 0.05,
          local_batch: int = 2, seed: int = 0, train_mode_seed: int | None = None,
          devices: Any = None) -> dict[str, Any]:
    """Train ``model`` with SGD under the plan file ``plan`` (on ``devices``); return losses,
    final state, the all-gathers of each step, and the compiled code. ``train_mode_seed``: the
    RNG seed every rank sets before each step (dropout draws the same masks in every run of
    the case)."""
    net, loss_fn = build(model, seed)
    data = [local(b, rank, world) for b in batches(model, global_batch=local_batch * world,
                                                    steps=steps)]
    compiled = compile_osdp(net, data[0][:1], devices, plan=plan)
    opt = torch.optim.SGD(compiled.parameters(), lr=lr)
    names = {storage_ptr(p): n for n, p in compiled.named_parameters()}
    losses, gathers = [], []
    for i, batch in enumerate(data):
        if train_mode_seed is not None:
            torch.manual_seed(train_mode_seed + 1000 * rank + i)
        with counting_gathers() as forward:
            loss = loss_fn(compiled(*batch[:1]), batch)
        with counting_gathers() as backward:
            loss.backward()
        gathers.append(tuple(
            {"collectives" if k == COLLECTIVES else names[k]: n for k, n in c.items()}
            for c in (forward, backward)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": compiled.full_state_dict(), "gathers": gathers,
            "code": compiled.code, "plan": compiled.plan.to_dict()}

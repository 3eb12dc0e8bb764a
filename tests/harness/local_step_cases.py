"""Rank functions of ``tests/distributed/test_local_step.py``: an optimizer's step over the local
tensors of the compiled module's DTensor parameters against the same step over the DTensors."""

from __future__ import annotations

import copy
from typing import Any

import torch
from harness.models import batches, build, local

from osdp_fx import compile_osdp
from osdp_fx.runtime.local_step import over_dtensors

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
}


def _train(model: str, plan: Any, make: Any, rank: int, world: int, steps: int,
           dtensors: bool) -> dict[str, Any]:
    data = [local(b, rank, world) for b in batches(model, global_batch=2 * world, steps=steps)]
    net, loss_fn = build(model)
    compiled = compile_osdp(net, data[0][:1], plan=plan)
    optimizer = make(list(compiled.parameters()))
    for batch in data:
        loss_fn(compiled(*batch[:1]), batch).backward()
        if dtensors:
            with over_dtensors():
                optimizer.step()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    names = {p: n for n, p in compiled.named_parameters()}
    state = {(names[p], key): (type(v).__name__, getattr(v, "placements", None),
                               v.to_local().clone() if hasattr(v, "to_local")
                               else v.clone() if isinstance(v, torch.Tensor) else v)
             for p, entries in optimizer.state.items() for key, v in entries.items()}
    params = {n: p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
              for n, p in compiled.named_parameters()}
    return {"params": params, "state": state, "groups": [
        {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
        "dtensor_params": sum(hasattr(p, "to_local") for p in compiled.parameters())}


def local_against_dtensor_steps(rank: int, world: int, *, model: str, plan: Any,
                                optimizers: list[str], steps: int = 3) -> dict[str, Any]:
    """Per optimizer: the parameters, the optimizer's state (each entry's type, placements and
    local values) and its groups' settings after ``steps`` steps, taken over local tensors
    and over the DTensors."""
    return {name: {way: _train(model, plan, OPTIMIZERS[name], rank, world, steps,
                               dtensors=way == "dtensors")
                   for way in ("local", "dtensors")}
            for name in optimizers}


def state_dict_round_trip(rank: int, world: int, *, model: str, plan: Any) -> dict[str, Any]:
    """AdamW stepped twice over local tensors: its ``state_dict()`` (a copy) loaded into a
    fresh AdamW over the same parameters, then one more step of each from the same parameters
    and gradients; and the types of the state the first one holds."""
    data = [local(b, rank, world) for b in batches(model, global_batch=2 * world, steps=3)]
    net, loss_fn = build(model)
    compiled = compile_osdp(net, data[0][:1], plan=plan)
    first = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    for batch in data[:2]:
        loss_fn(compiled(*batch[:1]), batch).backward()
        first.step()
        first.zero_grad(set_to_none=True)
    second = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    second.load_state_dict(copy.deepcopy(first.state_dict()))  # torch's load aliases tensors
    loss_fn(compiled(*data[2][:1]), data[2]).backward()
    before = {n: p.to_local().detach().clone() for n, p in compiled.named_parameters()}
    first.step()
    after_first = {n: p.to_local().detach().clone() for n, p in compiled.named_parameters()}
    with torch.no_grad():
        for n, p in compiled.named_parameters():
            p.to_local().copy_(before[n])
    second.step()
    after_second = {n: p.to_local().detach().clone() for n, p in compiled.named_parameters()}
    return {"first": after_first, "second": after_second,
            "state_types": sorted({type(v).__name__ for entries in first.state.values()
                                   for v in entries.values()}),
            "moved": any(not torch.equal(before[n], after_first[n]) for n in before)}


class _Subclass(torch.optim.AdamW):
    """An AdamW subclass: its step may not be elementwise, so it runs over the DTensors."""


def steps_over(rank: int, world: int, *, model: str, plan: Any) -> dict[str, Any]:
    """What the step of each optimizer sees as its parameters (the type of the first marked
    one's tensor, read by a step post-hook of the optimizer's own, which torch calls with the
    step's arguments): AdamW as it is, an AdamW subclass, AdamW stepped with a closure, and
    AdamW inside ``over_dtensors()``, with the types of each one's state tensors; and AdamW
    over an FSDP2 module's parameters."""
    data = [local(b, rank, world) for b in batches(model, global_batch=2 * world, steps=1)]
    net, loss_fn = build(model)
    compiled = compile_osdp(net, data[0][:1], plan=plan)
    out = {}
    for name in ("adamw", "subclass", "closure", "over_dtensors"):
        optimizer = (_Subclass if name == "subclass" else torch.optim.AdamW)(
            compiled.parameters(), lr=1e-2)
        seen = []
        optimizer.register_step_post_hook(lambda opt, args, kwargs, seen=seen: seen.append(
            type(args[0].param_groups[0]["params"][0]).__name__))
        if name == "closure":
            def closure(optimizer=optimizer) -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(compiled(*data[0][:1]), data[0])
                loss.backward()
                return loss
            optimizer.step(closure)
        else:
            loss_fn(compiled(*data[0][:1]), data[0]).backward()
            if name == "over_dtensors":
                with over_dtensors():
                    optimizer.step()
            else:
                optimizer.step()
        out[name] = {"seen": seen, "state": sorted({type(v).__name__
                                                    for entries in optimizer.state.values()
                                                    for v in entries.values()})}
        optimizer.zero_grad(set_to_none=True)
    out["fsdp2"] = {"seen": _fsdp2_step(world)}
    return out


def _fsdp2_step(world: int) -> list[str]:
    """What AdamW's step sees as its parameters under FSDP2 (DTensors it never replaces)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = fully_shard(torch.nn.Linear(8, 8), mesh=init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    seen: list[str] = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(
        type(args[0].param_groups[0]["params"][0]).__name__))
    module(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return seen

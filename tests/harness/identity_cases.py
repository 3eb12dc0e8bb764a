"""Cases for parameters that keep their identity (issue 38): optimizer recipes written against
the model give the same param groups on the compiled module, and its state dict means what
FSDP2's does."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from osdp_fx import clip_grad_norm_, compile_osdp

from .models import batches, build, local

MODEL = "gpt"
STEPS, LR = 3, 0.05
Recipe = Callable[[Iterable[tuple[str, nn.Parameter]]], list[dict[str, Any]]]


def nanogpt(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """nanoGPT's ``configure_optimizers``: weight decay for every tensor of 2 or more dims."""
    params = list(named)
    return [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}]


def no_decay_by_name(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """Hugging Face Trainer's rule: no decay for biases and norm weights, by name (a name that
    contains "bias"; the norms by their module names)."""
    params = list(named)

    def skip(n: str) -> bool:
        return "bias" in n or ".ln" in n or n.startswith("ln")

    return [{"params": [p for n, p in params if not skip(n)], "weight_decay": 0.1},
            {"params": [p for n, p in params if skip(n)], "weight_decay": 0.0}]


def lr_per_layer(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """Layer-wise learning rates by name: block i at LR / 2**i, the rest at LR."""
    groups: dict[float, list[nn.Parameter]] = {}
    for n, p in named:
        m = re.match(r"blocks\.(\d+)\.", n)
        groups.setdefault(LR / 2 ** int(m.group(1)) if m else LR, []).append(p)
    return [{"params": ps, "lr": lr} for lr, ps in sorted(groups.items())]


RECIPES: dict[str, Recipe] = {"nanogpt": nanogpt, "by_name": no_decay_by_name,
                              "lr_per_layer": lr_per_layer}


def _groups(module: nn.Module, recipe: Recipe,
            original: Callable[[str], str]) -> list[tuple[list[str], int, dict[str, Any]]]:
    """Each param group as (its parameters' names, mapped to the model's, their elements, its
    options)."""
    names = {id(p): n for n, p in module.named_parameters()}
    out = []
    for g in recipe(module.named_parameters()):
        out.append((sorted({original(names[id(p)]) for p in g["params"]}),
                    sum(p.numel() for p in g["params"]),
                    {k: v for k, v in g.items() if k != "params"}))
    return out


def _train(module: nn.Module, loss_fn: Any, data: list[Any], groups: list[dict[str, Any]],
           clip: Callable[[], Any]) -> list[float]:
    # foreach, as on a GPU by default: one list of every parameter (all DTensors or none)
    opt = torch.optim.SGD(groups, lr=LR, momentum=0.9, foreach=True)
    losses = []
    for batch in data:
        loss = loss_fn(module(*batch[:1]), batch)
        loss.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _combined(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """nanoGPT's decay rule crossed with per-layer learning rates: what training uses."""
    params = list(named)
    out = []
    for decay in nanogpt(params):
        chosen = {id(p) for p in decay["params"]}
        for lr_group in lr_per_layer((n, p) for n, p in params if id(p) in chosen):
            out.append({**lr_group, "weight_decay": decay["weight_decay"]})
    return out


def recipes(rank: int, world: int, *, plans: dict[str, Any], path: str) -> dict[str, Any]:
    """Under each plan: the recipes' groups on the model and on the compiled module; training
    with them (foreach SGD, and ``torch.nn.utils.clip_grad_norm_``) against one process; the state dict
    saved with torch.save and loaded into the plain model; DCP save and load of it."""
    data = batches(MODEL, global_batch=2 * world, steps=STEPS)
    net, loss_fn = build(MODEL)
    model_groups = {k: _groups(net, r, lambda n: n) for k, r in RECIPES.items()}
    ref_clip: list[float] = []
    ref_losses = _train(net, loss_fn, data, _combined(net.named_parameters()),
                        lambda: ref_clip.append(float(torch.nn.utils.clip_grad_norm_(
                            net.parameters(), 1.0))))
    reference = {k: v.detach().clone() for k, v in net.state_dict().items()}
    out: dict[str, Any] = {"model_groups": model_groups, "ref_losses": ref_losses,
                           "ref_clip": ref_clip, "reference": reference}
    for label, plan in plans.items():
        model, _ = build(MODEL)
        mine = [local(b, rank, world) for b in data]
        compiled = compile_osdp(model, mine[0][:1], plan=plan, optimizer="sgd")
        part_of = {part: name for name, s in compiled.param_table.splits.items()
                   for part in s.parts}
        result: dict[str, Any] = {
            "groups": {k: _groups(compiled, r, lambda n: part_of.get(n, n))
                       for k, r in RECIPES.items()},
            "dims": {n: (p.dim(), tuple(p.shape)) for n, p in compiled.named_parameters()},
            "splits": sorted(compiled.param_table.splits),
            "strategies": sorted({p.strategy for p in compiled.plan.params}),
        }
        norms: list[tuple[float, float]] = []

        def clip(compiled: Any = compiled, norms: list[tuple[float, float]] = norms) -> None:
            # torch's own clipping (foreach, a GPU's default), without clipping; then osdp's
            torch_norm = torch.nn.utils.clip_grad_norm_(compiled.parameters(), 1e9,
                                                        foreach=True)
            torch_norm = float(getattr(torch_norm, "full_tensor", lambda: torch_norm)())
            norms.append((float(clip_grad_norm_(compiled, 1.0)), torch_norm))

        result["losses"] = _train(compiled, loss_fn, mine, _combined(compiled.named_parameters()),
                                  clip)
        result["clip"] = norms
        result["full"] = compiled.full_state_dict()
        state = compiled.state_dict()
        result["state_keys"] = list(state)
        result["state_dtensors"] = sorted(k for k, v in state.items() if _is_dtensor(v))
        result["torch_save"] = _torch_save_into_plain_model(state, result["full"])
        result["dcp"] = _dcp_round_trip(compiled, plan, os.path.join(path, label), rank, world)
        out[label] = result
        del compiled
    return out


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _torch_save_into_plain_model(state: dict[str, Any], full: dict[str, torch.Tensor]) -> str:
    """torch.save of the compiled module's state dict, loaded into the plain model: 'exact'
    (the model's weights, to the bit), 'raised', or 'wrong' (loaded, and different)."""
    blob = io.BytesIO()
    torch.save(state, blob)
    blob.seek(0)
    plain, _ = build(MODEL, seed=7)
    try:
        plain.load_state_dict(torch.load(blob, weights_only=False))
    except Exception:  # noqa: BLE001  (any refusal counts; what matters is not loading wrong)
        return "raised"
    loaded = plain.state_dict()
    exact = all(torch.equal(loaded[k], v) for k, v in full.items())
    return "exact" if exact else "wrong"


def _dcp_round_trip(compiled: Any, plan: Any, path: str, rank: int, world: int) -> bool:
    """DCP saves ``compiled.state_dict()``; a model compiled afresh (other initial weights)
    loads it with dcp.load and load_state_dict: its full state equals the saved one."""
    dcp.save(compiled.state_dict(), checkpoint_id=path)
    fresh_model, _ = build(MODEL, seed=11)
    batch = local(batches(MODEL, global_batch=2 * world, steps=1)[0], rank, world)
    fresh = compile_osdp(fresh_model, batch[:1], plan=compiled.plan, optimizer="sgd")
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    want, got = compiled.full_state_dict(), fresh.full_state_dict()
    return all(torch.equal(want[k], got[k]) for k in want)

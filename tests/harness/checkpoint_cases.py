"""Checkpoint cases: run on every rank of a test world (and the single-process reference).

Training uses AdamW (so there is optimizer state to save) on one fixed sequence of global
batches; each rank trains on its equal slice of every global batch, so a run is the same
computation at any world size, and the mean of the ranks' losses is the global batch's loss.

The MLP's sizes are chosen so that element counts do not divide the world sizes 2 and 4 and one
bias has fewer elements (3) than a 4-rank world has ranks: there the last rank's shard is empty.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from osdp_fx import compile_osdp, load_checkpoint, save_checkpoint
from osdp_fx.errors import OSDPError
from osdp_fx.examples import MLP, TinyGPT, lm_loss

from .held import held_numel
from .models import local

Batch = tuple[torch.Tensor, ...]
GLOBAL_BATCH = 8  # divisible by every world size used: 1, 2, 4
LR = 1e-2


class ScaledMLP(nn.Module):
    """An MLP (24 -> 40 -> 33 -> 3) whose output is multiplied by a buffer."""

    def __init__(self, width: int = 40) -> None:
        super().__init__()
        self.mlp = MLP((24, width, 33, 3))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x) * self.scale


def build(name: str, seed: int = 0) -> tuple[nn.Module, Callable[[Any, Batch], torch.Tensor]]:
    """(model, loss_fn(output, batch)); identical in every process for the same seed. Other
    seeds also change buffers, so a load must overwrite them."""
    torch.manual_seed(seed)
    if name in ("mlp", "mlp_wide"):
        net = ScaledMLP(width=40 if name == "mlp" else 48)
        net.scale.add_(seed)
        return net, lambda out, batch: F.mse_loss(out, batch[1])
    if name == "gpt":  # tied token embedding and head
        return (TinyGPT(vocab=67, dim=16, depth=1, heads=2, max_seq=12),
                lambda out, batch: lm_loss(out, batch[0]))
    raise ValueError(name)


def batches(name: str, *, steps: int, seed: int = 1) -> list[Batch]:
    """``steps`` global batches of GLOBAL_BATCH samples."""
    gen = torch.Generator().manual_seed(seed)
    if name.startswith("mlp"):
        return [(torch.randn(GLOBAL_BATCH, 24, generator=gen),
                 torch.randn(GLOBAL_BATCH, 3, generator=gen)) for _ in range(steps)]
    return [(torch.randint(0, 67, (GLOBAL_BATCH, 12), generator=gen),) for _ in range(steps)]


def _compile(name: str, plan: Any, rank: int, world: int, *, seed: int = 0,
             devices: Any = None):
    net, loss_fn = build(name, seed)
    example = local(batches(name, steps=1)[0], rank, world)[:1]
    compiled = compile_osdp(net, example, devices, plan=plan)
    return compiled, torch.optim.AdamW(compiled.parameters(), lr=LR), loss_fn


def train_steps(compiled, opt, loss_fn, data: list[Batch], rank: int, world: int) -> list[float]:
    """One optimizer step per global batch of ``data``, on this rank's slice; the losses."""
    losses = []
    for batch in data:
        batch = local(batch, rank, world)
        loss = loss_fn(compiled(*batch[:1]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def resume_same_world(rank: int, world: int, *, model: str, plan: Any, path: str
                      ) -> dict[str, Any]:
    """Train 3 steps, save, train 3 more; then load into a fresh compile (another seed, a fresh
    optimizer) and train the same 3 steps again."""
    data = batches(model, steps=6)
    compiled, opt, loss_fn = _compile(model, plan, rank, world)
    train_steps(compiled, opt, loss_fn, data[:3], rank, world)
    saved = compiled.full_state_dict()
    save_checkpoint(path, compiled, opt, extra={"step": 3})
    after = train_steps(compiled, opt, loss_fn, data[3:], rank, world)

    fresh, fresh_opt, _ = _compile(model, plan, rank, world, seed=1)
    extra = load_checkpoint(path, fresh, fresh_opt)
    loaded = fresh.full_state_dict()
    resumed = train_steps(fresh, fresh_opt, loss_fn, data[3:], rank, world)
    return {"after": after, "resumed": resumed, "extra": extra,
            "state_equal": all(torch.equal(saved[k], loaded[k]) for k in saved)
            and list(saved) == list(loaded),
            "files": sorted(os.listdir(path)) if rank == 0 else None}


def train_segment(rank: int, world: int, *, model: str, plan: Any, start: int, steps: int,
                  load: str | None, save: str | None, devices: Any = None) -> dict[str, Any]:
    """Steps ``start .. start+steps-1`` of the run, from a checkpoint (``load``) or from the
    seed, then save (``save``); the state right after loading is returned too."""
    data = batches(model, steps=start + steps)[start:]
    compiled, opt, loss_fn = _compile(model, plan, rank, world, seed=0 if load is None else 1,
                                      devices=devices)
    if load is not None:
        load_checkpoint(load, compiled, opt)
    at_start = compiled.full_state_dict()
    losses = train_steps(compiled, opt, loss_fn, data, rank, world)
    if save is not None:
        save_checkpoint(save, compiled, opt)
    return {"losses": losses, "at_start": at_start, "end": compiled.full_state_dict(),
            "local_numel": {n: held_numel(p) for n, p in compiled.named_parameters()},
            "strategies": {p.name: p.strategy for p in compiled.plan.params}}


def reference(model: str, *, steps: int) -> dict[str, Any]:
    """Single-process AdamW on the global batches (run in the test process)."""
    net, loss_fn = build(model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, states = [], []
    for batch in batches(model, steps=steps):
        states.append({k: v.clone() for k, v in net.state_dict().items()})
        loss = loss_fn(net(*batch[:1]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "states": states}


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except OSDPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def checkpoint_errors(rank: int, world: int, *, path: str, missing: str, split_plan: str,
                      not_checkpoint: str) -> dict[str, str]:
    """What load_checkpoint says about a missing path, another model, other splits, another
    optimizer, and a checkpoint without optimizer state (``path`` holds mlp under full_shard);
    what save_checkpoint says about a directory that is not a checkpoint."""
    out = {"missing": _error(lambda: load_checkpoint(missing, _compile("mlp", "full_shard",
                                                                        rank, world)[0]))}
    wide = _compile("mlp_wide", "full_shard", rank, world)[0]
    out["other_model"] = _error(lambda: load_checkpoint(path, wide))
    split = _compile("mlp", split_plan, rank, world)[0]
    out["other_splits"] = _error(lambda: load_checkpoint(path, split))
    compiled, _, _ = _compile("mlp", "replicate", rank, world)
    params = list(compiled.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:]}])
    out["other_groups"] = _error(lambda: load_checkpoint(path, compiled, two_groups))
    out["not_a_module"] = _error(lambda: load_checkpoint(path, torch.nn.Linear(2, 2)))
    out["not_checkpoint"] = _error(lambda: save_checkpoint(not_checkpoint, compiled))
    # the world is still usable after all of these: a good load works
    opt = torch.optim.AdamW(compiled.parameters())
    load_checkpoint(path, compiled, opt)
    out["loaded_steps"] = str(sorted({float(s["step"]) for s in opt.state.values()}))
    save_checkpoint(path + "-model-only", compiled)
    out["no_optimizer_state"] = _error(lambda: load_checkpoint(path + "-model-only", compiled,
                                                               opt))
    return out


def failed_saves(rank: int, world: int, *, path: str) -> dict[str, Any]:
    """Save a good checkpoint; then two saves that fail on rank 1 only: its optimizer holds a
    tensor that is not a parameter of the model (found before writing), and its optimizer state
    holds a tensor without data (a meta tensor: DCP fails while rank 1 writes its file, after
    rank 0 wrote its own). The first checkpoint must stay intact and loadable."""
    compiled, opt, loss_fn = _compile("mlp", "full_shard", rank, world)
    data = batches("mlp", steps=3)
    train_steps(compiled, opt, loss_fn, data[:2], rank, world)
    saved = compiled.full_state_dict()
    save_checkpoint(path, compiled, opt, extra="first")
    train_steps(compiled, opt, loss_fn, data[2:], rank, world)

    errors = {}
    stray = torch.nn.Parameter(torch.zeros(3))
    if rank == 1:
        opt.add_param_group({"params": [stray]})
    errors["stray_param"] = _error(lambda: save_checkpoint(path, compiled, opt, extra="second"))
    if rank == 1:
        del opt.param_groups[-1]
        p = compiled.get_parameter("mlp.layers.0.weight")
        opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].to("meta")
    errors["unsaveable_state"] = _error(lambda: save_checkpoint(path, compiled, opt,
                                                                extra="second"))
    leftovers = sorted(os.listdir(os.path.dirname(path)))

    fresh, fresh_opt, _ = _compile("mlp", "full_shard", rank, world, seed=1)
    extra = load_checkpoint(path, fresh, fresh_opt)
    loaded = fresh.full_state_dict()
    return {"errors": errors, "leftovers": leftovers, "extra": extra,
            "state_equal": all(torch.equal(saved[k], loaded[k]) for k in saved)}


def load_version_2(rank: int, world: int, *, path: str, plan: Any) -> dict[str, Any]:
    """Load the version-2 checkpoint of ``tests/data/checkpoint_v2`` (written by osdp-fx
    before shards were whole rows: every tensor flat, a split plan) into the MLP compiled under
    ``plan`` at this world size, and train the two steps that followed the save."""
    compiled, opt, loss_fn = _compile("mlp", plan, rank, world, seed=5)
    extra = load_checkpoint(os.path.join(path, "checkpoint"), compiled, opt)
    full = compiled.full_state_dict()
    after = train_steps(compiled, opt, loss_fn, batches("mlp", steps=4)[2:], rank, world)
    return {"extra": extra, "full": full, "after": after}

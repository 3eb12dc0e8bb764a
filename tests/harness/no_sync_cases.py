"""Gradient accumulation with ``compiled.no_sync()``: cases that run on every rank of a test
world, and the single-process reference they are compared with."""

from __future__ import annotations

import contextlib
import gc
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from osdp_fx import Devices, compile_osdp
from osdp_fx.runtime import collectives
from osdp_fx.runtime.storage_tracker import StorageTracker

from .models import batches, build, cast_forward, local


def _micro_batches(model: str, *, world: int, k: int, steps: int,
                   local_batch: int) -> list[list[tuple[torch.Tensor, ...]]]:
    """``steps`` steps of ``k`` global micro-batches of ``local_batch * world`` samples each."""
    flat = batches(model, global_batch=local_batch * world, steps=steps * k)
    return [flat[i * k:(i + 1) * k] for i in range(steps)]


def train_accumulating(rank: int, world: int, *, model: str, plan: Any, k: int = 3,
                       steps: int = 3, lr: float = 0.05, local_batch: int = 2,
                       devices: Any = None, mixed_precision: Any = None,
                       prefetch: int | None = None, seed: int = 0) -> dict[str, Any]:
    """SGD over ``steps`` steps of ``k`` micro-batches, the first ``k - 1`` inside no_sync."""
    net, loss_fn = build(model, seed)
    data = _micro_batches(model, world=world, k=k, steps=steps, local_batch=local_batch)
    data = [[local(b, rank, world) for b in step] for step in data]
    compiled = compile_osdp(net, data[0][0][:1], devices, plan=plan, prefetch=prefetch,
                            mixed_precision=mixed_precision, grad_accumulation=k)
    opt = torch.optim.SGD(compiled.parameters(), lr=lr)
    losses = []
    for micro_batches in data:
        for i, micro in enumerate(micro_batches):
            ctx = compiled.no_sync() if i < k - 1 else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(compiled(*micro[:1]), micro)
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "state": compiled.full_state_dict(),
            "plan": compiled.plan.to_dict()}


def train_interleaved(rank: int, world: int, *, model: str, plan: Any, steps: int = 3,
                      lr: float = 0.05, local_batch: int = 2) -> dict[str, Any]:
    """Steps of 3 micro-batches where the forward decides, as in DDP: micro-batch 0's forward
    runs inside no_sync and its backward outside; micro-batch 1's forward runs outside, then
    micro-batch 2 runs wholly inside no_sync, then micro-batch 1's backward (the synchronised
    one). Returns losses in micro-batch order and each backward's gradient collectives."""
    net, loss_fn = build(model)
    data = _micro_batches(model, world=world, k=3, steps=steps, local_batch=local_batch)
    data = [[local(b, rank, world) for b in step] for step in data]
    compiled = compile_osdp(net, data[0][0][:1], plan=plan, grad_accumulation=3)
    opt = torch.optim.SGD(compiled.parameters(), lr=lr)
    losses, grad_collectives = [], []

    def backward(loss: torch.Tensor) -> None:
        with counting_collectives() as counted:
            loss.backward()
        grad_collectives.append(counted["reduce_scatter"] + counted["all_reduce"])

    for m0, m1, m2 in data:
        with compiled.no_sync():
            loss0 = loss_fn(compiled(*m0[:1]), m0)
        backward(loss0)
        loss1 = loss_fn(compiled(*m1[:1]), m1)
        with compiled.no_sync():
            loss2 = loss_fn(compiled(*m2[:1]), m2)
            backward(loss2)
        backward(loss1)
        losses += [loss0.item(), loss1.item(), loss2.item()]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "state": compiled.full_state_dict(),
            "grad_collectives": grad_collectives}


class TwoHeads(torch.nn.Module):
    """Two linears read by two outputs; the second's weight is gathered alone when sharded."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(64, 300)
        self.second = torch.nn.Linear(64, 300)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(x), self.second(x)


def _two_heads_losses(out: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
    """Micro-batch 0 reads both heads, micro-batch 1 only the first."""
    first, second = out
    return first.square().mean() + (second.square().mean() if i == 0 else 0)


def unreached(rank: int, world: int, *, plan: Any) -> dict[str, Any]:
    """A no_sync micro-batch reaches both heads, the synchronised one only the first: the
    second's gradients (held, or in ``.grad``) must still be reduced, at the end of backward.
    Returns the full gradients after the step and the gradient collectives of that backward."""
    torch.manual_seed(0)
    net = TwoHeads()
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2 * world, 64, generator=gen)[2 * rank:2 * rank + 2] for _ in range(2)]
    compiled = compile_osdp(net, (xs[0],), plan=plan, grad_accumulation=2)
    with compiled.no_sync():
        _two_heads_losses(compiled(xs[0]), 0).backward()
    loss = _two_heads_losses(compiled(xs[1]), 1)
    with counting_collectives() as counted:
        loss.backward()
    return {"grads": compiled.full_grads(), "counted": dict(counted)}


def unreached_reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = TwoHeads()
    gen = torch.Generator().manual_seed(5)
    for i in range(2):
        _two_heads_losses(net(torch.randn(2 * world, 64, generator=gen)), i).backward()
    return {n: p.grad for n, p in net.named_parameters()}


def reference_accumulating(model: str, *, world: int, k: int = 3, steps: int = 3,
                           lr: float = 0.05, local_batch: int = 2, seed: int = 0,
                           param_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """One process: each step sums the losses of the ``k`` global micro-batches (a backward
    each, gradients accumulating), then one SGD step."""
    net, loss_fn = build(model, seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    forward = cast_forward(net, param_dtype)

    losses = []
    for micro_batches in _micro_batches(model, world=world, k=k, steps=steps,
                                        local_batch=local_batch):
        for micro in micro_batches:
            loss = loss_fn(forward(micro[0]), micro)
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "state": net.state_dict()}


def parity_errors(results: list[dict[str, Any]], ref: dict[str, Any]) -> tuple[float, float]:
    """(largest error of the mean loss over ranks of a micro-batch, largest error of a
    parameter on any rank) against the reference."""
    mean = torch.tensor([r["losses"] for r in results]).mean(0)
    loss_error = (mean - torch.tensor(ref["losses"])).abs().max().item()
    param_error = max((r["state"][key] - value).abs().max().item()
                      for r in results for key, value in ref["state"].items())
    return loss_error, param_error


# ---- counting collectives -----------------------------------------------------------------
_COUNTED = {  # where the runtime reaches each torch.distributed collective
    "all_gather": (collectives, "_all_gather_flat_impl"),
    "reduce_scatter": (collectives, "_reduce_scatter_flat_impl"),
    "all_reduce": (dist, "all_reduce"),
}


@contextlib.contextmanager
def counting_collectives() -> Iterator[Counter]:
    """Count the torch.distributed collectives called meanwhile; each wrapped function still
    runs (this measures the real calls)."""
    counts: Counter = Counter()
    originals = {name: getattr(owner, attr) for name, (owner, attr) in _COUNTED.items()}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name, (owner, attr) in _COUNTED.items():
        setattr(owner, attr, counted(name))
    try:
        yield counts
    finally:
        for name, (owner, attr) in _COUNTED.items():
            setattr(owner, attr, originals[name])


def count_collectives(rank: int, world: int, *, model: str, plan: Any, k: int = 3,
                      devices: Any = None, local_batch: int = 2) -> dict[str, Any]:
    """Collectives of each micro-batch's backward in a step of ``k`` (the first ``k - 1``
    inside no_sync), and of a plain step's backward, per collective."""
    net, loss_fn = build(model)
    (step,) = _micro_batches(model, world=world, k=k, steps=1, local_batch=local_batch)
    step = [local(b, rank, world) for b in step]
    compiled = compile_osdp(net, step[0][:1], devices, plan=plan, grad_accumulation=k)
    backwards, forwards = [], []
    for i, micro in enumerate(step):
        with compiled.no_sync() if i < k - 1 else contextlib.nullcontext():
            with counting_collectives() as counted:
                loss = loss_fn(compiled(*micro[:1]), micro)
            forwards.append(dict(counted))
            with counting_collectives() as counted:
                loss.backward()
            backwards.append(dict(counted))
    accumulated = compiled.full_grads()
    compiled.zero_grad()
    loss = loss_fn(compiled(*step[0][:1]), step[0])
    with counting_collectives() as counted:
        loss.backward()
    return {"forwards": forwards, "backwards": backwards, "plain_backward": dict(counted),
            "grad_norm": sum(float(g.norm()) for g in accumulated.values() if g is not None)}


# ---- memory ---------------------------------------------------------------------------------
def accumulation_memory(rank: int, world: int, *, plan: str, k: int = 3, steps: int = 3,
                        optimizer: str = "sgd") -> dict[str, Any]:
    """Peaks of steps of ``k`` micro-batches (the first ``k - 1`` inside no_sync) measured by
    the independent storage tracker, against the predictions with grad_accumulation=k and 1."""
    from .memory_cases import batch
    from .memory_cases import build as build_memory_model

    gc.collect()
    x = batch(rank)
    one = compile_osdp(build_memory_model("gpt"), (x,), Devices(world_size=world), plan=plan,
                       optimizer=optimizer).plan
    compiled = compile_osdp(build_memory_model("gpt"), (x,), Devices(world_size=world),
                            plan=plan, optimizer=optimizer, grad_accumulation=k)
    gc.collect()
    opt_class = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    opt = opt_class(compiled.parameters(), lr=1e-3)

    def measure(micro_batches: int) -> tuple[int, int]:
        tracker = StorageTracker()
        with tracker:
            for i in range(micro_batches):
                with compiled.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
                    loss = compiled(x)
                    loss.backward()
                    del loss
            opt.step()
            opt.zero_grad()
        return tracker.start_bytes, tracker.peak_bytes

    measured = [measure(k) for _ in range(steps)]
    measured_k1 = measure(1)
    pr, pr1 = compiled.plan.prediction, one.prediction
    assert pr is not None and pr1 is not None
    return {"predicted": pr.peak_memory_bytes, "predicted_k1": pr1.peak_memory_bytes,
            "peak_at": pr.peak_at, "breakdown": pr.breakdown(), "measured": measured,
            "measured_k1": measured_k1[1], "grad_accumulation": pr.grad_accumulation,
            "sharded_full_grad_bytes": sum(p.nbytes for p in compiled.plan.params
                                           if p.strategy != "replicate")}

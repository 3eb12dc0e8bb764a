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


def gloo_reduce_scatter(rank: int, world: int, *, numel: int = 1 << 18) -> dict[str, Any]:
    """``reduce_scatter_flat_start`` on gloo: the chunk it returns, whether the input was left
    as it was (handed over: freed), and the storages of the input's size that the process holds
    once the collective is waited for (the live-storage tracker of the benchmarks)."""
    from osdp_fx.runtime.collectives import reduce_scatter_flat_start

    from .memory_cases import StorageTracker

    out: dict[str, Any] = {}
    for consume in (False, True):
        full = torch.arange(numel, dtype=torch.float32) * (rank + 1)
        tracker = StorageTracker(extra=[full])
        with tracker:
            pending = reduce_scatter_flat_start(full, "world", consume=consume)
            chunk = pending.wait()
            tracker.update()
        out[consume] = {
            "chunk": chunk, "input_kept": full.untyped_storage().nbytes() > 0 and torch.equal(
                full, torch.arange(numel, dtype=torch.float32) * (rank + 1)),
            # what the process holds now beyond what it held before and this rank's chunk:
            # gloo's own reduce_scatter_tensor would hold a clone of the input in its work
            "extra_bytes": tracker.live_bytes - tracker.start_bytes
            - chunk.untyped_storage().nbytes(),
        }
        del pending
    return out


def gloo_all_gather_send_buffer(rank: int, world: int, *, numel: int = 1 << 16) -> dict[str, Any]:
    """``all_gather_flat_start`` with the send buffer kept by the caller or handed over: the
    gathered result and the bytes the send buffer's storage holds once waited for."""
    from osdp_fx.runtime.collectives import all_gather_flat_start

    out: dict[str, Any] = {}
    for consume in (False, True):
        send = torch.arange(numel, dtype=torch.float32) + rank * numel
        gathered = all_gather_flat_start(send, "world", consume=consume).wait()
        out[consume] = {"gathered": gathered, "send_bytes": send.untyped_storage().nbytes()}
    return out


def gloo_all_gather_outputs_let_go(rank: int, world: int, *, gathers: int = 200,
                                   numel: int = 1 << 12) -> dict[str, Any]:
    """``all_gather_flat_start(...).wait()`` ``gathers`` times: how many outputs were still
    referred to from elsewhere (gloo's worker) when ``wait()`` returned, as many references as a
    tensor of one's own has, and the sum of what was gathered (it must stay right)."""
    from osdp_fx.runtime.collectives import all_gather_flat_start, references

    own = references(torch.empty(numel))
    held_elsewhere, total = 0, 0.0
    for _ in range(gathers):
        gathered = all_gather_flat_start(torch.full((numel,), rank + 1.0), "world").wait()
        held_elsewhere += references(gathered) > own
        total += gathered.sum().item()
    return {"held_elsewhere": held_elsewhere, "total": total}


def replicated_in_a_mixed_plan(rank: int, world: int, *, plan: str) -> dict[str, Any]:
    """The test MLP compiled under ``plan`` (a file sharding one group, replicating the rest)
    and under ``replicate``; on this rank's slice of one batch: each replicated parameter's
    placement, how often a post-accumulate-grad hook the user registered on it fired and what
    ``p.grad`` was then, the gradients after one backward, after a second one without
    ``zero_grad`` (accumulated), after ``zero_grad`` and one more, and after ``.double()``."""
    from osdp_fx import compile_osdp

    from .models import batches, build, local

    x, y = local(batches("mlp", global_batch=2 * world, steps=1)[0], rank, world)
    out: dict[str, Any] = {}
    for label, chosen in (("mixed", plan), ("replicate", "replicate")):
        model, loss_fn = build("mlp")
        compiled = compile_osdp(model, (x,), plan=chosen, optimizer="sgd", plan_cache=False)
        seen: dict[str, list[str]] = {}
        for name, p in compiled.named_parameters():
            seen[name] = []
            p.register_post_accumulate_grad_hook(
                lambda q, name=name: seen[name].append(type(q.grad).__name__))

        def backward() -> None:
            loss_fn(compiled(x), (x, y)).backward()

        def grads() -> dict[str, torch.Tensor]:
            return {n: getattr(p.grad, "_local_tensor", p.grad).clone()
                    for n, p in compiled.named_parameters()}

        def leaves() -> dict[str, bool]:  # whether each DTensor's local tensor needs a gradient
            return {n: bool(p._local_tensor.requires_grad)
                    for n, p in compiled.named_parameters() if hasattr(p, "_local_tensor")}

        backward()
        once = grads()
        backward()
        twice = grads()
        compiled.zero_grad(set_to_none=True)
        backward()
        again = grads()
        compiled.zero_grad(set_to_none=True)
        before = leaves()
        compiled.double()
        loss_fn(compiled(x.double()), (x.double(), y.double())).backward()
        out[label] = {
            "leaves": (before, leaves()),
            "placements": {n: str(getattr(p, "placements", None))
                           for n, p in compiled.named_parameters()},
            "hooks": seen, "once": once, "twice": twice, "again": again,
            "double": {n: (p.grad.dtype, type(p.grad).__name__)
                       for n, p in compiled.named_parameters()}}
    return out


def clocked_collectives(rank: int, world: int) -> dict[str, Any]:
    """The collective clock's counts over a reducer's step, a gather, a reduce-scatter and a
    blocking all-reduce; and what runs outside the clock, and inside a clock opened within it,
    leaves the outer clock as it was."""
    from osdp_fx.runtime import collectives as c

    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(2)])
    reducer = GradReducer(list(layers.parameters()), "world", bucket_bytes=(16 * 16 + 16) * 4)
    before = c.all_gather_flat(torch.ones(4), c.WORLD)  # outside any clock: not counted
    with c.collective_clock() as clock:
        layers(torch.randn(2, 16)).sum().backward()  # two buckets: two all-reduces, awaited
        after_reducer = (clock.launches, clock.waits)
        pending = c.all_gather_flat_start(torch.full((4,), float(rank)), c.WORLD)
        gathered = pending.wait()
        pending.wait()  # waited for already: not counted again
        chunk = c.reduce_scatter_flat(torch.ones(2 * world), c.WORLD)
        with c.collective_clock() as inner:
            c.all_reduce_sum_(torch.ones(3), c.WORLD)
        counts = (clock.launches, clock.waits, clock.launch_s, clock.wait_s)
    return {"before": before.tolist(), "buckets": len(reducer.buckets),
            "after_reducer": after_reducer, "counts": counts,
            "inner": (inner.launches, inner.waits, inner.wait_s), "gathered": gathered.tolist(),
            "chunk": chunk.tolist()}

"""``torch.compile(compiled)`` against the eager compiled module: cases that run on every rank
of a test world."""

from __future__ import annotations

from typing import Any

import torch

from osdp_fx import compile_osdp
from osdp_fx.runtime.storage_tracker import StorageTracker

from .models import batches, build, local


def collective_call_sites(gm: torch.fx.GraphModule) -> int:
    """The graph's collective calls (regions of compute lie between them)."""
    from osdp_fx.runtime.compile_support import is_collective_call

    return sum(1 for n in gm.graph.nodes if is_collective_call(n))


def train_both(rank: int, world: int, *, model: str, plan: Any, backend: str,
               steps: int = 3, lr: float = 0.05, local_batch: int = 2, devices: Any = None,
               mixed_precision: Any = None, prefetch: int | None = None,
               method: bool = False, accumulate: int = 1,
               measure_held: bool = True) -> dict[str, Any]:
    """Train the same model from the same seed twice, eager and under ``torch.compile`` with
    ``backend``, ``steps`` SGD steps each; return both runs' losses and final states and how
    many graphs dynamo compiled, and how many regions torch.compile had and the way each runs
    once chosen (``region_modes``, None before the trials end). ``method``: compile with ``compiled.compile()`` instead.
    ``accumulate``: each step first runs ``accumulate - 1`` forwards and backwards of its batch
    inside ``compiled.no_sync()``. ``held_after_forward``: the bytes of the storages the
    process holds after the last step's forward beyond those it held before it (the
    independent tracker of ``osdp_fx/runtime/storage_tracker.py``; 0 without ``measure_held``: the
    tracker reads the tensors autograd saved, which selective checkpointing allows only once)."""
    data = [local(b, rank, world) for b in batches(model, global_batch=local_batch * world,
                                                    steps=steps)]
    runs: dict[str, Any] = {}
    torch._dynamo.utils.counters.clear()
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        net, loss_fn = build(model, 0)
        compiled = compile_osdp(net, data[0][:1], devices, plan=plan,
                                mixed_precision=mixed_precision, prefetch=prefetch)
        del net
        forward = compiled
        if mode == "compiled" and method:
            compiled.compile(backend=backend)
        elif mode == "compiled":
            forward = torch.compile(compiled, backend=backend)
        opt = torch.optim.SGD(compiled.parameters(), lr=lr)
        losses, held = [], 0
        for step, batch in enumerate(data):
            for _ in range(accumulate - 1):
                with compiled.no_sync():
                    loss_fn(forward(*batch[:1]), batch).backward()
            last = measure_held and step == len(data) - 1
            base = StorageTracker().live_bytes if last else 0
            out = forward(*batch[:1])
            if last:
                held = StorageTracker(extra=[out]).live_bytes - base
            loss = loss_fn(out, batch)
            del out
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        runs[mode] = {"losses": losses, "held_after_forward": held,
                      "state": compiled.full_state_dict(), "plan": compiled.plan.to_dict()}
        if mode == "compiled":
            regions = compiled._compiled_regions()
            runs["call_sites"] = collective_call_sites(compiled.graph_module)
            runs["regions"] = len(regions.regions)
            runs["region_modes"] = [r.mode for r in regions.regions] if regions.decided else None
    runs["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    runs["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch._dynamo.reset()
    return runs

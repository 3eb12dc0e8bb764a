"""Cases for a world treated as a mesh of nodes x ranks per node (hybrid_shard, hierarchical)."""

from __future__ import annotations

import os
from typing import Any

import torch

from osdp_fx import compile_osdp
from osdp_fx.core.setting import StepSetting
from osdp_fx.passes.capture import capture
from osdp_fx.plan.plan import MESH_STRATEGIES
from osdp_fx.planner.make import plan_model
from osdp_fx.runtime.collectives import all_gather_flat
from osdp_fx.runtime.hierarchy import (
    gather_shards_start,
    init_mesh,
    mesh_shape,
    reduce_scatter_shards_start,
    shard_layout,
)
from osdp_fx.runtime.params import make_shard

from .held import held_numel
from .models import batches, build, local


def two_level_collectives(rank: int, world: int, *, ranks_per_node: int,
                          numel: int) -> dict[str, Any]:
    """Gather ``arange(numel)`` from its shards, and reduce-scatter ``(rank + 1) * arange``,
    under each mesh strategy, on buffers kept and on buffers handed over (``consume``, with
    the bytes those hold afterwards); for hierarchical also what its first (inter-node) stage
    gathers."""
    init_mesh(world, ranks_per_node)
    nodes, per_node = mesh_shape(world, ranks_per_node)
    out: dict[str, Any] = {}
    for strategy in MESH_STRATEGIES:
        layout = shard_layout(strategy, world_size=world, ranks_per_node=ranks_per_node,
                              rank=rank)
        full = torch.arange(float(numel))
        shard = make_shard(full, world_size=layout.chunks, rank=layout.index).detach()
        padded = shard.numel() * layout.chunks
        out[strategy] = {
            "layout": layout,
            "shard": shard,
            "gathered": gather_shards_start(shard, layout.group).wait(),
            "reduced": reduce_scatter_shards_start((rank + 1) * torch.arange(float(padded)),
                                                   layout.group).wait(),
        }
        # the same collectives on buffers handed over (consume): each is released once read
        given_shard = shard.clone()
        given_full = (rank + 1) * torch.arange(float(padded))
        out[strategy]["gathered_given"] = gather_shards_start(given_shard, layout.group,
                                                              consume=True).wait()
        out[strategy]["reduced_given"] = reduce_scatter_shards_start(given_full, layout.group,
                                                                     consume=True).wait()
        out[strategy]["given_released"] = (given_shard.untyped_storage().nbytes(),
                                           given_full.untyped_storage().nbytes())
        if strategy == "hierarchical":
            out[strategy]["inter_block"] = all_gather_flat(shard, f"inter/{nodes}x{per_node}")
    return out


def with_env(rank: int, world: int, *, env: dict[str, str], case: Any,
             **kwargs: Any) -> Any:
    """Run ``case`` with environment variables set (as torchrun sets LOCAL_WORLD_SIZE)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return case(rank, world, **kwargs)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_and_export(rank: int, world: int, *, model: str, plan: Any,
                    devices: Any) -> dict[str, Any]:
    """Load another model's full state into the shards; export it back and run a forward."""
    net, _ = build(model, seed=0)
    other, _ = build(model, seed=1)
    (batch,) = [local(b, rank, world) for b in batches(model, global_batch=2 * world, steps=1)]
    compiled = compile_osdp(net, batch[:1], devices, plan=plan)
    compiled.load_full_state_dict(other.state_dict())
    with torch.no_grad():
        out, expected = compiled(*batch[:1]), other(*batch[:1])
    return {"state": compiled.full_state_dict(), "expected_state": other.state_dict(),
            "out": out, "expected_out": expected,
            "local_numel": {n: held_numel(p) for n, p in compiled.named_parameters()},
            "table": str(compiled.plan)}



def predicted_peak_bytes(model: str, plan: str, devices: Any, *, local_batch: int = 2) -> int:
    """The peak memory per rank compile_osdp predicts for ``model`` under ``plan`` on
    ``devices`` (AdamW), planned offline in this process."""
    net, _ = build(model)
    (batch,) = batches(model, global_batch=local_batch, steps=1)
    resolved = plan_model(capture(net, batch[:1]), batch[:1], plan,
                          StepSetting(devices, optimizer="adamw")).plan
    return resolved.peak_memory_bytes

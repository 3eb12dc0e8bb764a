"""Plan cache cases: run on every rank of a test world."""

from __future__ import annotations

from typing import Any

from osdp_fx import compile_osdp

from . import models


def compile_twice(rank: int, world: int, *, cache: str) -> dict[str, Any]:
    """Compile the same GPT twice with a search and the plan cache in ``cache``: each time's
    plan hash and splits."""
    batch = models.local(models.batches("gpt", global_batch=2 * world, steps=1)[0], rank, world)
    out = []
    for _ in range(2):
        net, _ = models.build("gpt", 0)
        compiled = compile_osdp(net, batch[:1], plan_cache=cache)
        out.append((compiled.plan.hash(), compiled.plan.splits))
    return {"hashes": out}

"""The memory promise on a mixture of experts: a tiny Hugging Face Mixtral (captured by
torch.export: top-k routing, a sort and gathers of the tokens by expert, grouped matrix products
over 3-D expert weights), called as its users call it (``model(input_ids=..., labels=...)``,
computing its own loss), trained under full_shard, under the plan searched with a memory limit
15 % above full_shard's predicted peak, and under a written mix of the three strategies, each
step measured by the storage tracker against the prediction at its shape (issue 57)."""

from __future__ import annotations

import gc
import json
from typing import Any

import torch
from torch import nn

from osdp_fx import Devices, compile_osdp
from osdp_fx.runtime.storage_tracker import StorageTracker

from .memory_cases import earlier_storages

VOCAB = 512
SHAPES = ((4, 32), (2, 32), (4, 16), (4, 48))
"""Per-rank (batch, sequence length) of the steps; the first is the example."""
MAX_SHAPE = (4, 48)


def build() -> nn.Module:
    """Mixtral with 2 layers of 4 experts (2 per token), hidden 128, random weights."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                        use_cache=False)
    return MixtralForCausalLM(cfg)


def batch(shape: tuple[int, int], step: int, rank: int) -> dict[str, torch.Tensor]:
    b, s = shape
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(2, VOCAB, (b, s), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def mixed_plan(path: str) -> str:
    """A plan file: replicate, shard_grad_op and full_shard in turn over the parameter groups."""
    strategies = ("replicate", "shard_grad_op", "full_shard")
    names = [n for n, _ in build().named_parameters()]
    with open(path, "w") as f:
        json.dump({"format": "osdp-fx-plan", "version": 1,
                   "params": {n: strategies[i % 3] for i, n in enumerate(names)}}, f)
    return path


def train_measured(rank: int, world: int, *, plan_dir: str, limit_factor: float = 1.15,
                   optimizer: str = "adamw", shapes: tuple[tuple[int, int], ...] = SHAPES,
                   ) -> dict[str, Any]:
    """full_shard, the plan searched under ``limit_factor`` x full_shard's predicted peak, and
    :func:`mixed_plan`: per plan its strategy counts, and per step (after one warm-up step at
    the example shape, so that the optimizer's state exists) the shape, the measured and the
    predicted peak."""
    out: dict[str, Any] = {}
    limit = None
    for plan in ("full_shard", None, mixed_plan(f"{plan_dir}/mixed.{rank}.json")):
        gc.collect()  # what earlier cases left, so that it is not counted here
        held_before = earlier_storages([])
        compiled = compile_osdp(build(), (), Devices(world_size=world),
                                example_kwargs=batch(shapes[0], 0, rank), plan=plan,
                                memory_limit=limit if plan is None else None,
                                max_shape=MAX_SHAPE, optimizer=optimizer)
        prediction = compiled.plan.prediction
        if plan == "full_shard":
            limit = int(prediction.peak_memory_bytes * limit_factor)
        opt_class = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
        opt = opt_class(compiled.parameters(), lr=1e-3)
        steps = []
        for step, shape in enumerate((shapes[0], *shapes)):
            x = batch(shape, step, rank)
            tracker = StorageTracker()
            with tracker:
                output = compiled(**x)
                output.loss.backward()
                opt.step()
                opt.zero_grad()
                del output
            held = sum(s.nbytes() for s in (ref() for ref in held_before) if s is not None)
            steps.append((shape, tracker.peak_bytes - held, prediction.peak_bytes_at(*shape)))
        label = "searched" if plan is None else plan if plan == "full_shard" else "mixed"
        out[label] = {
            "steps": steps[1:], "counts": compiled.plan.counts(), "limit": limit,
            "peak_at": prediction.peak_at, "breakdown": prediction.breakdown(),
            "fits": plan is not None or prediction.peak_memory_bytes <= limit}
        del compiled, opt
    return out

"""Cases for inputs of any batch size and sequence length, and for keyword inputs: one compiled
module trains on a schedule of shapes (batch 1, a smaller last batch, shorter and longer
sequences than the example) like one process on the global batches."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
from torch import nn

from osdp_fx import OSDPError, compile_osdp

from .models import build as build_model

VOCAB = 67
EXAMPLE = (4, 8)
"""Per-rank (batch, sequence length) of the example inputs."""
SCHEDULE = ((4, 8), (1, 8), (3, 8), (4, 5), (4, 14), (2, 16))
"""Per-rank (batch, sequence length) of each training step."""


def build(model: str) -> nn.Module:
    """'gpt': the traced TinyGPT of the tests (positional token ids, returns logits); 'llama': a
    Hugging Face Llama (captured by torch.export), called with keywords, computing its loss."""
    if model == "gpt":
        return build_model("gpt")[0]
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(cfg)


def global_batch(step: int, shape: tuple[int, int], world: int) -> dict[str, torch.Tensor]:
    """Token ids and an attention mask with left padding (the first rows padded by a few tokens),
    for ``world`` ranks of ``shape``; labels are the ids (no token ignored, so every rank's
    loss is a mean over the same number of tokens and their mean is the global loss)."""
    gen = torch.Generator().manual_seed(100 + step)
    b, s = shape
    ids = torch.randint(0, VOCAB, (b * world, s), generator=gen)
    mask = torch.ones_like(ids)
    for row in range(0, b * world, 2):
        mask[row, :min(2, s - 1)] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def loss_of(model: str, net: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if model == "gpt":
        from osdp_fx.examples import lm_loss

        return lm_loss(net(batch["input_ids"]), batch["input_ids"])
    out = net(**batch)
    assert type(out).__name__ == "CausalLMOutputWithPast", type(out)
    assert out.logits.shape[:2] == batch["input_ids"].shape
    return out.loss


def example_kwargs(model: str, rank: int, world: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    batch = _local(global_batch(0, EXAMPLE, world), rank, world)
    if model == "gpt":
        return (batch["input_ids"],), {}
    return (), batch


def _local(batch: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    n = batch["input_ids"].shape[0] // world
    return {k: v[rank * n:(rank + 1) * n] for k, v in batch.items()}


def plan_for(model: str, plan: str) -> Any:
    """'full_shard', or 'mixed': full_shard, replicate and shard_grad_op in turn per group."""
    if plan != "mixed":
        return plan
    strategies = ("full_shard", "replicate", "shard_grad_op")
    names = [n for n, _ in build(model).named_parameters()]
    fd, path = tempfile.mkstemp(suffix=".json")  # one file per rank
    with os.fdopen(fd, "w") as f:
        json.dump({"format": "osdp-fx-plan", "version": 1, "params": {
            n: strategies[i % 3] for i, n in enumerate(names)}}, f)
    return path


def train_shapes(rank: int, world: int, *, model: str, plan: str, lr: float = 0.05,
                 schedule: tuple[tuple[int, int], ...] = SCHEDULE) -> dict[str, Any]:
    """Compile at ``EXAMPLE`` and train one SGD step per shape of ``schedule``."""
    args, kwargs = example_kwargs(model, rank, world)
    compiled = compile_osdp(build(model), args, plan=plan_for(model, plan),
                            example_kwargs=kwargs)
    opt = torch.optim.SGD(compiled.parameters(), lr=lr)
    losses = []
    for step, shape in enumerate(schedule):
        loss = loss_of(model, compiled, _local(global_batch(step, shape, world), rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": compiled.full_state_dict(),
            "captured_by": compiled.captured_by}


def reference_shapes(model: str, *, world: int, lr: float = 0.05,
                     schedule: tuple[tuple[int, int], ...] = SCHEDULE) -> dict[str, Any]:
    """One process on the global batches of :func:`train_shapes`."""
    net = build(model)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for step, shape in enumerate(schedule):
        loss = loss_of(model, net, global_batch(step, shape, world))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": net.state_dict()}


def over_limit(rank: int, world: int, *, model: str) -> dict[str, Any]:
    """Compile under a limit 1 % above the example's predicted peak; a larger shape within it
    trains, one over it raises on every rank before any collective, and training goes on."""
    args, kwargs = example_kwargs(model, rank, world)
    peak = compile_osdp(build(model), args, plan="full_shard",
                        example_kwargs=kwargs).plan.prediction.peak_memory_bytes
    compiled = compile_osdp(build(model), args, plan="full_shard", example_kwargs=kwargs,
                            memory_limit=int(peak * 1.01))
    pr = compiled.plan.prediction
    out: dict[str, Any] = {"limit": int(peak * 1.01), "peak": peak,
                           "seq_len": pr.seq_len, "expr": str(pr.peak_memory_shape_expr)}
    big = (EXAMPLE[0] * 4, EXAMPLE[1] * 2)
    out["big_predicted"] = pr.peak_bytes_at(*big)
    try:
        loss_of(model, compiled, _local(global_batch(0, big, world), rank, world))
        out["error"] = None
    except OSDPError as exc:
        out["error"] = str(exc)
    loss = loss_of(model, compiled, _local(global_batch(1, EXAMPLE, world), rank, world))
    loss.backward()
    out["after"] = loss.item()
    return out

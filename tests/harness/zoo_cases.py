"""A zoo of Hugging Face architectures compiled unwrapped, called as their users call them:
``model(input_ids=..., attention_mask=..., labels=...)`` with right padding, the model computing
its own loss (tiny configs, random weights, dropout off)."""

from __future__ import annotations

import contextlib
import gc
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from osdp_fx import compile_osdp
from osdp_fx.runtime.storage_tracker import StorageTracker

from .memory_cases import earlier_storages

VOCAB = 97
SHAPES = ((4, 10), (3, 7), (4, 12))
"""Per-rank (batch, sequence length) of the three training steps; the first is the example."""
MAX_SHAPE = (4, 12)
"""The largest of them, declared to compile_osdp."""


def _configs(layers: int = 1) -> dict[str, Callable[[], nn.Module]]:
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64)
    gqa = dict(common, num_key_value_heads=2)
    return {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**gqa)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**gqa)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**gqa)),
        "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**gqa, head_dim=8)),
        "phi": lambda: T.PhiForCausalLM(T.PhiConfig(**common)),
        "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**common)),
        "falcon": lambda: T.FalconForCausalLM(T.FalconConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4)),
        "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(
            vocab_size=VOCAB, hidden_size=32, n_layer=layers, n_head=4)),
        "opt": lambda: T.OPTForCausalLM(T.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
            ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0)),
        "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0)),
        "bert": lambda: T.BertForMaskedLM(T.BertConfig(
            **common, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "roberta": lambda: T.RobertaForMaskedLM(T.RobertaConfig(
            **dict(common, max_position_embeddings=80), pad_token_id=1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
        "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_heads=4,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)),
        "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(
            **gqa, num_local_experts=4, num_experts_per_tok=2)),
    }


ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "falcon", "bloom",
                 "opt", "gpt2", "bert", "roberta", "t5", "mixtral")


def build(arch: str, layers: int = 1) -> nn.Module:
    """The architecture's tiny model (``layers`` decoder or encoder layers; 1 in the zoo)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    net = _configs(layers)[arch]()
    net.config.use_cache = False  # training: no key/value cache (capture.py says so if on)
    return net


def batch(arch: str, step: int, rank: int) -> dict[str, Any]:
    """This rank's keyword inputs of a step: right-padded rows (masked, labels -100)."""
    b, s = SHAPES[step]
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(2, VOCAB, (b, s), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    mask[b - 1, -2:] = 0
    out = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    if arch == "t5":  # T5 returns a cache whatever its config says, unless the call says not to
        out["use_cache"] = False
    return out


def _train(net: Any, arch: str, ranks: range, *, lr: float, peaks: list[int] | None = None,
           held_before: list[weakref.ref] = ()) -> list[float]:
    """SGD steps on the mean of the ranks' losses (what averaging gradients over ranks does);
    ``peaks`` gets each step's peak bytes as a storage tracker counts them, less those of the
    storages ``held_before`` (what the process held before compiling: earlier cases')."""
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for step in range(len(SHAPES)):
        tracker = StorageTracker() if peaks is not None else contextlib.nullcontext()
        with tracker:
            out = [net(**batch(arch, step, r)) for r in ranks]  # held through the step
            loss = sum(o.loss for o in out) / len(ranks)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            del out, loss
        if peaks is not None:
            earlier = (ref() for ref in held_before)
            peaks.append(tracker.peak_bytes - sum(s.nbytes() for s in earlier if s is not None))
    return losses


def zoo_train(rank: int, world: int, *, arch: str, lr: float = 0.05) -> dict[str, Any]:
    """Train ``arch`` unwrapped for three steps under full_shard and under the plan searched
    under a limit 20 % above full_shard's predicted peak; rank 0 also trains one process on
    every rank's batches."""
    out: dict[str, Any] = {}
    limit = None
    for plan in ("full_shard", None):
        gc.collect()  # what earlier cases left, so that it is not counted here
        held_before = earlier_storages([])
        compiled = compile_osdp(build(arch), (), example_kwargs=batch(arch, 0, rank), plan=plan,
                                memory_limit=limit, max_shape=MAX_SHAPE, optimizer="sgd")
        # the search under a limit 20 % above full_shard's peak
        limit = int(compiled.plan.prediction.peak_memory_bytes * 1.2)
        peaks: list[int] = []
        losses = _train(compiled, arch, range(rank, rank + 1), lr=lr, peaks=peaks,
                        held_before=held_before)
        out[plan or "searched"] = {
            "losses": losses, "peaks": peaks,
            "predicted": [compiled.plan.prediction.peak_bytes_at(b, s) for b, s in SHAPES],
            "state": compiled.full_state_dict(),
            "strategies": sorted({p.strategy for p in compiled.plan.params}),
            "fits": compiled.plan.peak_memory_bytes <= (limit if plan is None else math.inf),
        }
        with torch.no_grad():
            out[plan or "searched"]["output"] = type(compiled(**batch(arch, 0, rank))).__name__
        del compiled
    if rank == 0:
        net = build(arch)
        out["reference"] = {"losses": _train(net, arch, range(world), lr=lr),
                            "state": net.state_dict(),
                            "output": type(net(**batch(arch, 0, 0))).__name__}
    return out


"""The memory promise, measured as a user measures it (an independent storage tracker, from the
first step, no ``gc.collect()`` for the user): cases run on every rank of a test world."""

from __future__ import annotations

import gc
import json
import time
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from osdp_fx import Devices, compile_osdp
from osdp_fx.examples import GPTWithLoss, HFCausalLMWithLoss, TinyGPT
from osdp_fx.runtime.storage_tracker import StorageTracker, dense_tensors, held_tensors

VOCAB = 512


def build(model: str, *, device: str = "cpu") -> nn.Module:
    """'gpt': the traced GPT of compare.py, smaller ('gpt_4_blocks': with 4 blocks, not 2);
    'llama' and 'gpt2': Hugging Face models (captured by torch.export); 'llama_lora': peft's
    LoRA on that Llama, its base frozen in bf16, its adapters in fp32."""
    torch.manual_seed(0)
    with torch.device(device):
        if model in ("gpt", "gpt_4_blocks"):
            depth = 4 if model == "gpt_4_blocks" else 2
            return GPTWithLoss(TinyGPT(vocab=VOCAB, dim=256, depth=depth, heads=4, max_seq=64))
        if model in ("llama", "llama_lora"):
            from transformers import LlamaConfig, LlamaForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                              max_position_embeddings=64)
            llama = LlamaForCausalLM(cfg)
            if model == "llama_lora":
                from peft import LoraConfig, get_peft_model

                llama = get_peft_model(llama.to(torch.bfloat16), LoraConfig(
                    r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
            return HFCausalLMWithLoss(llama)
        if model == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=64,
                             use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            return HFCausalLMWithLoss(GPT2LMHeadModel(cfg))
    raise ValueError(model)


def batch(rank: int, *, seq: int = 64, size: int = 4) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, VOCAB, (size, seq), generator=gen)


def _held_storages() -> set[int]:
    return {d.untyped_storage()._cdata for t in held_tensors() for d in dense_tensors(t)}


def earlier_storages(own: list[torch.Tensor]) -> list[weakref.ref]:
    """The storages the process holds now (in a shared test world: what earlier cases still
    hold), but those of ``own`` (the case's model and inputs)."""
    mine = {d.untyped_storage()._cdata for t in own for d in dense_tensors(t)}
    storages = {d.untyped_storage()._cdata: d.untyped_storage()
                for t in held_tensors() for d in dense_tensors(t)}
    return [weakref.ref(s) for key, s in storages.items() if key not in mine]


def _stray_tensors(compiled: nn.Module, inputs: tuple[torch.Tensor, ...],
                   before: set[int]) -> list[str]:
    """Tensors the process holds that it did not hold ``before`` compiling and that are none of
    the compiled module's parameters and buffers (with the device meshes its DTensors live on)
    and the user's inputs."""
    meshes = {id(p.device_mesh): p.device_mesh for p in compiled.parameters()
              if isinstance(p, DTensor)}
    mesh_tensors = [v for m in meshes.values() for v in vars(m).values()
                    if isinstance(v, torch.Tensor)]
    own = before | {d.untyped_storage()._cdata for t in (*compiled.parameters(),
                                                         *compiled.buffers(), *inputs,
                                                         *mesh_tensors)
                    for d in dense_tensors(t)}
    return sorted({f"{tuple(d.shape)} {d.dtype} {d.untyped_storage().nbytes()} B"
                   for t in held_tensors() for d in dense_tensors(t)
                   if d.untyped_storage().nbytes() and d.untyped_storage()._cdata not in own})


def compile_and_steps(rank: int, world: int, *, model: str, plan: Any = None,
                      limit: int | None = None, steps: int = 5, optimizer: str = "adamw",
                      on_meta: bool = False, **options: Any) -> dict[str, Any]:
    """Compile with the cyclic collector off (so cycles left by compile stay visible), then
    train ``steps`` steps, each measured from its start by a fresh :class:`StorageTracker`.

    Returns the predictions, the tracker's (start, peak) bytes per step, the bytes of tensors
    that compile left in reference cycles, and the tensors held besides the compiled module's.
    What earlier cases of the shared world held before this one compiled and still hold after a
    step (alive throughout it) is not this case's: it is left out of the step's bytes.
    """
    gc.collect()  # what earlier cases in this process left, so that it is not counted here
    net = build(model, device="meta" if on_meta else "cpu")
    if options.get("init_fn") == "hf":  # a Hugging Face model's own initialisation
        options["init_fn"] = net.model._init_weights
    x = batch(rank)
    enabled = gc.isenabled()
    gc.disable()
    before = _held_storages() - {p.untyped_storage()._cdata for p in net.parameters()}
    earlier = earlier_storages([*net.parameters(), *net.buffers(), x])
    try:
        compiled = compile_osdp(net, (x,), Devices(world_size=world), plan=plan,
                                memory_limit=limit, optimizer=optimizer, **options)
        del net
        # gloo's worker thread drops a finished collective's tensors a moment after wait()
        # returns (the last broadcast's, 10-20 KB): look again for up to 0.5 s
        for _ in range(51):
            stray = _stray_tensors(compiled, (x,), before)
            if not stray:
                break
            time.sleep(0.01)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycles = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                  for t in gc.garbage if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        garbage = len(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    opt_class = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[optimizer]
    opt = opt_class(compiled.parameters(), lr=1e-3)
    measured = []
    for _ in range(steps):
        tracker = StorageTracker()
        with tracker:
            loss = compiled(x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            del loss
        held = sum(s.nbytes() for s in (ref() for ref in earlier) if s is not None)
        measured.append((tracker.start_bytes - held, tracker.peak_bytes - held))
    pr = compiled.plan.prediction
    assert pr is not None
    out = {"first_step": pr.first_step_peak_bytes, "steady": pr.peak_memory_bytes,
           "breakdown": pr.breakdown(), "peak_at": pr.peak_at, "limit": limit,
           "counts": compiled.plan.counts(), "recompute": dict(compiled.plan.recompute),
           "measured": measured,
           "cycle_bytes": sum(cycles.values()), "garbage_objects": garbage, "stray": stray}
    # Dropping the compiled model frees its tensors at once, not at the next collection.
    gc.disable()
    try:
        del compiled, opt
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        out["dropped_cycle_bytes"] = sum(
            t.untyped_storage().nbytes() for t in gc.garbage
            if isinstance(t, torch.Tensor) and t.device.type != "meta")
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    return out


def split_plan_file(path: str) -> str:
    """A plan that splits the GPT's first MLP weight in 4, sharded part by part."""
    with open(path, "w") as f:
        json.dump({"format": "osdp-fx-plan", "version": 1,
                   "splits": {"model.blocks.0.fc.weight": 4}, "default": "full_shard",
                   "params": {}}, f)
    return path

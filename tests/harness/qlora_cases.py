"""QLoRA (issue 59): a tiny Hugging Face Llama whose linears are bitsandbytes 4-bit (nf4)
``Linear4bit``, wrapped with peft LoRA, trained by osdp-fx; rank 0 also trains the eager model
(its Linear4bits replaced by ``BnbLinear4bit``, bitwise equal to bitsandbytes) on the global
batch."""

from __future__ import annotations

import gc
import operator
import warnings
from typing import Any

import torch
from torch import nn

from osdp_fx import compile_osdp
from osdp_fx.passes.quantized import replace_ao_nf4_linears, replace_bnb_linears

from .held import held_bytes

VOCAB, BATCH, SEQ, LR, STEPS = 128, 2, 8, 0.5, 2
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_linears(model: nn.Module, *, nested: bool = False, quant_type: str = "nf4") -> int:
    """Replace every projection ``nn.Linear`` of ``model`` by a bitsandbytes ``Linear4bit``
    (``quant_type``, computing in bfloat16) quantized from its weight, as ``from_pretrained`` with a
    ``BitsAndBytesConfig(load_in_4bit=True)`` would; returns how many."""
    import bitsandbytes as bnb

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in PROJECTIONS and isinstance(child, nn.Linear):
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                      compute_dtype=torch.bfloat16, quant_type=quant_type,
                                      compress_statistics=nested)
                q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False,
                                             quant_type=quant_type,
                                             compress_statistics=nested).to("cpu")
                setattr(parent, name, q)
                count += 1
    return count


def quantize_linears_ao(model: nn.Module) -> int:
    """Make the weight of every projection ``nn.Linear`` of ``model`` a torchao ``NF4Tensor``
    (blocks of 64, scaler blocks of 16), as ``to_nf4`` makes QLoRA bases; returns how many."""
    from torchao.quantization import to_nf4

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if name in PROJECTIONS and isinstance(child, nn.Linear):
                child.weight = nn.Parameter(to_nf4(child.weight.data, 64, 16),
                                            requires_grad=False)
                count += 1
    return count


def build(*, nested: bool = False, kind: str = "bnb") -> nn.Module:
    """The tiny Llama (hidden 64, 2 layers, GQA 4/2, random bf16 weights, seed 0), its linears
    4-bit (``kind``: bitsandbytes ``Linear4bit`` nf4, ``"bnb_fp4"``: fp4, or ``"torchao"``:
    ``NF4Tensor`` weights), with
    LoRA r=4 on all seven projections (``lora_B`` made nonzero), in train mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=64, use_cache=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    quantize = quantize_linears_ao if kind == "torchao" else (
        lambda m: quantize_linears(m, nested=nested,
                                   quant_type="fp4" if kind == "bnb_fp4" else "nf4"))
    assert quantize(model) == 14
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  target_modules=list(PROJECTIONS)))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return peft_model.train()


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def quantized_names(model: nn.Module) -> set[str]:
    """The parameters of the 4-bit weights: packed weights and their scales."""
    return {n for n, _ in model.named_parameters() if ".base_layer." in n}


def collectives_per_quantized_op(compiled: nn.Module) -> list[int]:
    """For each 4-bit linear of the compiled graph, how many all-gathers (collective nodes)
    deliver the tensors it reads (0 where they are replicated)."""
    from osdp_fx.runtime.params import all_gather_param, all_gather_params

    gathers = (all_gather_param, all_gather_params)
    quantized = (torch.ops.osdp.linear_bnb4bit.default, torch.ops.osdp.linear_ao_nf4.default)
    counts = []
    for node in compiled.graph_module.graph.nodes:
        if node.op == "call_function" and node.target in quantized:
            sources = set()
            for arg in node.all_input_nodes:
                src = arg.args[0] if arg.target is operator.getitem else arg
                if getattr(src, "target", None) in gathers:
                    sources.add(src)
            counts.append(len(sources))
    return counts


def _train(model: nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], dict]:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, opt


def train(rank: int, world: int, *, plans: tuple[str, ...] = ("full_shard", "replicate"),
          nested: bool = False, kind: str = "bnb") -> dict[str, Any]:
    """Each plan's losses, adapters after :data:`STEPS` SGD steps, the bytes this rank holds
    of the 4-bit weights and the model's (``"searched"``: the plan searched at 1.1x
    full_shard's predicted peak, so full_shard comes first); rank 0's ``reference``: one
    process on every rank's batches."""
    out: dict[str, Any] = {}
    limit = None
    for plan in plans:
        gc.collect()
        model = build(nested=nested, kind=kind)
        ids = batch(0, rank)
        compiled = compile_osdp(model, (), example_kwargs={"input_ids": ids, "labels": ids},
                                plan=None if plan == "searched" else plan,
                                memory_limit=limit if plan == "searched" else None,
                                optimizer="sgd", plan_cache=False)
        if plan == "full_shard":  # the search's limit: 1.1x full_shard's predicted peak
            limit = int(compiled.plan.peak_memory_bytes * 1.1)
        quantized = quantized_names(compiled)
        collectives = collectives_per_quantized_op(compiled)
        losses, _ = _train(compiled, [batch(s, rank) for s in range(STEPS)])
        state = compiled.full_state_dict()
        out[plan] = {
            "losses": losses,
            "adapters": {k: v.float() for k, v in state.items() if "lora_" in k},
            "quantized_local_bytes": sum(held_bytes(p) for n, p in compiled.named_parameters()
                                         if n in quantized),
            "quantized_bytes": sum(state[n].numel() * state[n].element_size()
                                   for n in quantized),
            "strategies": {p.name: p.strategy for p in compiled.plan.params},
            "collectives_per_op": collectives,
            "replaced": sum(type(m).__name__ in ("BnbLinear4bit", "AONF4Linear")
                            for m in model.modules()),
        }
        del compiled, model
    if rank == 0:
        model = build(nested=nested, kind=kind)
        replace_bnb_linears(model)
        replace_ao_nf4_linears(model)
        initial = {k: v.detach().float().clone() for k, v in model.state_dict().items()
                   if "lora_" in k}
        losses, _ = _train(model, [torch.cat([batch(s, r) for r in range(world)])
                                   for s in range(STEPS)])
        out["reference"] = {
            "losses": losses, "initial": initial,
            "adapters": {k: v.detach().float().clone() for k, v in model.state_dict().items()
                         if "lora_" in k}}
    return out


PROMISE_SHAPES = ((2, 16), (2, 8), (2, 16), (2, 8))
"""Per-rank (batch, sequence) of the memory promise's steps; the first is the example."""


def memory_promise(rank: int, world: int, *, kind: str = "bnb",
                   plans: tuple[Any, ...] = ("full_shard", "shard_grad_op", None)
                   ) -> dict[str, Any]:
    """Per plan (None: searched at 1.1x full_shard's predicted peak), AdamW on the adapters:
    each step's peak as a storage tracker counts it (what the process held before compiling
    left out) against the prediction at the step's shape, step 1 against the first step's."""
    from osdp_fx import Devices
    from osdp_fx.runtime.storage_tracker import StorageTracker

    from .memory_cases import earlier_storages

    def inputs(shape: tuple[int, int], step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, VOCAB, shape, generator=g)
        return {"input_ids": ids, "labels": ids}

    out: dict[str, Any] = {}
    limit = None
    for plan in plans:
        gc.collect()  # what earlier cases left, so that it is not counted here
        held_before = earlier_storages([])
        compiled = compile_osdp(build(kind=kind), (), Devices(world_size=world),
                                example_kwargs=inputs(PROMISE_SHAPES[0], 0), plan=plan,
                                memory_limit=limit if plan is None else None,
                                optimizer="adamw", plan_cache=False)
        prediction = compiled.plan.prediction
        if plan == "full_shard":
            limit = int(prediction.peak_memory_bytes * 1.1)
        opt = torch.optim.AdamW([p for p in compiled.parameters() if p.requires_grad], lr=1e-3)
        steps = []
        for step, shape in enumerate(PROMISE_SHAPES):
            tracker = StorageTracker()
            with tracker:
                output = compiled(**inputs(shape, step))
                output.loss.backward()
                opt.step()
                opt.zero_grad()
                del output
            held = sum(s.nbytes() for s in (ref() for ref in held_before) if s is not None)
            predicted = (prediction.first_step_peak_bytes if step == 0
                         else prediction.peak_bytes_at(*shape))
            steps.append((shape, tracker.peak_bytes - held, predicted))
        out[plan or "searched"] = {"steps": steps, "counts": compiled.plan.counts(),
                                   "peak_at": prediction.peak_at}
        del compiled, opt
    return out

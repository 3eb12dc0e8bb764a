"""A model factory for ``python -m osdp_fx plan``: a LoRA fine-tune of a Llama-3-70B-shaped model
(peft's ``LoraConfig`` on a Hugging Face ``LlamaForCausalLM``), built on the meta device, so
that it is planned without allocating its 140 GB of bf16 weights.

Plan it for one node of 8 H100s, in bf16 (``docs/finetuning.md``)::

    python -m osdp_fx plan examples/llama70b_lora.py:llama70b_lora \\
        --devices h100-sxm-8x --mixed-precision bf16

The base weights are frozen (``requires_grad=False``) and stored in bf16, the adapters
(rank 16 on the attention's q, k, v and o projections) in fp32, as a fine-tune keeps them. The
example inputs are one rank's batch: 1 sequence of 2048 tokens.
"""

from __future__ import annotations

import torch

LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                  max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, use_cache=False)
"""Llama-3-70B's configuration (its ``config.json``), without the weights."""


def llama70b_lora(layers: int = 80, seq_len: int = 2048):
    """The model (``layers`` decoder layers; 80 is Llama-3-70B) and one rank's inputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = LlamaConfig(**{**LLAMA3_70B, "num_hidden_layers": layers})
    with torch.device("meta"):  # shapes only: no memory, no values
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model = get_peft_model(model, LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    for name, p in model.named_parameters():  # adapters in fp32, as a fine-tune keeps them
        if p.requires_grad:
            p.data = p.data.float()
    return model, (torch.randint(0, config.vocab_size, (1, seq_len), device="meta"),)


def llama_lora_small():
    """The same model with 2 decoder layers: a quick check of the factory."""
    return llama70b_lora(layers=2, seq_len=256)

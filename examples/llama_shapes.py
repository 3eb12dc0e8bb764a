"""Model factories for ``python -m osdp_fx plan``: Hugging Face ``LlamaForCausalLM`` models of the
shapes of Llama-3.2-1B, Llama-3-8B and Llama-3-70B, built on the meta device (their configurations,
no weights: nothing is allocated), trained in full, with one rank's inputs of 1 sequence of 2048
tokens. ``benchmarks/plan_scale.py`` times planning them::

    python -m osdp_fx plan examples/llama_shapes.py:llama3_8b \\
        --devices h100-sxm-8x --world-size 64 --mixed-precision bf16
"""

from __future__ import annotations

import torch

LLAMA3 = dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
              max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
              use_cache=False)
"""What the three share (the 70B has 64 attention heads)."""

SHAPES = {
    "llama3_1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      tie_word_embeddings=True),
    "llama3_8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      tie_word_embeddings=False),
    "llama3_70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, tie_word_embeddings=False),
}
"""Each shape's ``config.json`` figures beyond :data:`LLAMA3`."""


def llama_shape(name: str, seq_len: int = 2048, batch: int = 1):
    """The model of shape ``name`` (a key of :data:`SHAPES`) on the meta device, and its inputs
    (``batch`` sequences of ``seq_len`` tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = LlamaConfig(**{**LLAMA3, **SHAPES[name]})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model, (torch.randint(0, config.vocab_size, (batch, seq_len), device="meta"),)


def llama3_1b():
    return llama_shape("llama3_1b")


def llama3_8b():
    return llama_shape("llama3_8b")


def llama3_70b():
    return llama_shape("llama3_70b")

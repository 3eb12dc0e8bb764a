"""Models and data for tests: built deterministically from a seed in any process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from osdp_fx.examples import MLP, TinyGPT, lm_loss

Batch = tuple[torch.Tensor, ...]


def build(name: str, seed: int = 0) -> tuple[nn.Module, Callable[[Any, Batch], torch.Tensor]]:
    """(model, loss_fn(output, batch)) for a model name; identical in every process."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP((24, 40, 33, 8)), _mse
    if name == "wide_mlp":  # a weight gathered alone (> SMALL_PARAM_BYTES), the rest in buckets
        return MLP((24, 40, 520, 8)), _mse
    if name == "gpt":
        return TinyGPT(vocab=67, dim=32, depth=2, heads=4, max_seq=16), _lm_loss
    if name in ("hf_gpt2", "hf_gpt2_dropout"):
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        pdrop = 0.1 if name == "hf_gpt2_dropout" else 0.0
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=67, n_positions=16,
                         use_cache=False, resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg), lambda out, batch: lm_loss(out.logits, batch[0])
    if name in ("hf_llama", "hf_llama_lora"):  # captured by torch.export; RMSNorm and rotary
        from transformers import LlamaConfig, LlamaForCausalLM  # convert dtypes
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=67,
                          max_position_embeddings=16, use_cache=False)
        llama = LlamaForCausalLM(cfg)
        if name == "hf_llama_lora":  # a LoRA fine-tune: frozen bf16 weights, fp32 adapters
            from peft import LoraConfig, get_peft_model

            llama = get_peft_model(llama.to(torch.bfloat16), LoraConfig(
                r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                init_lora_weights=False))  # B != 0: the adapters change the loss from step 1
        return llama, lambda out, batch: lm_loss(out.logits, batch[0])
    if name in HF_FAMILIES:
        return HF_FAMILIES[name](), lambda out, batch: lm_loss(out.logits, batch[0])
    raise ValueError(name)


def _hf_family(config: str, model: str, **extra: Any) -> Callable[[], nn.Module]:
    """A tiny Hugging Face causal LM of one family (random weights, grouped-query attention)."""

    def make() -> nn.Module:
        import transformers
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        cfg = getattr(transformers, config)(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=67, max_position_embeddings=16, use_cache=False,
            **extra)
        return getattr(transformers, model)(cfg)

    return make


HF_FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "hf_qwen2": _hf_family("Qwen2Config", "Qwen2ForCausalLM"),
    "hf_qwen3": _hf_family("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "hf_gemma": _hf_family("GemmaConfig", "GemmaForCausalLM", head_dim=8),
    "hf_phi3": _hf_family("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
}
"""Families whose rotary embeddings read a float32 buffer in a no-grad region (issue 60)."""


def _mse(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    # in float32: torch < 2.13 rejects a bfloat16 output against a float32 target in backward
    return F.mse_loss(out.float(), batch[1])


def _lm_loss(out: torch.Tensor, batch: Batch) -> torch.Tensor:
    return lm_loss(out, batch[0])


def batches(name: str, *, global_batch: int, steps: int, seed: int = 1) -> list[Batch]:
    """``steps`` global batches; the model's inputs come first, then targets."""
    gen = torch.Generator().manual_seed(seed)
    if name in ("mlp", "wide_mlp"):
        return [(torch.randn(global_batch, 24, generator=gen),
                 torch.randn(global_batch, 8, generator=gen)) for _ in range(steps)]
    return [(torch.randint(0, 67, (global_batch, 12), generator=gen),) for _ in range(steps)]


def local(batch: Batch, rank: int, world: int) -> Batch:
    """This rank's equal slice of a global batch."""
    n = batch[0].shape[0] // world
    return tuple(t[rank * n:(rank + 1) * n] for t in batch)




class WithLoss(nn.Module):
    """A language model whose forward returns the training loss (the graph holds the step)."""

    def __init__(self, name: str, seed: int = 0) -> None:
        super().__init__()
        self.hf = name.startswith("hf_")
        self.model, self.loss_fn = build(name, seed)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.hf:
            return self.model(idx, labels=idx).loss
        return self.loss_fn(self.model(idx), (idx,))


class MLPWithLoss(nn.Module):
    """The test MLP with its mean-squared-error loss inside the forward."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.model, _ = build("mlp", seed)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), y)


def with_loss(name: str, seed: int = 0) -> nn.Module:
    """``name``'s model wrapped so that its forward takes a whole batch and returns the loss."""
    return MLPWithLoss(seed) if name == "mlp" else WithLoss(name, seed)


def cast_forward(net: nn.Module, param_dtype: torch.dtype | None) -> Callable[[torch.Tensor], Any]:
    """``net``'s forward computing with its parameters and floating inputs cast to
    ``param_dtype`` (as mixed precision does; None: as they are)."""

    def forward(x: torch.Tensor) -> Any:
        if param_dtype is None:
            return net(x)
        cast = {n: p.to(param_dtype) for n, p in net.named_parameters()}
        return torch.func.functional_call(
            net, cast, (x.to(param_dtype) if x.is_floating_point() else x,))

    return forward

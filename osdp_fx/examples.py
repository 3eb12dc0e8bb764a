"""Small models used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """A stack of Linear + GELU layers."""

    def __init__(self, sizes: tuple[int, ...] = (32, 64, 64, 10), *, bias: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Linear(a, b, bias=bias) for a, b in zip(sizes[:-1], sizes[1:])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


class Block(nn.Module):
    """Pre-norm transformer block with causal scaled-dot-product attention."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, mlp_ratio * dim)
        self.out = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style language model whose LM head is tied to the token embedding."""

    def __init__(self, vocab: int = 128, dim: int = 32, depth: int = 2, heads: int = 4,
                 max_seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(1 + name.count("out")))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a language model's logits on its own input."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


# ---- factories for the command line: ``python -m osdp_fx plan osdp_fx/examples.py:tiny_gpt`` ----

def tiny_gpt() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A small GPT with tied embeddings and its loss inside the forward, with a batch of 8."""
    torch.manual_seed(0)
    return GPTWithLoss(TinyGPT(vocab=2048, dim=256, depth=4, heads=4, max_seq=64)), (
        torch.randint(0, 2048, (8, 64)),)


def gpt2_48_layers_meta() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The OSDP paper's GPT-2 size (48 layers, hidden 2048, vocab 50257, sequence 1024, batch 1
    per rank) built on the meta device: it is planned without allocating or running anything."""
    with torch.device("meta"):
        model = GPTWithLoss(TinyGPT(vocab=50257, dim=2048, depth=48, heads=16, max_seq=1024))
    return model, (torch.randint(0, 50257, (1, 1024), device="meta"),)


MPT_SHAPES: dict[str, tuple[int, int, int]] = {
    "125m": (768, 12, 12), "350m": (1024, 24, 16), "760m": (1536, 24, 12),
    "1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
    "30b": (7168, 48, 64), "70b": (8192, 80, 64),
}
"""(hidden size, layers, heads) of llm-foundry's MPT benchmark models, by name."""


def mpt_meta(name: str, *, seq: int = 2048,
             batch: int = 1) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A GPT of the shape of llm-foundry's MPT model ``name`` (:data:`MPT_SHAPES`; vocab 50368,
    learned positions, biases, a tied embedding: the parameter count its benchmark tables give
    at each sequence length) at sequence ``seq`` and micro batch ``batch`` per rank, built on
    the meta device (``benchmarks/published.py`` predicts the published rows with it)."""
    dim, depth, heads = MPT_SHAPES[name]
    with torch.device("meta"):
        model = GPTWithLoss(TinyGPT(vocab=50368, dim=dim, depth=depth, heads=heads,
                                    max_seq=seq))
    return model, (torch.randint(0, 50368, (batch, seq), device="meta"),)


def mpt_1b_meta() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """MPT-1b (24 layers, hidden 2048, 16 heads: 1,315,950,592 parameters) at sequence 2048 and
    micro batch 14 per rank, its 8 x H100 FULL_SHARD configuration (:func:`mpt_meta`;
    docs/benchmarks.md validates the h100-sxm-8x preset on it)."""
    return mpt_meta("1b", seq=2048, batch=14)


def hf_gpt2_xl_meta() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Hugging Face GPT-2 XL (48 layers, hidden 1600, 1.56 B parameters) from its configuration,
    built on the meta device with a sequence of 1024 and batch 1 per rank: planned without
    allocating it (torch.export captures it; needs transformers)."""
    return hf_gpt2_meta(n_layer=48, n_embd=1600, n_head=25)


def hf_gpt2_meta(*, n_layer: int = 2, n_embd: int = 128, n_head: int = 4, vocab: int = 50257,
                 seq: int = 1024, batch: int = 1) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A Hugging Face GPT2LMHeadModel whose forward returns its loss, on the meta device."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab,
                        n_positions=seq, use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = HFCausalLMWithLoss(GPT2LMHeadModel(config))
    return model, (torch.randint(0, vocab, (batch, seq), device="meta"),)


class HFCausalLMWithLoss(nn.Module):
    """A Hugging Face causal language model whose forward returns its next-token loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx, labels=idx).loss


class GPTWithLoss(nn.Module):
    """A language model whose forward returns its next-token loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(idx), idx)

"""Meta-device initialisation cases: run on every rank of a test world.

Each case builds a model under ``torch.device("meta")`` after ``torch.manual_seed`` (the same
seed on every rank), compiles it, and compares with the same model built on the CPU from the
same seed, in the same process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from osdp_fx import compile_osdp
from osdp_fx.errors import OSDPError
from osdp_fx.examples import MLP
from osdp_fx.runtime.memory import LiveTensorTracker

from .checkpoint_cases import train_steps
from .held import held_bytes
from .models import local


class TiedLM(nn.Module):
    """Embedding, LayerNorm and an LM head tied to the embedding; a non-persistent float buffer
    that LayerNormScale.reset_parameters recomputes."""

    def __init__(self, vocab: int = 37, dim: int = 12) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.norm = LayerNormScale(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.tok(idx)))


class LayerNormScale(nn.LayerNorm):
    """A LayerNorm whose output is scaled by a buffer that reset_parameters computes."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim)
        self.register_buffer("scale", torch.empty(dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "scale"):
            with torch.no_grad():
                self.scale.copy_(torch.linspace(0.5, 1.5, self.scale.numel()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], Callable[..., torch.Tensor]]:
    """(model, global batch, loss_fn(output, local batch)); the model uses the current device
    and the current random state."""
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        batch = (torch.randn(8, 24, generator=gen), torch.randn(8, 3, generator=gen))
        return MLP((24, 40, 33, 3)), batch, lambda out, b: F.mse_loss(out, b[1])
    if name == "tied":
        batch = (torch.randint(0, 37, (8, 5), generator=gen),)
        return (TiedLM(), batch,
                lambda out, b: F.cross_entropy(out.reshape(-1, 37), b[0].reshape(-1)))
    raise ValueError(name)


def normal_init(module: nn.Module) -> None:
    """A user initialisation: normal weights, zero biases, for the tensors a module owns."""
    for name, p in module.named_parameters(recurse=False):
        if name == "bias":
            nn.init.zeros_(p)
        else:
            nn.init.normal_(p, std=0.02)


def meta_equals_cpu(rank: int, world: int, *, model: str, plan: Any,
                    init: str | None = None, devices: Any = None) -> dict[str, Any]:
    """Compile the model built on meta and the model built on the CPU from the same seed (with
    ``init``: ``normal_init`` passed as init_fn on meta, and applied to each module from the
    same seed after building on the CPU); return both full state dicts and buffers and two SGD
    steps' losses of each."""
    init_fn = normal_init if init == "normal" else None
    torch.manual_seed(0)
    cpu_net, batch, loss_fn = build(model)
    if init_fn is not None:  # init_fn replaces reset_parameters: it draws from the seed first
        torch.manual_seed(0)
        for m in cpu_net.modules():
            init_fn(m)
    example = local(batch, rank, world)[:1]
    cpu = compile_osdp(cpu_net, example, devices, plan=plan)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta_net, _, _ = build(model)
    meta = compile_osdp(meta_net, example, devices, plan=plan, init_fn=init_fn)
    return {
        "meta_state": meta.full_state_dict(), "cpu_state": cpu.full_state_dict(),
        "meta_buffers": {k: v.clone() for k, v in meta.named_buffers()},
        "cpu_buffers": {k: v.clone() for k, v in cpu.named_buffers()},
        "meta_losses": train_steps(meta, torch.optim.SGD(meta.parameters(), lr=0.1), loss_fn,
                                   [batch] * 2, rank, world),
        "cpu_losses": train_steps(cpu, torch.optim.SGD(cpu.parameters(), lr=0.1), loss_fn,
                                  [batch] * 2, rank, world),
        "devices": {str(p.device) for p in meta.parameters()},
        "strategies": {p.name: p.strategy for p in meta.plan.params},
    }


class Stack(nn.Module):
    """``depth`` square linears without biases."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def materialize_peak(rank: int, world: int, *, width: int = 1024, depth: int = 8
                     ) -> dict[str, int]:
    """Peak live tensor bytes while compiling a meta Stack under full_shard, and what stays."""
    x = torch.randn(4, width)
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Stack(width, depth)
    tracker = LiveTensorTracker()
    with tracker:
        compiled = compile_osdp(net, (x,), plan="full_shard")
        after = tracker.settle()
    del net
    return {"peak": tracker.peak_bytes, "after": after,
            "shards": sum(held_bytes(p) for p in compiled.parameters()),
            "layer": width * width * 4, "full": depth * width * width * 4}


class Unresettable(nn.Module):
    """A module owning a parameter, with no reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain


class CachedLinear(nn.Linear):
    """A linear whose __init__ computes a buffer that reset_parameters does not set."""

    def __init__(self) -> None:
        super().__init__(3, 3)
        self.register_buffer("cache", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.cache


def meta_errors(rank: int, world: int) -> dict[str, str]:
    """What compile_osdp says about a meta module it cannot initialise, a buffer nobody sets,
    ranks seeded differently, init_fn on a CPU model, and a meta model that rejects its
    inputs; then a good compile still works."""
    x = torch.randn(2, 3)

    def error(make: Callable[[], nn.Module], seed: int = 0, **kwargs: Any) -> str:
        torch.manual_seed(seed)
        with torch.device("meta"):
            net = make()
        try:
            compile_osdp(net, (x,), plan="full_shard", **kwargs)
        except OSDPError as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    out = {
        "no_reset": error(Unresettable),
        "unset_buffer": error(CachedLinear),
        "different_seeds": error(lambda: nn.Linear(3, 3), seed=rank),
    }
    try:
        compile_osdp(nn.Linear(3, 3), (x,), init_fn=normal_init)
        out["cpu_with_init_fn"] = ""
    except OSDPError as exc:
        out["cpu_with_init_fn"] = f"{type(exc).__name__}: {exc}"
    try:  # a model on the meta device that rejects its inputs: named like on the CPU
        torch.manual_seed(0)
        with torch.device("meta"):
            net = nn.Linear(3, 3)
        compile_osdp(net, (torch.randn(2, 4),), plan="full_shard")
        out["meta_rejects_inputs"] = ""
    except OSDPError as exc:
        out["meta_rejects_inputs"] = f"{type(exc).__name__}: {exc}"
    out["with_init_fn"] = error(Unresettable, init_fn=lambda m: [
        nn.init.ones_(p) for p in m.parameters(recurse=False)]) or "compiled"
    return out


def hf_on_meta(rank: int, world: int, *, plan: Any) -> dict[str, Any]:
    """A Hugging Face GPT-2 built on the meta device (only torch.export captures it), initialised
    by its own ``_init_weights`` and trained 3 SGD steps: its initial full state, its losses
    and its final full state."""
    from .models import batches
    from .models import build as build_test_model

    torch.manual_seed(0)
    with torch.device("meta"):
        hf, loss_fn = build_test_model("hf_gpt2")
    data = batches("hf_gpt2", global_batch=2 * world, steps=3)
    compiled = compile_osdp(hf, local(data[0], rank, world)[:1], plan=plan,
                            init_fn=hf._init_weights)
    initial = compiled.full_state_dict()
    losses = train_steps(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), loss_fn,
                         data, rank, world)
    return {"initial": initial, "losses": losses, "final": compiled.full_state_dict(),
            "method": compiled.captured_by,
            "devices": {str(t.device) for t in (*compiled.parameters(), *compiled.buffers())}}


def hf_llama_config(**extra: Any) -> Any:
    """A small Llama configuration whose weights span several checkpoint files."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                       max_position_embeddings=16, use_cache=False, **extra)


def save_hf_checkpoint(directory: str, *, max_shard_size: str = "200KB", **extra: Any) -> None:
    """Write a random-weight Llama with ``save_pretrained`` in several safetensors files."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(5)
    LlamaForCausalLM(hf_llama_config(**extra)).save_pretrained(directory,
                                                                max_shard_size=max_shard_size)


def hf_weights_from_checkpoint(rank: int, world: int, *, directory: str, plan: Any,
                               lora: bool = False) -> dict[str, Any]:
    """The Llama of ``directory`` two ways, each trained 3 SGD steps under ``plan``: loaded by
    ``from_pretrained`` and compiled, and built on the meta device, compiled and filled by
    ``load_hf_weights`` (``lora``: both wrapped by peft's LoRA first). Returns both runs'
    losses and final states, the load's peak and what it started from (StorageTracker), the
    plan's parameter bytes on this rank and what the load did not pair."""
    import os

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from osdp_fx import load_hf_weights
    from osdp_fx.runtime.storage_tracker import StorageTracker

    from .models import batches, lm_loss

    hf_logging.set_verbosity_error()

    def loss_fn(out: Any, batch: Any) -> torch.Tensor:
        return lm_loss(out.logits, batch[0])

    def adapted(model: nn.Module) -> nn.Module:
        if not lora:
            return model
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(7)
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8,
                                                target_modules=["q_proj", "v_proj"],
                                                init_lora_weights=False))

    data = [(b[0] % 512,) for b in batches("hf_llama", global_batch=2 * world, steps=3)]
    example = local(data[0], rank, world)[:1]
    config = AutoModelForCausalLM.from_pretrained(directory).config
    with torch.device("meta"):
        model = adapted(AutoModelForCausalLM.from_config(config))
    hf = getattr(model, "base_model", model)
    torch.manual_seed(0)  # the same on every rank
    compiled = compile_osdp(model, example, plan=plan,
                            init_fn=(hf.model if lora else hf)._init_weights)
    with StorageTracker() as tracker:
        result = load_hf_weights(directory, compiled, strict=not lora)
    # the adapters (not in the checkpoint) as the meta run initialised them, for the reference
    adapters = {k: v for k, v in compiled.full_state_dict().items() if ".lora_" in k}
    losses = train_steps(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), loss_fn,
                         data, rank, world)

    pretrained = adapted(AutoModelForCausalLM.from_pretrained(directory))
    pretrained.load_state_dict(adapters, strict=False)
    reference = compile_osdp(pretrained, example, plan=plan)
    ref_losses = train_steps(reference, torch.optim.SGD(reference.parameters(), lr=0.1),
                             loss_fn, data, rank, world)
    files = [os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
             if f.endswith(".safetensors")]
    return {"ref_losses": ref_losses, "losses": losses,
            "ref_final": reference.full_state_dict(), "final": compiled.full_state_dict(),
            "peak": tracker.peak_bytes - tracker.start_bytes,
            "param_bytes": sum(held_bytes(p) for p in compiled.parameters()),
            "model_bytes": sum(v.numel() * v.element_size()
                               for v in reference.full_state_dict().values()),
            "largest_file": max(files), "files": len(files),
            "missing": result.missing_keys, "unexpected": result.unexpected_keys}

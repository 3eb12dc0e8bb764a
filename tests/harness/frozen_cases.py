"""A LoRA-style model with a frozen base (embedding, linears, head) and trainable low-rank
adapters, trained under plans that shard the frozen weights; the collectives counted on the
real calls."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from osdp_fx import compile_osdp, load_checkpoint, save_checkpoint
from osdp_fx.core.layout import row_numel, shard_numel
from osdp_fx.core.strategies import traits
from osdp_fx.runtime import collectives
from osdp_fx.runtime.storage_tracker import StorageTracker, dense_tensors, held_tensors

from .held import held_bytes
from .memory_cases import earlier_storages

VOCAB, DIM, HIDDEN, RANK = 64, 128, 512, 4


class LoraLinear(nn.Module):
    """A frozen linear plus a trainable low-rank update ``b @ a``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out, bias=False).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(RANK, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, RANK) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class FrozenBaseLM(nn.Module):
    """Embedding and head frozen, two LoRA linears between. Backward needs the frozen weights
    of ``up`` only where their input requires grad: ``down.base`` and ``head``, not ``emb`` (an
    embedding's backward reads no weight) nor ``up.base`` (its input, the frozen embedding's
    output, needs no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM).requires_grad_(False)
        self.up = LoraLinear(DIM, HIDDEN)
        self.down = LoraLinear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False).requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(F.gelu(self.up(self.emb(idx)))))


REGATHERED = {"down.base.weight", "head.weight"}
ADAPTERS = {"up.a", "up.b", "down.a", "down.b"}
FROZEN = {"emb.weight", "up.base.weight", "down.base.weight", "head.weight"}


class Int8LoraLinear(nn.Module):
    """A frozen linear stored packed, as int8 with a float scale per output row (a plain
    int8 parameter that forward dequantizes), plus trainable low-rank adapters."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        w = torch.randn(d_out, d_in) * d_in ** -0.5
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        self.weight = nn.Parameter((w / scale).round().to(torch.int8), requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.a = nn.Parameter(torch.randn(RANK, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, RANK) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.linear(x, self.weight.to(x.dtype) * self.scale)
                + F.linear(F.linear(x, self.a), self.b))


class Int8BaseLM(FrozenBaseLM):
    """:class:`FrozenBaseLM` with its two linears' bases packed in int8."""

    def __init__(self) -> None:
        super().__init__()
        self.up = Int8LoraLinear(DIM, HIDDEN)
        self.down = Int8LoraLinear(HIDDEN, DIM)


PACKED = {"up.weight", "down.weight"}
"""The int8 parameters of :class:`Int8BaseLM`."""


def build(model: str = "lora") -> nn.Module:
    torch.manual_seed(0)
    return {"lora": FrozenBaseLM, "int8": Int8BaseLM}[model]()


def _is_base(key: str) -> bool:
    """A key of the frozen base of either model (never trained)."""
    return key in FROZEN | PACKED or "base" in key or key.endswith(".scale")


def _held_at_entry(held_before: list[Any]) -> dict[int, str]:
    """What the process holds before a step but did not hold before compiling: by storage,
    its bytes, shape and dtype, and the types of what refers to it (for a failure's message:
    what a later step holds that the first did not)."""
    before = {s._cdata for s in (ref() for ref in held_before) if s is not None}
    out = {}
    for t in held_tensors():
        for d in dense_tensors(t):
            storage = d.untyped_storage()
            if storage._cdata in before or storage._cdata in out:
                continue
            referrers = sorted({type(r).__name__ for r in gc.get_referrers(t)} - {"list"})
            out[storage._cdata] = (f"{storage.nbytes()} bytes {tuple(d.shape)} {d.dtype} held by "
                                   f"{', '.join(referrers)}")
    return out


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (4, 8), generator=g)


def loss_of(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), idx[:, 1:].reshape(-1))


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count the runtime's all-gathers (and the elements they gather), reduce-scatters and
    all-reduces meanwhile; the wrapped functions still run."""
    counts: Counter = Counter()
    gather, scatter, reduce = (collectives._all_gather_flat_impl,
                               collectives._reduce_scatter_flat_impl, dist.all_reduce)

    def gathered(out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts["all_gather"] += 1
        counts["gathered_numel"] += out.numel()
        counts[f"gathered {out.dtype}"] += out.numel()
        return gather(out, *args, **kwargs)

    def scattered(*args: Any, **kwargs: Any) -> Any:
        counts["reduce_scatter"] += 1
        counts["scattered_numel"] += args[1].numel()
        return scatter(*args, **kwargs)

    def reduced(*args: Any, **kwargs: Any) -> Any:
        counts["all_reduce"] += 1
        counts["reduced_numel"] += args[0].numel()
        return reduce(*args, **kwargs)

    collectives._all_gather_flat_impl = gathered
    collectives._reduce_scatter_flat_impl = scattered
    dist.all_reduce = reduced
    try:
        yield counts
    finally:
        collectives._all_gather_flat_impl = gather
        collectives._reduce_scatter_flat_impl = scatter
        dist.all_reduce = reduce


def _plan_file(directory: str, name: str, body: dict[str, Any]) -> str:
    path = os.path.join(directory, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"format": "osdp-fx-plan", "version": 1, **body}, f)
    return path


def adapters_reload(rank: int, world: int, *, path: str, lr: float = 0.1) -> dict[str, Any]:
    """Train under full_shard, save the adapters alone (``trainable_only``) with the optimizer
    state, load them into the model compiled under replicate, train one more step in each."""
    compiled = compile_osdp(build(), (batch(0, rank),), plan="full_shard", optimizer="sgd")
    opt = torch.optim.SGD(compiled.parameters(), lr=lr, momentum=0.9)
    for step in range(2):
        loss_of(compiled(batch(step, rank)), batch(step, rank)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_checkpoint(path, compiled, opt, extra={"step": 2}, trainable_only=True)
    other = compile_osdp(build(), (batch(0, rank),), plan="replicate", optimizer="sgd")
    other_opt = torch.optim.SGD(other.parameters(), lr=lr, momentum=0.9)
    extra = load_checkpoint(path, other, other_opt)
    losses = []
    for module, optimizer in ((compiled, opt), (other, other_opt)):
        loss = loss_of(module(batch(2, rank)), batch(2, rank))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    saved = dcp_keys(path)
    return {"extra": extra, "losses": losses, "saved": saved,
            "states": [m.full_state_dict() for m in (compiled, other)]}


def dcp_keys(path: str) -> list[str]:
    import torch.distributed.checkpoint as dcp

    return sorted(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def train(rank: int, world: int, *, model: str = "lora", plans: tuple[str, ...] | None = None,
          devices: Any = None, steps: int = 3, lr: float = 0.1) -> dict[str, Any]:
    """Each plan's losses, trainable state, local parameter bytes, each step's peak as a storage
    tracker counts it (whole step, from the first) and, in the last step, the collectives of
    forward and of backward; rank 0 also trains one process on every rank's batches.
    ``model``: "lora" (:class:`FrozenBaseLM`) or "int8" (:class:`Int8BaseLM`); ``plans``:
    strategy names, "frozen_sharded" (the frozen groups alone full_shard), "one_bucket" (all
    full_shard, gathered in one bucket: frozen and trainable members together) and "searched"
    (the search under a limit 4 % above the first plan's predicted peak); by default
    full_shard, shard_grad_op, frozen_sharded, one_bucket and searched for "lora", full_shard
    and searched for "int8".
    ``devices``: compile_osdp's (a mesh)."""
    if plans is None:
        plans = (("full_shard", "shard_grad_op", "frozen_sharded", "one_bucket", "searched")
                 if model == "lora" else ("full_shard", "searched"))
    with tempfile.TemporaryDirectory(prefix="osdp-frozen-") as plan_dir:
        given = {"searched": None, "frozen_sharded": _plan_file(plan_dir, "frozen-sharded", {
            "default": "replicate", "params": {n: "full_shard" for n in FROZEN}}),
            "one_bucket": _plan_file(plan_dir, "one-bucket", {
                "default": "full_shard", "params": {}, "gather_bucket_bytes": 2**24})}
        out: dict[str, Any] = {}
        limit = None
        for label in plans:
            plan = given.get(label, label)
            gc.collect()  # what earlier cases left, so that it is not counted here
            held_before = earlier_storages([])
            compiled = compile_osdp(build(model), (batch(0, rank),), plan=plan, optimizer="sgd",
                                    memory_limit=limit if plan is None else None, devices=devices)
            if limit is None:
                limit = int(1.04 * compiled.plan.prediction.peak_memory_bytes)
            opt = torch.optim.SGD([p for p in compiled.parameters() if p.requires_grad], lr=lr)
            losses, peaks, forward, backward = [], [], Counter(), Counter()
            entries: list[dict[int, str]] = []
            for step in range(steps):
                idx = batch(step, rank)
                entries.append(_held_at_entry(held_before))
                with StorageTracker() as tracker:
                    with counting() as forward:
                        loss = loss_of(compiled(idx), idx)
                    with counting() as backward:
                        loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    losses.append(loss.item())
                    del loss
                earlier = (ref() for ref in held_before)
                peaks.append(tracker.peak_bytes - sum(s.nbytes() for s in earlier if s is not None))
            state = compiled.full_state_dict()
            out[label] = {
                "losses": losses, "forward": dict(forward), "backward": dict(backward),
                "peaks": peaks, "limit": limit,
                "held_at_entry": [sorted(v for k, v in e.items() if k not in entries[0])
                                  for e in entries],
                "predicted": compiled.plan.prediction.peak_bytes_at(*batch(0, rank).shape),
                "state": {k: v for k, v in state.items() if not _is_base(k)},
                "frozen_state": {k: v for k, v in state.items() if _is_base(k)},
                "local_bytes": sum(held_bytes(p) for p in compiled.parameters()),
                "strategies": {p.name: p.strategy for p in compiled.plan.params},
                "notes": {p.name: p.note for p in compiled.plan.params},
                "regathered": sorted(p.name for p in compiled.plan.params
                                     if traits(p.strategy).freed_after_forward and p.regathered),
                "padded": {p.name: shard_numel(p.numel, world, row_numel(p.shape)) * world
                           for p in compiled.plan.params},
                "backward_collectives": {p.name: compiled.plan.collectives_of(p)[1]
                                         for p in compiled.plan.params},
            }
            del compiled, opt
    if rank == 0:
        net = build(model)
        opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=lr)
        losses = []
        for step in range(steps):
            loss = sum(loss_of(net(batch(step, r)), batch(step, r)) for r in range(world)) / world
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out["reference"] = {
            "losses": losses, "state": {k: v for k, v in net.state_dict().items()
                                        if not _is_base(k)},
            "frozen_state": {k: v for k, v in net.state_dict().items() if _is_base(k)},
            "model_bytes": sum(p.numel() * p.element_size() for p in net.parameters()),
            "adapter_bytes": sum(p.numel() * p.element_size() for p in net.parameters()
                                 if p.requires_grad),
        }
    return out


def peft_adapters_reload(rank: int, world: int, *, path: str, lr: float = 1e-3
                         ) -> dict[str, Any]:
    """peft's LoRA on a Hugging Face Llama (frozen bf16 base, fp32 adapters), as its users run
    it: trained under full_shard, its adapters saved alone (``trainable_only``) with AdamW's
    state, loaded into the model compiled under replicate; one more step in each."""
    from .models import batches as model_batches
    from .models import build as build_model
    from .models import local as local_batch

    data = [local_batch(b, rank, world)
            for b in model_batches("hf_llama_lora", global_batch=2 * world, steps=3)]
    modules, loss_fn = [], None
    for plan in ("full_shard", "replicate"):
        net, loss_fn = build_model("hf_llama_lora")
        compiled = compile_osdp(net, data[0][:1], plan=plan, mixed_precision="bf16")
        modules.append((compiled, torch.optim.AdamW(
            [p for p in compiled.parameters() if p.requires_grad], lr=lr)))
    (compiled, opt), (other, other_opt) = modules
    for batch in data[:2]:
        loss_fn(compiled(*batch[:1]), batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_checkpoint(path, compiled, opt, extra={"step": 2}, trainable_only=True)
    extra = load_checkpoint(path, other, other_opt)
    trainable = sorted(n for n, p in compiled.named_parameters() if p.requires_grad)
    held = sum(held_bytes(p) for p in compiled.parameters())  # under full_shard
    padded = sum(shard_numel(p.numel, world, row_numel(p.shape)) * world * p.element_size
                 for p in compiled.plan.params) - sum(p.nbytes for p in compiled.plan.params)
    loaded = [m.full_state_dict() for m in (compiled, other)]
    losses = []
    for module, optimizer in modules:
        loss = loss_fn(module(*data[2][:1]), data[2])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    initial = build_model("hf_llama_lora")[0]
    sizes = [(p.numel() * p.element_size(), p.requires_grad) for p in initial.parameters()]
    return {"extra": extra, "losses": losses, "saved": dcp_keys(path), "trainable": trainable,
            "loaded": loaded, "initial": initial.state_dict(), "held_bytes": held,
            "padding_bytes": padded, "model_bytes": sum(b for b, _ in sizes),
            "adapter_bytes": sum(b for b, t in sizes if t)}


def peft_adapters_export(rank: int, world: int, *, path: str, lr: float = 0.05
                         ) -> dict[str, Any]:
    """peft's LoRA on a float32 Hugging Face Llama trained two SGD steps under full_shard, its
    adapters written in peft's format (``save_peft_adapters``); the compiled model's logits on a
    batch every rank sees, and the adapters as trained."""
    from peft import LoraConfig, get_peft_model

    from osdp_fx import save_peft_adapters

    from .models import batches as model_batches
    from .models import build as build_model
    from .models import local as local_batch

    batches = model_batches("hf_llama", global_batch=2 * world, steps=3)
    peft_model = get_peft_model(build_model("hf_llama")[0], LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False))
    compiled = compile_osdp(peft_model, local_batch(batches[0], rank, world)[:1],
                            plan="full_shard")
    opt = torch.optim.SGD([p for p in compiled.parameters() if p.requires_grad], lr=lr)
    for batch in batches[:2]:
        x = local_batch(batch, rank, world)[0]
        F.cross_entropy(compiled(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    save_peft_adapters(compiled, peft_model, path)
    with torch.no_grad():
        logits = compiled(batches[2][0]).logits
    return {"logits": logits, "files": sorted(os.listdir(path)),
            "adapters": compiled.full_state_dict(ignore_frozen_params=True),
            "all_keys": len(compiled.full_state_dict())}

"""osdp-fx on a CUDA GPU: parity, predicted against measured memory and time, DDP and FSDP2.

One command on a machine with one CUDA GPU (``python benchmarks/gpu_check.py --quick --out-dir
DIR``, within ``--budget-s``) measures three things:

1. **Parity.** A GPT (``osdp_fx.examples``) and a Hugging Face Llama (tiny configs, random
   weights, captured by ``torch.export``) train 5 SGD steps on the GPU under ``replicate``,
   ``full_shard`` and the searched plan (at a limit halfway between those two plans' predicted
   peaks), in fp32 and with ``mixed_precision="bf16"``, and so do tiny Qwen2, Qwen3, Gemma and
   Phi-3 configs (``HF_FAMILIES``, built like the Llama) in bf16, at world 1 with NCCL and at
   world 2 with two processes sharing the GPU over gloo (NCCL refuses two ranks on one GPU),
   each against single-process CUDA training on the global batch: losses to 1e-5 and
   parameters to 1e-4 in fp32, and to the tolerances of
   ``tests/distributed/test_mixed_precision.py`` in bf16 (losses rtol 2e-2 / atol 2e-3,
   parameters 5e-3).
2. **Memory.** A GPT of about 350M parameters (d=1024, 24 layers, sequence 1024, vocabulary
   32768, batch 8 per rank) trained with AdamW, and a LoRA fine-tune (peft, rank 16 on every
   attention and MLP projection) of a Llama of similar size (hidden 1024, 24 layers, batch 4 per
   rank) whose frozen weights are bf16, both with bf16 compute: per plan, the predicted peak
   (``plan.prediction``: the first step's and the steady state's) against
   ``torch.cuda.max_memory_allocated`` over step 1 and over steps 2-5, and against
   ``max_memory_reserved`` (what the caching allocator holds: the measured margin is
   reserved / predicted - 1), each from a reset taken after ``compile_osdp`` returns (no
   ``gc.collect()``, no ``empty_cache()`` between steps). Each model runs in processes of its
   own, beside the parity worlds (a process's memory figures are its own): world 1 (NCCL) under
   ``replicate``, ``full_shard`` and the binding plan, world 2 (gloo, two ranks on the GPU)
   under those and the searched plan. The binding plan is searched at a limit of replicate's
   predicted peak, of which the search plans within ``1 - Devices.memory_margin``, so that it
   must shard or recompute to fit; a plan with a limit also has ``max_memory_reserved`` (the
   larger of step 1's and steps 2+') checked against it. The GPT also runs world 1 with the
   caching allocator's ``expandable_segments:True``, set at the start of its process.
3. **Time.** Alone on the GPU, world 1 (NCCL), the 350M GPT with bf16 compute: osdp-fx
   ``replicate`` against DDP (under ``torch.autocast``) and osdp-fx ``full_shard`` against FSDP2
   (``fully_shard`` per block and on the root, ``MixedPrecisionPolicy(bf16, reduce fp32)``),
   timed round-robin, each step from a barrier to a device synchronize, the median of the
   rounds; osdp-fx compiles with ``detect_devices()``, and its predicted step time is shown
   against the measured one. After the eager rounds, each eager system's host time per step
   by category (collectives, copies and casts, views, optimizer, autograd, compute, other ops,
   and Python and dispatch outside ops), from ``torch.profiler``'s CPU self times over 3
   steps (``host_profile``). Then the same four under ``torch.compile`` (DDP and osdp-fx whole,
   FSDP2 per block as torchtitan does; ``--compiled full_shard``, the default with ``--quick``:
   FSDP2 and osdp-fx ``full_shard`` alone), round-robin after 21 warm-up steps (osdp-fx's
   regions choose compiled or eager in their first 19). Each system is built and warmed up in turn,
   the ``full_shard`` pair first, and its row has both durations (torch.compile compiles in
   the warm-up); a system whose turn comes when the budget is spent is left out, and the table
   names it.

Each part writes its rows as soon as it ends: ``DIR/gpu-check.md`` (the tables) and
``DIR/gpu-check.json``; a part that fails or runs out of ``--budget-s`` is recorded as such and
the others still run. The time part waits for the others until ``--time-reserve-s`` of the
budget is left; if some still run then, its table says it is not comparable. ``--quick`` keeps
to one short budget: the memory part at world 1 only, at world 2 the parity of the GPT and
the Llama (:data:`QUICK_WORLD2_MODELS`), and under torch.compile the ``full_shard`` pair alone. Exits non-zero when a parity check fails, a predicted
peak is off ``max_memory_allocated`` by more than +5 % / -10 %, or ``max_memory_reserved`` is
above a plan's memory limit.

Without a GPU it prints that it has nothing to check; ``--cpu`` runs everything on the CPU at
tiny sizes (gloo for NCCL), which checks the script itself.

    python benchmarks/gpu_check.py [--quick] [--out-dir DIR] [--budget-s 450] [--cpu]
        [--skip-parity] [--skip-memory] [--skip-time] [--skip-compile] [--compiled all]
        [--memory-models gpt,lora] [--parity-worlds 1,2] [--memory-worlds 1,2]
        [--parity-models ...] [--expandable-models gpt,lora] [--time-reserve-s 220]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from osdp_fx import Devices, compile_osdp, detect_devices  # noqa: E402
from osdp_fx.errors import OSDPError  # noqa: E402
from osdp_fx.examples import GPTWithLoss, HFCausalLMWithLoss, TinyGPT  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402

MiB = 2**20
RESULTS = ROOT / "benchmarks" / "results"
PLANS = ("replicate", "full_shard", "searched")
FP32_TOL = {"loss": (1e-5, 0.0), "param": (1e-4, 0.0)}  # (atol, rtol)
BF16_TOL = {"loss": (2e-3, 2e-2), "param": (5e-3, 0.0)}
MEMORY_BOUNDS = (-0.10, 0.05)
"""The promise checked: a predicted peak at most 10 % below and 5 % above the measured one
(``(predicted - measured) / measured``)."""


def nccl() -> str:
    """The backend of a one-rank world on the GPU (gloo on the ``--cpu`` dry run)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


# ---- models ------------------------------------------------------------------------------

HF_FAMILIES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "gemma": ("GemmaConfig", "GemmaForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM")}
"""The Hugging Face families :func:`build` makes besides Llama: the names of their config and
model classes in ``transformers``."""


def build(name: str, *, dim: int = 64, depth: int = 2, seq: int = 32, vocab: int = 256,
          heads: int = 4, lora_rank: int = 16) -> torch.nn.Module:
    """A model whose forward takes token ids and returns the LM loss (seeded: equal in every
    process). ``"lora"`` is a peft LoRA Llama whose frozen weights are bf16; the names of
    :data:`HF_FAMILIES` are tiny configs of those families, built like the small Llama."""
    torch.manual_seed(0)
    if name == "gpt":
        return GPTWithLoss(TinyGPT(vocab=vocab, dim=dim, depth=depth, heads=heads, max_seq=seq))
    if name not in ("llama", "lora", *HF_FAMILIES):
        raise ValueError(name)
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if name in HF_FAMILIES:
        config_class, model_class = HF_FAMILIES[name]
        extra = {"qwen3": {"head_dim": dim // heads}, "gemma": {"head_dim": dim // heads},
                 "phi3": {"pad_token_id": 0}}.get(name, {})
        cfg = getattr(transformers, config_class)(
            hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=depth,
            num_attention_heads=heads, num_key_value_heads=2, vocab_size=vocab,
            max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa", **extra)
        return HFCausalLMWithLoss(getattr(transformers, model_class)(cfg))
    large = dim >= 512
    cfg = LlamaConfig(hidden_size=dim, intermediate_size=(11 * dim) // 4 if large else 2 * dim,
                      num_hidden_layers=depth, num_attention_heads=heads,
                      num_key_value_heads=heads if large else 2, vocab_size=vocab,
                      max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    llama = LlamaForCausalLM(cfg)
    if name == "llama":
        return HFCausalLMWithLoss(llama)
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"])
    return HFCausalLMWithLoss(get_peft_model(llama.to(torch.bfloat16), lora))


def global_batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]


def strategy_counts(compiled: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for p in compiled.plan.params:
        counts[str(p.strategy)] = counts.get(str(p.strategy), 0) + 1
    return counts


# ---- the device ---------------------------------------------------------------------------

def _device_for(rank: int) -> torch.device:
    """The GPU, which every rank shares (the CPU for ``--cpu``, a dry run of this script)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _allocated(kind: str) -> int:
    """``torch.cuda`` memory figures (0 on the CPU dry run)."""
    if not torch.cuda.is_available():
        return 0
    return {"allocated": torch.cuda.memory_allocated, "max": torch.cuda.max_memory_allocated,
            "reserved": torch.cuda.memory_reserved,
            "max_reserved": torch.cuda.max_memory_reserved}[kind]()


def _plan_arg(plan: str, limits: dict[str, int]) -> dict[str, Any]:
    """compile_osdp's ``plan`` and ``memory_limit`` for a named plan, ``"searched"`` (halfway
    between replicate's and full_shard's predicted peaks, or 10 % above the smaller where
    sharding saves nothing, as at world 1) or ``"binding"`` (searched at replicate's predicted
    peak: the search plans within ``limit * (1 - Devices.memory_margin)``, so it must shard or
    recompute to fit)."""
    if plan == "binding":
        if "replicate" not in limits:
            raise OSDPError("the binding plan's limit needs replicate's prediction")
        return {"plan": None, "memory_limit": limits["replicate"]}
    if plan != "searched":
        return {"plan": plan, "memory_limit": None}
    if not {"replicate", "full_shard"} <= set(limits):
        raise OSDPError("the searched plan's limit needs replicate's and full_shard's predictions")
    low, high = sorted((limits["replicate"], limits["full_shard"]))
    return {"plan": None, "memory_limit": max((low + high) // 2, int(low / 0.9))}


# ---- 1. parity ---------------------------------------------------------------------------

def train_compiled(rank: int, world: int, model: str, mp: str | None, steps: int,
                   batch: int, seq: int, vocab: int, lr: float) -> dict[str, Any]:
    """Every plan of :data:`PLANS` for ``model``: losses and the full state after ``steps``."""
    device = _device_for(rank)
    data = [b.chunk(world)[rank].to(device) for b in global_batches(steps, batch, seq, vocab)]
    out: dict[str, Any] = {}
    limits: dict[str, int] = {}
    for plan in PLANS:
        net = build(model, seq=seq, vocab=vocab).to(device)
        try:
            compiled = compile_osdp(net, (data[0],), **_plan_arg(plan, limits),
                                    mixed_precision=mp, optimizer="sgd")
        except OSDPError as exc:
            out[plan] = {"error": str(exc)}
            continue
        del net
        limits[plan] = compiled.plan.prediction.peak_memory_bytes
        opt = torch.optim.SGD(compiled.parameters(), lr=lr)
        losses = []
        for x in data:
            loss = compiled(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        out[plan] = {"losses": losses,
                     "state": {k: v.cpu() for k, v in compiled.full_state_dict().items()},
                     "strategies": strategy_counts(compiled)}
        del compiled, opt
    return out


def train_cases(rank: int, world: int, cases: list[tuple[str, str | None]],
                *args: Any) -> dict[str, Any]:
    """:func:`train_compiled` for each (model, precision) of ``cases`` in one world; a case that
    raises is its error."""
    out = {}
    for model, mp in cases:
        try:
            out[f"{model}/{mp}"] = train_compiled(rank, world, model, mp, *args)
        except Exception as exc:  # noqa: BLE001 - reported as the case's row
            out[f"{model}/{mp}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return out


def train_reference(model: str, mp: str | None, steps: int, batch: int, seq: int, vocab: int,
                    lr: float) -> dict[str, Any]:
    """Single-process CUDA training on the global batch (bf16: parameters cast for compute)."""
    device = _device_for(0)
    net = build(model, seq=seq, vocab=vocab).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    for x in global_batches(steps, batch, seq, vocab):
        x = x.to(device)
        if mp is None:
            loss = net(x)
        else:
            cast = {n: p.to(torch.bfloat16) for n, p in net.named_parameters()}
            loss = torch.func.functional_call(net, cast, (x,))
        loss.float().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.cpu() for k, v in net.state_dict().items()}}


def compare(results: list[dict[str, Any]], ref: dict[str, Any], tol: dict[str, tuple]) -> dict:
    """Per plan: the largest loss and parameter differences and whether they are in tolerance."""
    rows = {}
    for plan in PLANS:
        per_rank = [r[plan] for r in results]
        if "error" in per_rank[0]:
            rows[plan] = {"ok": False, "error": per_rank[0]["error"]}
            continue
        mean = torch.tensor([r["losses"] for r in per_rank]).mean(0)
        expected = torch.tensor(ref["losses"])
        loss_diff = (mean - expected).abs().max().item()
        (la, lr_), (pa, pr) = tol["loss"], tol["param"]
        loss_ok = bool(((mean - expected).abs() <= la + lr_ * expected.abs()).all())
        param_diff, param_ok, worst, where = 0.0, True, "", ()
        for r in per_rank:
            for key, value in ref["state"].items():
                d = (r["state"][key].float() - value.float()).abs()
                if d.numel() and d.max().item() > param_diff:
                    param_diff, worst = d.max().item(), key
                    where = tuple(int(i) for i in torch.unravel_index(d.argmax(), d.shape))
                param_ok &= bool((d <= pa + pr * value.float().abs()).all())
        rows[plan] = {"ok": loss_ok and param_ok, "loss_diff": loss_diff,
                      "param_diff": param_diff, "worst_param": worst, "worst_index": where,
                      "strategies": per_rank[0]["strategies"]}
    return rows


PARITY_ARGS = (5, 4, 32, 256, 0.05)  # steps, global batch, sequence, vocabulary, SGD lr
PARITY_CASES = ([(m, mp) for m in ("gpt", "llama") for mp in (None, "bf16")]
                + [(m, "bf16") for m in HF_FAMILIES])


QUICK_WORLD2_MODELS = ("gpt", "llama")
"""With ``--quick``, the parity part's models at world 2 (two ranks sharing the GPU over gloo,
the slowest world): every family runs at world 1."""


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(w) for w in text.split(","))


def parity_world(world: int, backend: str, timeout_s: float,
                 cases: list[tuple[str, str | None]] = PARITY_CASES) -> list[dict[str, Any]]:
    """Every case of ``cases`` in one world, against single-process training."""
    results = run_world(world, train_cases, cases, *PARITY_ARGS, backend=backend,
                        timeout_s=timeout_s, collective_timeout_s=min(300.0, timeout_s))
    rows = []
    for model, mp in cases:
        per_rank = [r[f"{model}/{mp}"] for r in results]
        base = {"model": model, "precision": mp or "fp32", "world": world, "backend": backend}
        if "error" in per_rank[0]:
            rows.append({**base, "plan": "all", "ok": False, "error": per_rank[0]["error"]})
            continue
        ref = train_reference(model, mp, *PARITY_ARGS)
        for plan, row in compare(per_rank, ref, BF16_TOL if mp else FP32_TOL).items():
            rows.append({**base, "plan": plan, **row})
    return rows


# ---- 2. memory -----------------------------------------------------------------------------

def memory_sizes(cpu: bool) -> dict[str, dict[str, int]]:
    """The memory and time models' sizes (tiny on the CPU dry run)."""
    if cpu:
        return {"gpt": dict(dim=128, depth=2, seq=64, vocab=512, heads=4, batch=2),
                "lora": dict(dim=128, depth=2, seq=64, vocab=512, heads=4, batch=2)}
    return {"gpt": dict(dim=1024, depth=24, seq=1024, vocab=32768, heads=16, batch=8),
            "lora": dict(dim=1024, depth=24, seq=1024, vocab=32000, heads=16, batch=4)}


def memory_worlds(model: str, sizes: tuple[int, ...] = (1, 2),
                  expandable: tuple[str, ...] = ("gpt", "lora"),
                  ) -> list[tuple[int, str, list[str], bool]]:
    """The memory part's worlds for ``model``: (world size, backend, plans, expandable
    segments), each run in processes of its own, of world sizes ``sizes``; the models of
    ``expandable`` also run world 1 with the caching allocator's ``expandable_segments``."""
    worlds = [(1, nccl(), ["replicate", "full_shard", "binding"], False),
              (2, "gloo", ["replicate", "full_shard", "searched", "binding"], False)]
    if model in expandable:
        worlds.append((1, nccl(), ["replicate", "full_shard", "binding"], True))
    return [w for w in worlds if w[0] in sizes]


def measure_memory(rank: int, world: int, model: str, size: dict[str, int], plans: list[str],
                   steps: int, partial: str, expandable: bool = False) -> list[dict[str, Any]]:
    """Per plan, one after the other in this process: predicted against measured peaks (rank
    0's rows also written to ``partial``, JSON, as each plan ends). ``expandable``: the caching
    allocator runs with ``expandable_segments:True``, set before this function allocates on
    the GPU (on a GPU only); each row's ``"allocator"`` says which setting the process ran
    with, and ``"allocator_error"`` why the setting failed, if it did."""
    allocator, allocator_error = "default", None
    if expandable and torch.cuda.is_available():
        try:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
            allocator = "expandable_segments"
        except (AttributeError, RuntimeError) as exc:  # private API
            allocator_error = f"{type(exc).__name__}: {str(exc)[:300]}"
    device = _device_for(rank)
    size = dict(size)
    batch = size.pop("batch")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, size["vocab"], (batch, size["seq"]), generator=gen).to(device)
    out: list[dict[str, Any]] = []
    limits: dict[str, int] = {}
    for plan in plans:
        row: dict[str, Any] = {"model": model, "world": world, "plan": plan,
                               "allocator": allocator}
        if allocator_error:
            row["allocator_error"] = allocator_error
        try:
            row.update(_measure_plan(model, size, plan, x, device, world, steps, limits))
        except Exception as exc:  # noqa: BLE001 - the plan's row says what failed
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        out.append(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if rank == 0:
            Path(partial).write_text(json.dumps(out, default=str))
    return out


def _measure_plan(model: str, size: dict[str, int], plan: str, x: torch.Tensor,
                  device: torch.device, world: int, steps: int,
                  limits: dict[str, int]) -> dict[str, Any]:
    args = _plan_arg(plan, limits)
    held_before_model = _allocated("allocated")
    net = build(model, **size).to(device)
    n_params = sum(p.numel() for p in net.parameters())
    n_trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    start = time.perf_counter()
    compiled = compile_osdp(net, (x,), **args, mixed_precision="bf16", optimizer="adamw")
    compile_s = time.perf_counter() - start
    del net
    pred = compiled.plan.prediction
    limits[plan] = pred.peak_memory_bytes
    opt = torch.optim.AdamW([p for p in compiled.parameters() if p.requires_grad], lr=1e-4)
    _sync()
    held_before = _allocated("allocated")
    reserved_before = _allocated("reserved")
    times, peaks, reserved = [], [], []
    for _ in range(steps):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if world > 1:
            dist.barrier()
        _sync()
        t0 = time.perf_counter()
        compiled(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync()
        times.append(time.perf_counter() - t0)
        peaks.append(_allocated("max"))
        reserved.append(_allocated("max_reserved"))
    row = {
        "params": n_params, "trainable": n_trainable, "strategies": strategy_counts(compiled),
        "compile_s": compile_s, "held_before_model": held_before_model,
        "held_before_step1": held_before, "reserved_before_step1": reserved_before,
        "predicted_first": pred.first_step_peak_bytes, "measured_first": peaks[0],
        "predicted_steady": pred.peak_memory_bytes, "measured_steady": max(peaks[1:]),
        "reserved_first": reserved[0], "reserved_steady": max(reserved[1:]),
        "predicted_step_s": pred.step_time_s, "measured_step_s": statistics.median(times[1:]),
        "limit": args["memory_limit"],
        "reserved_within_limit": (None if args["memory_limit"] is None
                                  else max(reserved) <= args["memory_limit"]),
    }
    del compiled, opt
    return row


def _err(pred: int | None, meas: int) -> float | None:
    return None if not pred or not meas else (pred - meas) / meas


def memory_off(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose steady or first-step prediction is outside :data:`MEMORY_BOUNDS`."""
    low, high = MEMORY_BOUNDS
    off = []
    for r in rows:
        if "error" in r:  # a row of the CPU dry run measures 0: no error to judge
            continue
        errs = [_err(r["predicted_steady"], r["measured_steady"]),
                _err(r["predicted_first"], r["measured_first"])]
        if any(e is not None and not low <= e <= high for e in errs):
            off.append(r)
    return off


def reserved_over_limit(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows whose ``max_memory_reserved`` (over step 1 or steps 2+) is above their memory
    limit (rows without a limit are not judged)."""
    return [r for r in rows if r.get("reserved_within_limit") is False]


# ---- 3. time -------------------------------------------------------------------------------

class Autocast(torch.nn.Module):
    """``module`` run under ``torch.autocast`` in bf16: how a DDP user trains in bf16."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return self.module(x)


HOST_CATEGORIES = ("step wall", "python and dispatch outside ops", "collectives",
                   "copies and casts", "views", "optimizer", "autograd", "compute", "other ops")
"""The keys of :func:`host_profile`, in the order of the host-time table."""

_COLLECTIVE_WORDS = ("c10d", "nccl", "gloo", "all_gather", "reduce_scatter", "all_reduce",
                     "record_param_comms", "broadcast")
_COPY_OPS = frozenset(f"aten::{op}" for op in (
    "copy_", "_to_copy", "to", "cat", "split_with_sizes_copy", "_chunk_cat", "_foreach_copy_",
    "constant_pad_nd", "pad", "clone", "zero_", "fill_", "zeros", "empty", "empty_strided",
    "resize_"))
_VIEW_OPS = frozenset(f"aten::{op}" for op in (
    "view", "reshape", "as_strided", "slice", "narrow", "t", "transpose", "expand", "unsqueeze",
    "squeeze", "select", "detach", "alias", "_unsafe_view", "broadcast_tensors"))
DEVICE_WAIT = "device synchronize after the step"
"""The profiler event around :func:`host_profile`'s synchronize after each step (its wait for
the device), which falls under "other ops"."""


def host_category(name: str) -> str:
    """The category of :data:`HOST_CATEGORIES` that a profiler event's name falls in (the copy
    and view ops by their exact names, then the others by what their names contain)."""
    if name in _COPY_OPS:
        return "copies and casts"
    if name in _VIEW_OPS:
        return "views"
    if any(word in name.lower() for word in _COLLECTIVE_WORDS):
        return "collectives"
    if name.startswith("Optimizer.") or "_foreach_" in name or "adam" in name.lower():
        return "optimizer"
    if name.startswith(("autograd::", "torch::autograd::")) or "Backward" in name:
        return "autograd"
    if name.startswith(("aten::", "cuda")):
        return "compute"
    return "other ops"


def host_profile(step: Callable[[], None], steps: int = 3,
                 events: list[tuple[str, float, float]] | None = None) -> dict[str, float]:
    """Host (CPU) seconds per step by category: ``step()`` once to warm up, then ``steps``
    times under ``torch.profiler`` (CPU activity only), each step timed with the wall clock
    from a device synchronize to the next one. Each profiler event's self time (exclusive of
    the events it encloses) counts under the category of its name (:func:`host_category`);
    ``"python and dispatch outside ops"`` is the rest of the step's wall time (none when the
    events add up to more). The synchronize after each step is an event of its own
    (:data:`DEVICE_WAIT`), so that waiting for the device is not counted as Python. Returns the
    means per step of :data:`HOST_CATEGORIES`, ``"step wall"`` the wall time. ``events``: a list
    that receives the 40 events of most self time (name, self seconds and calls per step)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    step()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _sync()
            start = time.perf_counter()
            step()
            with record_function(DEVICE_WAIT):
                _sync()
            walls.append(time.perf_counter() - start)
    out = dict.fromkeys(HOST_CATEGORIES, 0.0)
    averages = prof.key_averages()
    for event in averages:
        out[host_category(event.key)] += event.self_cpu_time_total * 1e-6 / steps
    if events is not None:
        events += sorted(((e.key, e.self_cpu_time_total * 1e-6 / steps, e.count / steps)
                          for e in averages), key=lambda e: -e[1])[:40]
    in_events = sum(out.values())
    out["step wall"] = statistics.mean(walls)
    out["python and dispatch outside ops"] = max(0.0, out["step wall"] - in_events)
    return out


def time_systems(rank: int, world: int, size: dict[str, int], rounds: int, warmup: int,
                 compiled: str, deadline: float, partial: str) -> dict[str, Any]:
    """DDP, FSDP2, osdp-fx replicate and full_shard, eager, then under torch.compile
    (``compiled``: ``"all"`` of them, the ``"full_shard"`` pair alone, or ``"none"``); each
    eager system's row also has its host time per step by category (``"host_s"``,
    :func:`host_profile`). Each system is built and warmed up in turn (``"build_s"`` and
    ``"warmup_s"`` in its row: compile_osdp's seconds, and the warm-up steps', in which
    torch.compile compiles), in the order of :func:`_system_builders`; a system whose turn
    comes after ``deadline`` is left out (``"left_out"``), and the ones built are timed
    round-robin. What is measured so far is also written to ``partial`` (JSON) as each half
    ends."""
    import compare as bench

    device = _device_for(rank)
    cfg = bench.Config(vocab=size["vocab"], dim=size["dim"], depth=size["depth"],
                       heads=size["heads"], seq=size["seq"], batch=size["batch"])
    x = bench.local_batch(cfg, rank, device)
    start = time.perf_counter()
    devices = detect_devices()
    detect_s = time.perf_counter() - start
    out: dict[str, Any] = {"detect_s": detect_s, "devices": {
        "compute_flops_per_s": devices.compute_flops_per_s,
        "bf16_flops_per_s": devices.compute_flops_per_s_by_dtype.get("bfloat16"),
        "memory_bandwidth_bytes_per_s": devices.memory_bandwidth_bytes_per_s,
        "memory_margin": devices.memory_margin}}
    for under_compile in (False, True) if compiled != "none" else (False,):
        key = "compiled" if under_compile else "eager"
        half_start = time.perf_counter()
        systems: list[Any] = []
        try:
            left_out = []
            builders = _system_builders(cfg, world, device, x, devices, under_compile)
            if under_compile and compiled == "full_shard":
                builders = builders[:2]
            for label, make in builders:
                if _past(deadline):
                    left_out.append(label)
                    continue
                t0 = time.perf_counter()
                s = make()
                t1 = time.perf_counter()
                for _ in range(warmup + (19 if under_compile else 0)):
                    dist.barrier()
                    s.timed_step()
                s.info.update(build_s=t1 - t0, warmup_s=time.perf_counter() - t1)
                systems.append(s)
            if not systems:
                out[key] = {"error": "skipped: out of --budget-s"}
                continue
            bench.time_round_robin(systems, rounds, 0)
            out[key] = [dict(s.row(world, cfg.batch), system=s.system, plan=s.plan)
                        for s in systems]
            if left_out:
                out[f"{key}_left_out"] = left_out
            if not under_compile:  # after the timed rounds: the profiler slows the steps
                for s, row in zip(systems, out[key]):
                    try:
                        row["host_events"] = []
                        row["host_s"] = host_profile(lambda s=s: (s.step(), s.zero_grad()),
                                                     steps=3, events=row["host_events"])
                    except Exception as exc:  # noqa: BLE001 - the timed rows stand without it
                        row["host_s"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        except Exception as exc:  # noqa: BLE001 - the part's row says what failed
            out[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
        finally:
            out[f"{key}_s"] = time.perf_counter() - half_start
        systems = []
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        Path(partial).write_text(json.dumps(out, default=str))
    return out


def _past(deadline: float) -> bool:
    """Whether the wall clock is past ``deadline`` (it comes from the parent process), as rank
    0 sees it: every rank takes its answer, so that they build the same systems."""
    answer = [time.time() > deadline]
    dist.broadcast_object_list(answer, src=0)
    return bool(answer[0])


def _system_builders(cfg: Any, world: int, device: torch.device, x: torch.Tensor,
                     devices: Devices, compiled: bool) -> list[tuple[str, Callable[[], Any]]]:
    """Each system's label and a function that builds it, in the order they are built: the
    ``full_shard`` pair first, then the ``replicate`` pair, then the block buckets (a half that
    runs out of time keeps whole pairs where it can)."""
    import compare as bench
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrap: Callable[[torch.nn.Module], torch.nn.Module] = torch.compile if compiled else (
        lambda m: m)

    def ddp() -> Any:
        model = DDP(bench.build_model(cfg, device),
                    device_ids=[device.index] if device.type == "cuda" else None)
        return bench.System("DDP (autocast bf16)", "-", wrap(Autocast(model)), x, device)

    def fsdp2() -> Any:
        model = bench.build_model(cfg, device)
        mesh = init_device_mesh(device.type, (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.model.blocks:
            if compiled:
                block.compile()
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return bench.System("FSDP2 (bf16)", "-", model, x, device)

    def osdp(label: str, plan: str) -> Callable[[], Any]:
        def make() -> Any:
            if plan == BLOCK_BUCKETS:
                path = Path(tempfile.mkdtemp()) / "full_shard_blocks.json"
                path.write_text(json.dumps(BLOCK_BUCKETS_PLAN))
                named: str = str(path)
            else:
                named = plan
            model = compile_osdp(bench.build_model(cfg, device), (x,), devices, plan=named,
                                 mixed_precision="bf16", optimizer="adamw")
            s = bench.System("osdp-fx (bf16)", label, wrap(model), x, device)
            pred = model.plan.prediction
            s.info.update(predicted_step_s=model.plan.step_time_s,
                          predicted_peak_bytes=model.plan.peak_memory_bytes,
                          predicted_phases_s=[pred.compute_s, pred.comm_s, pred.optim_s,
                                              pred.host_s],
                          gather_bucket_bytes=model.plan.schedule.gather_bucket_bytes)
            return s
        return make

    return [("FSDP2 (bf16)", fsdp2), ("osdp-fx full_shard", osdp("full_shard", "full_shard")),
            ("DDP (autocast bf16)", ddp), ("osdp-fx replicate", osdp("replicate", "replicate")),
            (f"osdp-fx {BLOCK_BUCKETS}", osdp(BLOCK_BUCKETS, BLOCK_BUCKETS))]


BLOCK_BUCKETS = "full_shard, block buckets"
BLOCK_BUCKETS_PLAN = {"format": "osdp-fx-plan", "version": 1, "default": "full_shard",
                      "gather_bucket_bytes": 2**30, "scatters_in_flight": 1}
"""The hand-written plan that gathers like FSDP2: every transformer block in one all-gather
(``docs/plan-format.md``, ``gather_bucket_bytes``), one gradient collective in flight."""


# ---- running the parts side by side ----------------------------------------------------------

class Report:
    """The rows of every part, written to ``out_dir`` each time a part ends."""

    def __init__(self, out_dir: Path, name: str) -> None:
        self.out_dir, self.lock = out_dir, threading.Lock()
        self.data: dict[str, Any] = {"device": name, "torch": torch.__version__,
                                     "cuda": torch.version.cuda, "parts": {}}
        out_dir.mkdir(parents=True, exist_ok=True)

    def add(self, part: str, value: Any, seconds: float) -> None:
        with self.lock:
            self.data["parts"][part] = {"seconds": round(seconds, 1), "value": value}
            (self.out_dir / "gpu-check.json").write_text(
                json.dumps(self.data, indent=1, default=str))
            (self.out_dir / "gpu-check.md").write_text(markdown(self.data))
        print(f"[{part}] done in {seconds:.0f} s", flush=True)


def _in_thread(report: Report, part: str, fn: Callable[[], Any]) -> threading.Thread:
    def target() -> None:
        start = time.monotonic()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - the part's entry says what failed
            value = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        report.add(part, value, time.monotonic() - start)

    thread = threading.Thread(target=target, name=part, daemon=True)
    thread.start()
    return thread


def run(args: argparse.Namespace) -> Report:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
    print(f"device: {name}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    report = Report(args.out_dir, name)
    start = time.monotonic()
    deadline = start + args.budget_s
    sizes = memory_sizes(args.cpu)
    report.data["sizes"] = sizes

    def left() -> float:
        return max(10.0, deadline - time.monotonic())

    threads = []
    if not args.skip_parity:
        cases = [c for c in PARITY_CASES
                 if args.parity_models is None or c[0] in args.parity_models.split(",")]
        for world, backend in ((1, nccl()), (2, "gloo")):
            if world not in _sizes(args.parity_worlds):
                continue
            world_cases = [c for c in cases if world == 1 or not args.quick
                           or c[0] in QUICK_WORLD2_MODELS]
            threads.append(_in_thread(report, f"parity world {world} ({backend})",
                                      lambda w=world, b=backend, c=world_cases: parity_world(
                                          w, b, max(10.0, left() - args.time_reserve_s), c)))
    if not args.skip_memory:
        for model in args.memory_models.split(","):
            for world, backend, plans, expandable in memory_worlds(
                    model, _sizes(args.memory_worlds), tuple(args.expandable_models.split(","))):
                def measure(model=model, world=world, backend=backend, plans=plans,
                            expandable=expandable) -> Any:
                    suffix = "-expandable" if expandable else ""
                    partial = args.out_dir / f"memory-{model}-{world}{suffix}.json"
                    try:  # rank 0's rows; ended in time for the time part to run alone
                        return run_world(world, measure_memory, model, sizes[model], plans,
                                         args.memory_steps, str(partial), expandable,
                                         backend=backend,
                                         timeout_s=max(10.0, left() - args.time_reserve_s),
                                         collective_timeout_s=300.0)[0]
                    except OSDPError as exc:  # the plans measured before it failed
                        rows = json.loads(partial.read_text()) if partial.exists() else []
                        return rows + [{"model": model, "world": world, "plan": "(rest)",
                                        "error": str(exc).splitlines()[0][:300]}]
                allocator = ", expandable_segments" if expandable else ""
                threads.append(_in_thread(
                    report, f"memory {model} world {world} ({backend}{allocator})", measure))
    # the time part runs alone on the GPU: after the others, within what is left
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic() - args.time_reserve_s))
    if not args.skip_time:
        t0 = time.monotonic()
        report.data["running_beside_time"] = [t.name for t in threads if t.is_alive()]
        partial = args.out_dir / "time-partial.json"
        try:
            value = run_world(1, time_systems, sizes["gpt"], args.rounds, 2,
                              "none" if args.skip_compile else args.compiled,
                              time.time() + left() - 40.0,
                              str(partial), backend=nccl(), timeout_s=left(),
                              collective_timeout_s=300.0)[0]
        except Exception as exc:  # noqa: BLE001 - keep what the world measured before it failed
            value = json.loads(partial.read_text()) if partial.exists() else {}
            value["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        report.add("time world 1", value, time.monotonic() - t0)
    for thread in threads:  # each world has its own timeout
        thread.join()
    return report


# ---- tables ----------------------------------------------------------------------------------

def parity_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | precision | world (backend) | plan | strategies | max loss diff | "
             "max param diff | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['precision']} | {r['world']} ({r['backend']}) | "
                         f"{r['plan']} | {r['error']} | | | no |")
            continue
        lines.append(f"| {r['model']} | {r['precision']} | {r['world']} ({r['backend']}) | "
                     f"{r['plan']} | {_counts(r['strategies'])} | {r['loss_diff']:.1e} | "
                     f"{r['param_diff']:.1e}{_worst(r)} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def _worst(row: dict[str, Any]) -> str:
    """The parameter and element of the largest difference, where a parity row fails."""
    if row["ok"] or not row.get("worst_param"):
        return ""
    index = row.get("worst_index")
    return f" ({row['worst_param']}{list(index) if index else ''})"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _pct(e: float | None) -> str:
    return "" if e is None else f"{e:+.1%}"


def _allocator(r: dict[str, Any]) -> str:
    """The allocator setting a row ran with, and why the setting asked for failed, if it did."""
    text = r.get("allocator", "")
    return f"{text} ({r['allocator_error']})" if r.get("allocator_error") else text


def memory_table(rows: list[dict[str, Any]]) -> str:
    """Per plan: predicted against ``max_memory_allocated``, then ``max_memory_reserved``
    against the prediction (steps 2+) and against the plan's memory limit (the larger of step
    1's and steps 2+'s; blank where the plan has no limit)."""
    lines = ["| model | world | plan | strategies | step 1 pred / meas (MiB) | err | steps 2+ "
             "pred / meas (MiB) | err | reserved steps 2+ (MiB) | reserved / pred | "
             "reserved max (MiB) | limit (MiB) | reserved <= limit | allocator | compile (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['world']} | {r['plan']} | {r['error']} "
                         f"|||||||||| {_allocator(r)} ||")
            continue
        e1 = _err(r["predicted_first"], r["measured_first"])
        e2 = _err(r["predicted_steady"], r["measured_steady"])
        margin = r["reserved_steady"] / r["predicted_steady"] - 1 if r["predicted_steady"] else 0
        reserved_max = max(r.get("reserved_first", 0), r["reserved_steady"])
        limit = f"{r['limit'] / MiB:.0f}" if r.get("limit") is not None else ""
        within = {True: "yes", False: "NO", None: ""}[r.get("reserved_within_limit")]
        lines.append(
            f"| {r['model']} | {r['world']} | {r['plan']} | {_counts(r['strategies'])} | "
            f"{(r['predicted_first'] or 0) / MiB:.0f} / {r['measured_first'] / MiB:.0f} | "
            f"{_pct(e1)} | {r['predicted_steady'] / MiB:.0f} / {r['measured_steady'] / MiB:.0f} "
            f"| {_pct(e2)} | {r['reserved_steady'] / MiB:.0f} | {margin:+.1%} | "
            f"{reserved_max / MiB:.0f} | {limit} | {within} | {_allocator(r)} | "
            f"{r['compile_s']:.0f} |")
    return "\n".join(lines)


def time_table(rows: list[dict[str, Any]], baseline: dict[str, str]) -> str:
    """Median step times; each osdp-fx plan against its baseline (``baseline[plan]``)."""
    by_name = {r["system"]: r for r in rows}
    lines = ["| system | plan | step (ms) | fwd / bwd / opt (ms) | predicted (ms): compute / "
             "comm / optimizer / runtime host | predicted / measured | vs baseline | build / "
             "warm-up (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = by_name.get(baseline.get(r["plan"], ""))
        ratio = f"{r['step_s'] / base['step_s']:.3f}x {base['system'].split()[0]}" if (
            base and r["system"].startswith("osdp")) else ""
        pred = f"{r['predicted_step_s'] * 1e3:.1f}" if r.get("predicted_step_s") else ""
        if r.get("predicted_phases_s"):
            pred += ": " + " / ".join(f"{t * 1e3:.1f}" for t in r["predicted_phases_s"])
        accuracy = (f"{r['predicted_step_s'] / r['step_s']:.2f}" if r.get("predicted_step_s")
                    else "")
        lines.append(f"| {r['system']} | {r['plan']} | {r['step_s'] * 1e3:.1f} | "
                     f"{r['forward_s'] * 1e3:.1f} / {r['backward_s'] * 1e3:.1f} / "
                     f"{r['optimizer_s'] * 1e3:.1f} | {pred} | {accuracy} | {ratio} | "
                     f"{r.get('build_s', 0):.0f} / {r.get('warmup_s', 0):.0f} |")
    return "\n".join(lines)


def host_table(rows: list[dict[str, Any]]) -> str:
    """Each system's host time per step by category (:func:`host_profile`), in ms."""
    lines = ["| system | plan | " + " | ".join(HOST_CATEGORIES) + " |",
             "|---|---|" + "---|" * len(HOST_CATEGORIES)]
    for r in rows:
        host = r.get("host_s") or {"error": "not measured"}
        if "error" in host:
            cells = [host["error"]] + [""] * (len(HOST_CATEGORIES) - 1)
        else:
            cells = [f"{host[c] * 1e3:.1f}" for c in HOST_CATEGORIES]
        lines.append(f"| {r['system']} | {r['plan']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _part(value: Any) -> str | None:
    """A failed part's message, or None."""
    return value["error"] if isinstance(value, dict) and "error" in value else None


def markdown(data: dict[str, Any]) -> str:
    parts = data["parts"]
    text = [f"# osdp-fx on {data['device']} (torch {data['torch']}, CUDA {data['cuda']})", ""]
    sections = (("parity", "Parity against single-process training (5 SGD steps)", parity_table),
                ("memory", f"Memory: {data.get('sizes')}, bf16 compute, AdamW", memory_table))
    for prefix, title, table in sections:
        found = [(k, v["value"]) for k, v in parts.items() if k.startswith(prefix)]
        if not found:
            continue
        text += [f"## {title}", ""]
        rows = []
        for k, value in found:
            if _part(value):
                text += [f"{k}: failed: {_part(value)}", ""]
            else:
                rows += value
        text += [table(rows), ""]
    if "time world 1" in parts:
        value = parts["time world 1"]["value"]
        text += ["## Step time, world 1 (NCCL), round-robin", ""]
        if data.get("running_beside_time"):
            text += ["**Not comparable**: the time part started while these parts still ran on "
                     f"the GPU: {', '.join(data['running_beside_time'])}. Time it alone "
                     "(`--skip-parity --skip-memory`).", ""]
        if _part(value):
            text += [f"failed: {_part(value)}", ""]
        if "devices" in value:
            text += [f"detect_devices ({value['detect_s']:.0f} s): {value['devices']}", ""]
            for key in ("eager", "compiled"):
                if key in value:
                    took = f" ({value[key + '_s']:.0f} s)" if key + "_s" in value else ""
                    text += [f"### {key}{took}", ""]
                    if value.get(f"{key}_left_out"):
                        text += ["Left out, out of the budget: "
                                 f"{', '.join(value[key + '_left_out'])}.", ""]
                    text += [f"failed: {_part(value[key])}" if _part(value[key]) else time_table(
                        value[key], {"replicate": "DDP (autocast bf16)",
                                     "full_shard": "FSDP2 (bf16)",
                                     BLOCK_BUCKETS: "FSDP2 (bf16)"}), ""]
                    if not _part(value[key]) and any("host_s" in r for r in value[key]):
                        text += ["#### Host time per step by category (ms)", "",
                                 "torch.profiler, CPU activity, 3 steps after the timed rounds: "
                                 "each event's self time; other ops include the wait in the "
                                 "device synchronize after each step.", "",
                                 host_table(value[key]), ""]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="every part within --budget-s (default 450 s with --quick)")
    parser.add_argument("--budget-s", type=float, default=None)
    parser.add_argument("--memory-models", default="gpt,lora",
                        help="the memory part's models, of gpt and lora (comma-separated)")
    parser.add_argument("--time-reserve-s", type=float, default=220.0,
                        help="seconds of the budget kept for the time part")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument("--compiled", choices=("all", "full_shard"), default=None,
                        help="the systems timed under torch.compile: all five, or the "
                             "full_shard pair (FSDP2 and osdp-fx full_shard; the default "
                             "with --quick)")
    parser.add_argument("--memory-steps", type=int, default=5)
    parser.add_argument("--parity-worlds", default="1,2",
                        help="the parity part's world sizes (comma-separated)")
    parser.add_argument("--memory-worlds", default=None,
                        help="the memory part's world sizes (default 1 with --quick, else 1,2)")
    parser.add_argument("--parity-models", default=None,
                        help="the parity part's models (comma-separated; default: all)")
    parser.add_argument("--expandable-models", default="gpt,lora",
                        help="the memory models also run at world 1 under expandable_segments")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--cpu", action="store_true",
                        help="without a GPU: run every step on the CPU (checks the script only)")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 450.0 if args.quick else 1800.0
    if args.memory_worlds is None:
        args.memory_worlds = "1" if args.quick else "1,2"
    if args.compiled is None:
        args.compiled = "full_shard" if args.quick else "all"
    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_check: no CUDA device (--cpu: a dry run of the script on the CPU)")
        return 0
    report = run(args)
    print(markdown(report.data), flush=True)
    parts = report.data["parts"]
    failed = [r for k, v in parts.items() if k.startswith("parity")
              for r in (v["value"] if isinstance(v["value"], list) else [v["value"]])
              if not r.get("ok")]
    memory_rows = [r for k, v in parts.items() if k.startswith("memory")
                   and isinstance(v["value"], list) for r in v["value"]]
    off = memory_off(memory_rows)
    over = reserved_over_limit(memory_rows)
    print(f"parity failures: {len(failed)}; predicted peaks outside {MEMORY_BOUNDS}: {len(off)}; "
          f"reserved above the memory limit: {len(over)}")
    return 1 if failed or off or over else 0


if __name__ == "__main__":
    sys.exit(main())

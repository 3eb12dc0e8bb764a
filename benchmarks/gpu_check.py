"""osdp-fx on a CUDA GPU: parity, predicted against measured memory and time, DDP and FSDP2.

One command on a machine with a CUDA GPU (``python benchmarks/gpu_check.py``):

1. **Parity.** A GPT (``osdp_fx.examples``) and a Hugging Face Llama (tiny configs, random
   weights, captured by ``torch.export``) train 5 SGD steps on the GPU under ``replicate``,
   ``full_shard`` and the searched plan (at a limit halfway between those two plans' predicted
   peaks), at world 1 with NCCL and at world 2 with two processes sharing the GPU over gloo
   (NCCL refuses two ranks on one GPU; step 0 lists which gloo collectives take CUDA tensors),
   each against single-process CUDA training on the global batch: losses to 1e-5 and parameters
   to 1e-4 in fp32, and with ``mixed_precision="bf16"`` to the tolerances of
   ``tests/distributed/test_mixed_precision.py`` (losses rtol 2e-2 / atol 2e-3, parameters
   5e-3).
2. **Memory.** A GPT of d=1024, 12 layers, sequence 1024, batch 4 per rank, bf16 compute and
   AdamW: per plan, the predicted peak (``compiled.plan.prediction``: the first step's and the
   steady state's) against ``torch.cuda.max_memory_allocated`` over step 1 and over steps 2-5
   (and ``max_memory_reserved``, what the caching allocator holds), from a reset taken after
   ``compile_osdp`` returns (no ``gc.collect()``, no ``empty_cache()`` between steps).
3. **Time.** The same runs' predicted step time against the measured median; then
   ``benchmarks/compare.py`` at world 1 (NCCL), which times full_shard against FSDP2
   (``fully_shard`` per block) and replicate against DDP round-robin in one process group.

Writes ``benchmarks/results/gpu-check.md`` (the tables) and ``gpu-check.json``; exits non-zero
when a parity check fails or a predicted peak is off by more than 10 %.

    python benchmarks/gpu_check.py [--skip-compare] [--memory-steps 5] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from osdp_fx import compile_osdp  # noqa: E402
from osdp_fx.errors import OSDPError  # noqa: E402
from osdp_fx.examples import GPTWithLoss, HFCausalLMWithLoss, TinyGPT  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402

MiB = 2**20
RESULTS = ROOT / "benchmarks" / "results"
PLANS = ("replicate", "full_shard", "searched")
FP32_TOL = {"loss": (1e-5, 0.0), "param": (1e-4, 0.0)}  # (atol, rtol)
def WORLDS() -> tuple[tuple[int, str], ...]:  # noqa: N802
    """(world size, backend): one rank with NCCL, two ranks sharing the GPU with gloo."""
    return ((1, "nccl" if torch.cuda.is_available() else "gloo"), (2, "gloo"))


BF16_TOL = {"loss": (2e-3, 2e-2), "param": (5e-3, 0.0)}


# ---- models ------------------------------------------------------------------------------

def build(name: str, *, dim: int = 64, depth: int = 2, seq: int = 32,
          vocab: int = 256) -> torch.nn.Module:
    """A model whose forward takes token ids and returns the LM loss (seeded: equal in every
    process)."""
    torch.manual_seed(0)
    if name == "gpt":
        return GPTWithLoss(TinyGPT(vocab=vocab, dim=dim, depth=depth, heads=max(1, dim // 64)
                                   if dim >= 256 else 4, max_seq=seq))
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        cfg = LlamaConfig(hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=depth,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                          max_position_embeddings=seq, use_cache=False,
                          attn_implementation="sdpa")
        return HFCausalLMWithLoss(LlamaForCausalLM(cfg))
    raise ValueError(name)


def global_batches(steps: int, batch: int, seq: int, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]


# ---- which gloo collectives take CUDA tensors ----------------------------------------------

def probe_gloo_cuda(rank: int, world: int) -> dict[str, str]:
    """Try each collective osdp-fx uses on CUDA tensors over gloo; 'ok' or the error."""
    dev = _device_for(rank)
    x = torch.full((4 * world,), float(rank + 1), device=dev)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x.clone()),
        "all_reduce async": lambda: dist.all_reduce(x.clone(), async_op=True).wait(),
        "broadcast": lambda: dist.broadcast(x.clone(), src=0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(x.numel() * world, device=dev), x, async_op=True).wait(),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(4, device=dev), x, async_op=True).wait(),
        "all_gather (list)": lambda: dist.all_gather([torch.empty_like(x) for _ in range(world)],
                                                     x),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            _sync()
            out[name] = "ok"
        except Exception as exc:  # reported, not raised: the point is to find out
            out[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    return out


# ---- 1. parity ---------------------------------------------------------------------------

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
            "reserved": torch.cuda.max_memory_reserved}[kind]()


def _plan_arg(plan: str, limits: dict[str, int]) -> dict[str, Any]:
    if plan != "searched":
        return {"plan": plan}
    if not {"replicate", "full_shard"} <= set(limits):
        raise OSDPError("the searched plan's limit needs replicate's and full_shard's predictions")
    low, high = sorted((limits["replicate"], limits["full_shard"]))
    # halfway; at world 1 sharding saves nothing, so at least what the smaller plan needs with
    # the search's safety margin (planner.MEMORY_MARGIN) on top
    return {"plan": None, "memory_limit": max((low + high) // 2, int(low / 0.9))}


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
            compiled = compile_osdp(net, (data[0],), plan=_plan_arg(plan, limits)["plan"],
                                    memory_limit=_plan_arg(plan, limits).get("memory_limit"),
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
        counts: dict[str, int] = {}
        for p in compiled.plan.params:
            counts[str(p.strategy)] = counts.get(str(p.strategy), 0) + 1
        out[plan] = {"losses": losses,
                     "state": {k: v.cpu() for k, v in compiled.full_state_dict().items()},
                     "strategies": counts}
        del compiled, opt
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
        param_diff, param_ok = 0.0, True
        for r in per_rank:
            for key, value in ref["state"].items():
                d = (r["state"][key].float() - value.float()).abs()
                param_diff = max(param_diff, d.max().item())
                param_ok &= bool((d <= pa + pr * value.float().abs()).all())
        rows[plan] = {"ok": loss_ok and param_ok, "loss_diff": loss_diff,
                      "param_diff": param_diff, "strategies": per_rank[0]["strategies"]}
    return rows


def parity(quick: bool) -> list[dict[str, Any]]:
    steps, batch, seq, vocab, lr = 5, 4, 32, 256, 0.05
    rows = []
    worlds = WORLDS()
    for model in ("gpt", "llama"):
        for mp in (None, "bf16"):
            if quick and mp is not None and model == "llama":
                continue
            ref = train_reference(model, mp, steps, batch, seq, vocab, lr)
            for world, backend in worlds:
                results = run_world(world, train_compiled, model, mp, steps, batch, seq, vocab,
                                    lr, backend=backend, timeout_s=900.0,
                                    collective_timeout_s=300.0)
                for plan, row in compare(results, ref, BF16_TOL if mp else FP32_TOL).items():
                    rows.append({"model": model, "precision": mp or "fp32", "world": world,
                                 "backend": backend, "plan": plan, **row})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- 2. and 3. memory and time -----------------------------------------------------------

def measure_plans(rank: int, world: int, dim: int, depth: int, seq: int, batch: int, vocab: int,
                  steps: int) -> list[dict[str, Any]]:
    """Per plan: predicted against measured peak (step 1, steps 2..) and step time."""
    device = _device_for(rank)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    out: list[dict[str, Any]] = []
    limits: dict[str, int] = {}
    for plan in ("replicate", "shard_grad_op", "full_shard", "searched"):
        net = build("gpt", dim=dim, depth=depth, seq=seq, vocab=vocab).to(device)
        args = _plan_arg(plan, limits)
        try:
            compiled = compile_osdp(net, (x,), plan=args["plan"],
                                    memory_limit=args.get("memory_limit"),
                                    mixed_precision="bf16", optimizer="adamw")
        except OSDPError as exc:
            out.append({"plan": plan, "error": str(exc).splitlines()[0]})
            continue
        del net
        pred = compiled.plan.prediction
        limits[plan] = pred.peak_memory_bytes
        opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
        _sync()
        held_before = _allocated("allocated")
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
            reserved.append(_allocated("reserved"))
        counts: dict[str, int] = {}
        for p in compiled.plan.params:
            counts[str(p.strategy)] = counts.get(str(p.strategy), 0) + 1
        out.append({
            "plan": plan, "strategies": counts, "held_before_step1": held_before,
            "predicted_first": pred.first_step_peak_bytes, "measured_first": peaks[0],
            "predicted_steady": pred.peak_memory_bytes, "measured_steady": max(peaks[1:]),
            "reserved_steady": max(reserved[1:]), "predicted_step_s": pred.step_time_s,
            "measured_step_s": statistics.median(times[1:]),
            "limit": args.get("memory_limit"),
        })
        del compiled, opt
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _err(pred: int | None, meas: int) -> float | None:
    return None if not pred or not meas else (pred - meas) / meas


def memory_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| world | plan | strategies | first step pred / meas (MiB) | err | steady pred / "
             "meas (MiB) | err | reserved (MiB) | step pred / meas (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['world']} | {r['plan']} | {r['error']} |||||||")
            continue
        e1, e2 = _err(r["predicted_first"], r["measured_first"]), _err(
            r["predicted_steady"], r["measured_steady"])
        lines.append(
            f"| {r['world']} | {r['plan']} | {r['strategies']} | "
            f"{(r['predicted_first'] or 0) / MiB:.0f} / {r['measured_first'] / MiB:.0f} | "
            f"{'' if e1 is None else f'{e1:+.1%}'} | {r['predicted_steady'] / MiB:.0f} / "
            f"{r['measured_steady'] / MiB:.0f} | {'' if e2 is None else f'{e2:+.1%}'} | {r['reserved_steady'] / MiB:.0f} | "
            f"{r['predicted_step_s'] * 1e3:.1f} / {r['measured_step_s'] * 1e3:.1f} |")
    return "\n".join(lines)


def parity_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | precision | world (backend) | plan | strategies | max loss diff | "
             "max param diff | ok |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['precision']} | {r['world']} ({r['backend']}) | "
                         f"{r['plan']} | {r['error']} | | | no |")
            continue
        lines.append(f"| {r['model']} | {r['precision']} | {r['world']} ({r['backend']}) | "
                     f"{r['plan']} | {r['strategies']} | {r['loss_diff']:.1e} | "
                     f"{r['param_diff']:.1e} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer parity cases, a smaller GPT")
    parser.add_argument("--skip-compare", action="store_true")
    parser.add_argument("--skip-parity", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-steps", type=int, default=5)
    parser.add_argument("--memory-worlds", type=int, nargs="*", default=[1, 2],
                        help="world sizes of the memory and time runs (1: NCCL; 2: gloo)")
    parser.add_argument("--depth", type=int, default=None,
                        help="layers of the memory and time GPT (default 12; 4 with --quick)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--cpu", action="store_true",
                        help="without a GPU: run every step on the CPU (checks the script only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu:
        print("gpu_check: no CUDA device (--cpu: a dry run of the script on the CPU)")
        return 0
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    report: dict[str, Any] = {"device": name, "torch": torch.__version__}
    report["gloo_cuda"] = run_world(2, probe_gloo_cuda, backend="gloo")[0]
    print("gloo collectives on CUDA tensors:", json.dumps(report["gloo_cuda"]), flush=True)
    if not args.skip_parity:
        report["parity"] = parity(args.quick)
    size = dict(dim=128, depth=2, seq=64, batch=2, vocab=512) if args.cpu else dict(
        dim=512, depth=4, seq=512, batch=4, vocab=8192) if args.quick else dict(
        dim=1024, depth=12, seq=1024, batch=4, vocab=8192)
    if args.depth:
        size["depth"] = args.depth
    report["memory_config"] = size
    mem_rows = []
    for world, backend in () if args.skip_memory else WORLDS():
        if world not in args.memory_worlds:
            continue
        rows = run_world(world, measure_plans, *size.values(), args.memory_steps,
                         backend=backend, timeout_s=1200.0, collective_timeout_s=600.0)[0]
        for r in rows:
            r["world"] = world
            print(json.dumps(r), flush=True)
        mem_rows += rows
    report["memory"] = mem_rows
    if not args.skip_compare:
        import compare as compare_bench

        report["compare"] = compare_bench.main(
            ["--world-size", "1", "--dim", "1024", "--depth", "12", "--heads", "16", "--seq", "1024",
             "--batch", "4", "--vocab", "8192", "--steps", "6", "--limits", "1", "--no-plot",
             "--out-dir", str(args.out_dir)])
    text = [f"# osdp-fx on {name} (torch {torch.__version__})", "",
            "gloo collectives on CUDA tensors (2 ranks sharing the GPU): " +
            ", ".join(f"{k}: {v}" for k, v in report["gloo_cuda"].items()), ""]
    if "parity" in report:
        text += ["## Parity against single-process CUDA training (5 SGD steps)", "",
                 parity_table(report["parity"]), ""]
    text += [f"## Memory and step time: GPT {size}, bf16 compute, AdamW", "",
             memory_table(mem_rows), ""]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "gpu-check.md").write_text("\n".join(text))
    (args.out_dir / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str))
    print("\n".join(text), flush=True)
    failed = [r for r in report.get("parity", []) if not r["ok"]]
    off = [r for r in mem_rows if "error" not in r and torch.cuda.is_available()
           and abs(_err(r["predicted_steady"], r["measured_steady"]) or 0) > 0.10]
    print(f"parity failures: {len(failed)}; plans whose steady peak is off by > 10 %: {len(off)}")
    return 1 if failed or off else 0


if __name__ == "__main__":
    sys.exit(main())

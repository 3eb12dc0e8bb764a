"""The OSDP paper's setting, simulated: what the planner predicts for GPT-2 with 48 layers on
8 GPUs of 24 GB on PCIe 3.0 with memory capped at 8 GiB.

The OSDP reference implementation reported, for GPT-2 with 48 layers and hidden size 2048 at an
8 GB cap, 192.3 samples/s for its searched plan against 158.0 for FSDP (1.22x) (its README,
``seeds/osdp-readme.txt``; sequence length, precision and batch size are not stated there).
This script describes that hardware with :class:`osdp_fx.Devices` (nothing is measured: the
model is built on the meta device and profiled under FakeTensorMode, compute time by roofline),
searches the plan and the per-rank batch size with the largest predicted throughput, and prints
it against all-replicate (DDP) and all-full_shard (FSDP), each at its own best batch size.

    python benchmarks/paper_setting.py [--seq 1024] [--precision fp16] [--batch-sizes 1,2,4,8]
        [--depth 48]

The hardware figures (the Devices below) are assumptions, stated so they can be changed:
PCIe 3.0 x16 gives a ring ~10 GB/s of bus bandwidth, a 24 GB GPU of that generation (RTX TITAN
/ 3090 class) ~35 TFLOP/s achieved in fp16 and ~900 GB/s of memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from osdp_fx.core.devices import Devices  # noqa: E402
from osdp_fx.core.precision import resolve_mixed_precision  # noqa: E402
from osdp_fx.core.setting import StepSetting  # noqa: E402
from osdp_fx.examples import GPTWithLoss, TinyGPT  # noqa: E402
from osdp_fx.passes.capture import capture  # noqa: E402
from osdp_fx.plan.request import resolve_plan  # noqa: E402
from osdp_fx.planner.make import SearchOptions, param_specs, plan_model, predict  # noqa: E402
from osdp_fx.units import format_bytes  # noqa: E402

GiB = 2**30
PAPER = {"osdp_samples_per_s": 192.2572615622423, "fsdp_samples_per_s": 158.0486313692509}

PAPER_DEVICES = Devices(
    world_size=8, ranks_per_node=8, memory_bytes=8 * GiB,
    compute_flops_per_s=35e12, memory_bandwidth_bytes_per_s=900e9,
    intra_node_bandwidth_bytes_per_s=10e9, intra_node_latency_s=20e-6,
)


def build(seq: int, batch: int, depth: int = 48) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    with torch.device("meta"):
        model = GPTWithLoss(TinyGPT(vocab=50257, dim=2048, depth=depth, heads=16, max_seq=seq))
    return model, (torch.randint(0, 50257, (batch, seq), device="meta"),)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--depth", type=int, default=48, help="layers (48 in the paper)")
    args = parser.parse_args(argv)
    precision = None if args.precision == "fp32" else resolve_mixed_precision(args.precision)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    devices = PAPER_DEVICES
    start = time.perf_counter()
    model, inputs = build(args.seq, 1, args.depth)
    captured = capture(model, inputs)
    setting = StepSetting(devices, optimizer="adamw", precision=precision)
    planned = plan_model(captured, inputs, None, setting,
                         SearchOptions(fake=True, batch_sizes=tuple(batch_sizes)))
    plan, analysis = planned.plan, planned.analysis
    rows = [("searched (osdp-fx)", plan)]
    for name, label in (("replicate", "all replicate (DDP)"), ("full_shard", "all full_shard (FSDP)")):
        uniform = resolve_plan(name, param_specs(captured), world_size=devices.world_size)
        best = None
        for b in batch_sizes:  # its own best batch size that fits
            p = predict(analysis, uniform, setting.at_batch(b))
            if p.peak_memory_bytes <= devices.memory_bytes and (
                    best is None or b / p.step_time_s > best[0]):
                best = (b / p.step_time_s, p)
        rows.append((label, best[1] if best else None))
    elapsed = time.perf_counter() - start
    print(f"GPT-2 {args.depth} layers, hidden 2048, vocab 50257, sequence {args.seq}, {args.precision}, "
          f"AdamW; {devices.world_size} GPUs, {format_bytes(devices.memory_bytes)} each, "
          f"PCIe 3.0 ring {devices.intra_node_bandwidth_bytes_per_s / 1e9:.0f} GB/s")
    print(f"{'plan':28} {'batch/rank':>10} {'step s':>8} {'samples/s':>10} {'peak':>10}")
    out = {"seq": args.seq, "precision": args.precision, "rows": {}}
    for label, p in rows:
        if p is None:
            print(f"{label:28} {'does not fit at any batch size':>40}")
            out["rows"][label] = None
            continue
        pr = p.prediction
        sps = pr.batch_size * devices.world_size / pr.step_time_s
        print(f"{label:28} {pr.batch_size:>10} {pr.step_time_s:>8.3f} {sps:>10.1f} "
              f"{format_bytes(pr.peak_memory_bytes):>10}")
        out["rows"][label] = {"batch": pr.batch_size, "step_s": pr.step_time_s,
                              "samples_per_s": sps, "peak_bytes": pr.peak_memory_bytes}
    s, f = out["rows"]["searched (osdp-fx)"], out["rows"]["all full_shard (FSDP)"]
    if s and f:
        out["searched_over_fsdp"] = s["samples_per_s"] / f["samples_per_s"]
        print(f"searched / FSDP: {out['searched_over_fsdp']:.2f}x predicted "
              f"(paper, measured: {PAPER['osdp_samples_per_s']:.1f} / "
              f"{PAPER['fsdp_samples_per_s']:.1f} = "
              f"{PAPER['osdp_samples_per_s'] / PAPER['fsdp_samples_per_s']:.2f}x)")
    print(f"counts: {plan.counts()}; splits: {len(plan.splits)}; planned in {elapsed:.1f} s")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

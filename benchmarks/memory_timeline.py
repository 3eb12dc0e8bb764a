"""The predicted memory of a step against the memory a live-storage tracker measures.

Starts a local world (gloo on CPU), compiles a model under each plan asked for, trains a few
steps with AdamW, and measures every step with ``storage_tracker.StorageTracker`` (written apart
from osdp-fx: every storage the process holds, at its current size, from the first step, no
garbage collection for the user). For each plan it prints the predicted and measured peaks of the
first step and of a steady-state step, and draws the prediction stacked by category with the
measured curve of the steady-state step on top (the measured forward, backward and optimizer
phases are spread over the prediction's forward, backward and optimizer spans).

    python benchmarks/memory_timeline.py [--model gpt|llama] [--plans full_shard,replicate,searched]
        [--limit 150MiB] [--world-size 2] [--steps 4] [--out-dir benchmarks/results]

Default model: the GPT of ``compare.py`` (vocab 2048, dim 512, depth 4, sequence 32, batch 4 per
rank). Writes ``memory-timeline-<model>-<plan>.png`` and a Markdown table to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from osdp_fx import Devices, compile_osdp  # noqa: E402
from osdp_fx.examples import GPTWithLoss, HFCausalLMWithLoss, TinyGPT  # noqa: E402
from osdp_fx.plan.plot import phase_positions, plot_memory_timeline  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402
from osdp_fx.runtime.storage_tracker import StorageTracker  # noqa: E402
from osdp_fx.units import format_bytes, parse_bytes  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"


def build(model: str) -> tuple[nn.Module, int, int]:
    """(model returning its loss, vocabulary, sequence length)."""
    torch.manual_seed(0)
    if model == "gpt":
        return GPTWithLoss(TinyGPT(vocab=2048, dim=512, depth=4, heads=8, max_seq=32)), 2048, 32
    if model == "tiny":  # for smoke tests of the benchmarks
        return GPTWithLoss(TinyGPT(vocab=256, dim=64, depth=2, heads=4, max_seq=16)), 256, 16
    if model == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                          max_position_embeddings=64)
        return HFCausalLMWithLoss(LlamaForCausalLM(cfg)), 2048, 64
    raise ValueError(f"unknown model {model!r}: gpt, llama or tiny")


def measure(rank: int, world: int, model_name: str, plan: str, limit: int | None,
            steps: int) -> dict[str, Any]:
    model, vocab, seq = build(model_name)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randint(0, vocab, (4, seq), generator=gen)
    compiled = compile_osdp(model, (x,), Devices(world_size=world),
                            plan=None if plan == "searched" else plan, memory_limit=limit)
    del model
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
    runs = []
    for _ in range(steps):
        tracker = StorageTracker(record=True)
        with tracker:
            tracker.phase("forward")
            loss = compiled(x)
            tracker.phase("backward")
            loss.backward()
            tracker.phase("optimizer")
            opt.step()
            opt.zero_grad()
            del loss
        runs.append({"peak": tracker.peak_bytes, "samples": tracker.samples})
    return {"plan": compiled.plan, "runs": runs}


def on_timeline(samples: list[tuple[int, int, str]], n_nodes: int) -> list[tuple[float, int]]:
    """The tracker's samples placed on the prediction's time axis, phase by phase."""
    counts: dict[str, int] = {}
    for _, _, phase in samples:
        counts[phase] = counts.get(phase, 0) + 1
    where = phase_positions(counts, n_nodes)
    seen: dict[str, int] = {}
    out = []
    for _, live, phase in samples:
        if phase not in where:
            continue
        start, width = where[phase]
        out.append((start + width * seen.get(phase, 0), live))
        seen[phase] = seen.get(phase, 0) + 1
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt", choices=["gpt", "llama", "tiny"])
    parser.add_argument("--plans", default="replicate,shard_grad_op,full_shard,searched")
    parser.add_argument("--limit", default="150MiB",
                        help="memory limit per rank for the searched plan")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for plan in args.plans.split(","):
        limit = parse_bytes(args.limit) if plan == "searched" else None
        result = run_world(args.world_size, measure, args.model, plan, limit, args.steps,
                           timeout_s=1800.0)[0]
        compiled_plan, runs = result["plan"], result["runs"]
        pr = compiled_plan.prediction
        n_nodes = int((max(p.t for p in pr.memory_timeline) - 1) // 2)
        label = plan if limit is None else f"searched @ {format_bytes(limit)}"
        path = plot_memory_timeline(
            compiled_plan, out_dir / f"memory-timeline-{args.model}-{plan}.png",
            measured=on_timeline(runs[-1]["samples"], n_nodes),
            measured_label="measured (storage tracker, steady step)",
            title=f"{args.model}, {label}, world {args.world_size}: predicted (stacked) and "
                  f"measured memory of rank 0")
        rows.append({
            "plan": label, "counts": compiled_plan.counts(),
            "first_predicted": pr.first_step_peak_bytes, "first_measured": runs[0]["peak"],
            "steady_predicted": pr.peak_memory_bytes, "steady_measured": runs[-1]["peak"],
            "limit": limit, "plot": path, "breakdown": pr.breakdown(),
        })
    lines = ["| plan | first step: predicted | measured | error | steady: predicted | measured "
             "| error | limit |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['plan']} | {format_bytes(r['first_predicted'])} | "
            f"{format_bytes(r['first_measured'])} | "
            f"{r['first_measured'] / r['first_predicted'] - 1:+.1%} | "
            f"{format_bytes(r['steady_predicted'])} | {format_bytes(r['steady_measured'])} | "
            f"{r['steady_measured'] / r['steady_predicted'] - 1:+.1%} | "
            f"{format_bytes(r['limit']) if r['limit'] else '-'} |")
    table = "\n".join(lines)
    print(table)
    for r in rows:
        print(f"{r['plan']}: peak by category {r['breakdown']}; plot {r['plot']}")
    (out_dir / f"memory-timeline-{args.model}.md").write_text(table + "\n")
    return rows


if __name__ == "__main__":
    main()

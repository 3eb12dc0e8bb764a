"""A LoRA fine-tune: osdp-fx against FSDP2 and DDP (issue 39).

Starts one local world (gloo on CPU; ``compare.start_world``) and builds, one after the other in
that world, on one model: peft's LoRA (``LoraConfig(r=16)`` on the attention projections
q, k, v, o) on a Hugging Face ``LlamaForCausalLM`` built from a config with random weights
(default hidden 512, intermediate 1408, 8 layers, 8 heads, vocab 2048), whose frozen float32
base is about 98 % of the parameter bytes; each system trains the adapters with AdamW on its
rank's batch (default 2 sequences of 64 tokens), the loss being the model's own (``labels``):

- DDP: ``DistributedDataParallel`` over the peft model (it reduces the adapters' gradients
  alone; the base is replicated);
- FSDP2: ``fully_shard`` on every decoder layer, then on the root, over
  ``init_device_mesh("cpu", (world,))``: the frozen base sharded like the adapters, gathered
  and never reduced;
- osdp-fx ``full_shard`` as named (one all-gather per decoder layer, frozen weights and
  adapters together, as FSDP2); ``full_shard`` with each all-gather started 3 ahead
  (``prefetch=3``; the default is 1); ``full_shard`` with gather buckets of 64 KiB (a plan
  file: small parameters share a collective, every other is gathered alone: the least memory,
  the most collectives); ``replicate``; and the searched plan at a limit of ``--limit-over``
  (1.1) x FSDP2's measured peak.

Every osdp-fx system compiles with one ``detect_devices()`` measured at the start
(``--no-detect``: the ``Devices()`` defaults).

Peak memory: each system's first ``--peak-steps`` steps (forward, backward, AdamW step, from step
1), each measured by ``osdp_fx/runtime/storage_tracker.py`` (independent of osdp-fx): what the
system holds at the step's start (every storage the process holds that it did not hold before
the system was built) plus what the step adds at its peak; the largest step of the largest rank
(``recompute.World``). Step time: every system timed round-robin, ``--warmup`` steps of each then
``--rounds`` rounds of one step of every system, the order rotated each round, a barrier before
each step; a step's time is the slowest rank's, the median is shown.

    python benchmarks/finetune.py [--world-size 2] [--dim 512] [--intermediate 1408]
        [--depth 8] [--heads 8] [--vocab 2048] [--seq 64] [--batch 2] [--rank 16]
        [--rounds 8] [--warmup 1] [--peak-steps 3] [--limit-over 1.1] [--no-detect]
        [--out-dir benchmarks/results] [--quick]

``--quick``: hidden 64, 2 layers, vocab 128, sequence 16, 1 round, 2 peak steps, no detection:
checks that it runs (no figures).

Targets (issue 39): osdp-fx ``full_shard`` <= 1.0x FSDP2 in step time and peak; the searched
plan at 1.1x FSDP2's measured peak fits (measured) and steps in <= 0.85x FSDP2's time. Prints a
Markdown table and, last, one JSON line with the checks; writes ``finetune-world{N}.md`` and
``.json`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from compare import Config, _mib, start_world  # noqa: E402
from recompute import World, _ms, parse_args  # noqa: E402

from osdp_fx import compile_osdp  # noqa: E402
from osdp_fx.examples import HFCausalLMWithLoss  # noqa: E402
from osdp_fx.units import format_bytes  # noqa: E402

MiB = 2**20

DDP, FSDP2, FULL_SHARD, REPLICATE, SEARCHED = "ddp", "fsdp2", "full_shard", "replicate", "searched"
SMALL, PREFETCH3 = "full_shard_small", "full_shard_prefetch3"
LABELS = {
    DDP: ("DDP", "DistributedDataParallel (the adapters' gradients reduced, the base replicated)"),
    FSDP2: ("FSDP2", "fully_shard per decoder layer + root (frozen base sharded)"),
    FULL_SHARD: ("osdp-fx", "full_shard (one all-gather per layer)"),
    PREFETCH3: ("osdp-fx", "full_shard, prefetch 3"),
    SMALL: ("osdp-fx", "full_shard, 64 KiB gather buckets"),
    REPLICATE: ("osdp-fx", "replicate"),
    SEARCHED: ("osdp-fx", "searched @ limit"),
}
MODEL = {"vocab": 2048, "dim": 512, "intermediate": 1408, "depth": 8, "heads": 8, "seq": 64,
         "batch": 2, "rank": 16}
MEASURE = {"rounds": 8, "warmup": 1, "peak_steps": 3, "limit_over": 1.1}
QUICK = {"vocab": 128, "dim": 64, "intermediate": 128, "depth": 2, "heads": 2, "seq": 16,
         "rank": 4, "rounds": 1, "peak_steps": 2, "detect": False}


def build_lora(opts: argparse.Namespace, device: torch.device) -> HFCausalLMWithLoss:
    """peft's LoRA on a random-weight Llama, its forward returning the LM loss."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=opts.dim, intermediate_size=opts.intermediate,
                      num_hidden_layers=opts.depth, num_attention_heads=opts.heads,
                      num_key_value_heads=opts.heads, vocab_size=opts.vocab,
                      max_position_embeddings=opts.seq, use_cache=False)
    lora = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(
        r=opts.rank, lora_alpha=2 * opts.rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return HFCausalLMWithLoss(lora).to(device)


def decoder_layers(model: HFCausalLMWithLoss) -> torch.nn.ModuleList:
    return model.model.base_model.model.model.layers


Make = Callable[[torch.Tensor], tuple[torch.nn.Module, dict]]


class FinetuneWorld(World):
    """The fine-tune's systems of one rank (``recompute.World`` measures them)."""

    def ddp(self) -> Make:
        def make(x: torch.Tensor) -> tuple[torch.nn.Module, dict]:
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(build_lora(self.opts, self.device)), {}
        return make

    def fsdp2(self) -> Make:
        def make(x: torch.Tensor) -> tuple[torch.nn.Module, dict]:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = build_lora(self.opts, self.device)
            mesh = init_device_mesh(self.device.type, (self.world,))
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            return model, {}
        return make

    def osdp(self, plan: str | None, limit: int | None = None,  # type: ignore[override]
             prefetch: int | None = None) -> Make:
        def make(x: torch.Tensor) -> tuple[torch.nn.Module, dict]:
            model = build_lora(self.opts, self.device)
            start = time.perf_counter()
            compiled = compile_osdp(model, (x,), self.devices, plan=plan, memory_limit=limit,
                                    optimizer="adamw", prefetch=prefetch)
            compile_s = time.perf_counter() - start
            del model
            p = compiled.plan
            pr = p.prediction
            assert pr is not None and pr.first_step_peak_bytes is not None
            frozen = sum(q.shard_bytes(self.world) for q in p.params if not q.trainable)
            return compiled, {
                "plan_counts": p.counts(), "schedule": str(p.schedule), "hash": p.hash(),
                "recompute": dict(p.recompute), "recomputed": {}, "compile_s": compile_s,
                "frozen_bytes_per_rank": frozen,
                "predicted_step_s": pr.step_time_s,
                "predicted_peak_bytes_per_step": [pr.first_step_peak_bytes]
                + [pr.peak_memory_bytes] * (self.opts.peak_steps - 1),
            }
        return make


def small_buckets_plan(directory: str) -> str:
    """A plan file in ``directory``: every group full_shard, gather buckets of 64 KiB (small
    parameters share a collective, every other is gathered alone)."""
    path = Path(directory) / "small-buckets.json"
    path.write_text(json.dumps({
        "format": "osdp-fx-plan", "version": 1, "default": "full_shard", "params": {},
        "gather_bucket_bytes": 65536}))
    return str(path)


def measure(rank: int, world: int, device: torch.device, cfg: Config,
            opts: argparse.Namespace) -> dict[str, Any]:
    """Every system on this rank; the rows (identical on every rank) come back from rank 0."""
    w = FinetuneWorld(rank, world, device, cfg, opts, LABELS)
    w.add(FSDP2, w.fsdp2())
    limit = int(opts.limit_over * w.rows[FSDP2]["peak_bytes"])
    w.add(DDP, w.ddp())
    w.add(FULL_SHARD, w.osdp("full_shard"))
    w.add(PREFETCH3, w.osdp("full_shard", prefetch=3))
    with tempfile.TemporaryDirectory(prefix="osdp-finetune-") as directory:
        w.add(SMALL, w.osdp(small_buckets_plan(directory)))  # compiled (the file read) here
    w.add(REPLICATE, w.osdp("replicate"))
    w.add(SEARCHED, w.osdp(None, limit), limit)
    rows = w.timed_rows()
    params = build_lora(opts, torch.device("meta")).parameters()
    sizes = [(p.numel() * p.element_size(), p.requires_grad) for p in params]
    return {"rows": rows, "limit": limit, "timings_s": w.timings_s,
            "model_bytes": sum(b for b, _ in sizes),
            "adapter_bytes": sum(b for b, trainable in sizes if trainable),
            "backend": dist.get_backend(), "device": str(device)}


# ---- reporting ----------------------------------------------------------------------------

def table(rows: list[dict[str, Any]]) -> str:
    head = ("| system | plan | measured step ms | predicted step ms | measured peak MiB | "
            "predicted peak MiB | peak error | limit MiB | fits |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in rows:
        limit = _mib(r.get("limit_bytes")) if r.get("limit_bytes") else "-"
        if "error" in r:
            lines.append(f"| {r['system']} | {r['plan']} | no plan fits (PlanError) | - | - | "
                         f"- | - | {limit} | no |")
            continue
        plan = r["plan"]
        if r.get("plan_counts") and r["key"] == SEARCHED:
            counts = ", ".join(f"{s} {n}" for s, n in r["plan_counts"].items() if n)
            plan += f" ({counts}; {r['schedule']})"
        error = f"{r['peak_error']:+.1%}" if "peak_error" in r else "-"
        fits = {None: "-", True: "yes", False: "NO"}[r["fits"]]
        lines.append(
            f"| {r['system']} | {plan} | {_ms(r.get('step_s'))} | "
            f"{_ms(r.get('predicted_step_s'))} | {_mib(r['peak_bytes'])} | "
            f"{_mib(r.get('predicted_peak_bytes'))} | {error} | {limit} | {fits} |")
    return "\n".join(lines)


def checks(rows: list[dict[str, Any]], limit: int, world: int) -> dict[str, Any]:
    """The issue's targets, with the ratios they rest on (None where a system has no time)."""
    by = {r["key"]: r for r in rows}

    def ratio(a: str, b: str, what: str) -> float | None:
        x, y = by[a].get(what), by[b].get(what)
        return round(x / y, 3) if x and y else None

    out: dict[str, Any] = {
        "world_size": world, "limit_mib": round(limit / MiB, 2),
        "full_shard_over_fsdp2_step": ratio(FULL_SHARD, FSDP2, "step_s"),
        "full_shard_over_fsdp2_peak": ratio(FULL_SHARD, FSDP2, "peak_bytes"),
        "full_shard_prefetch3_over_fsdp2_step": ratio(PREFETCH3, FSDP2, "step_s"),
        "full_shard_small_over_fsdp2_step": ratio(SMALL, FSDP2, "step_s"),
        "searched_fits": by[SEARCHED].get("fits") is True,
        "searched_over_fsdp2_step": ratio(SEARCHED, FSDP2, "step_s"),
        "replicate_over_ddp_step": ratio(REPLICATE, DDP, "step_s"),
        "peak_errors": {r["key"]: round(r["peak_error"], 4) for r in rows if "peak_error" in r},
    }
    step, peak = out["full_shard_over_fsdp2_step"], out["full_shard_over_fsdp2_peak"]
    searched = out["searched_over_fsdp2_step"]
    out["targets_met"] = {
        "full_shard <= 1.0x FSDP2 step": step is not None and step <= 1.0,
        "full_shard <= 1.0x FSDP2 peak": peak is not None and peak <= 1.0,
        "searched fits 1.1x FSDP2's peak": out["searched_fits"],
        "searched <= 0.85x FSDP2 step": searched is not None and searched <= 0.85,
    }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, __doc__, {**MODEL, **MEASURE}, QUICK)
    cfg = Config(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads,
                 seq=args.seq, batch=args.batch, steps=args.rounds, warmup=args.warmup)
    opts = argparse.Namespace(**{n: getattr(args, n) for n in (*MODEL, *MEASURE, "detect")})
    world = args.world_size
    wall = time.perf_counter()
    load_before = os.getloadavg()[0]
    result = start_world(world, measure, cfg, opts)[0]
    load_after = os.getloadavg()[0]
    rows, limit = result["rows"], result["limit"]
    title = (f"world {world} ({result['backend']}, {result['device']}): peft LoRA r={args.rank} "
             f"(q, k, v, o) on a Llama of hidden {args.dim}, intermediate {args.intermediate}, "
             f"{args.depth} layers, {args.heads} heads, vocab {args.vocab}, float32; sequence "
             f"{args.seq}, batch {args.batch}/rank, AdamW"
             + (" (--quick: no figures)" if args.quick else ""))
    text = table(rows)
    out = checks(rows, limit, world)
    out["wall_s"] = round(time.perf_counter() - wall, 1)
    out["load_avg_before_after"] = [round(load_before, 2), round(load_after, 2)]
    notes = [
        f"Parameters: {format_bytes(result['model_bytes'])}, of them "
        f"{format_bytes(result['adapter_bytes'])} of adapters (trainable); the rest is the "
        "frozen base.",
        f"Limit of the search: {args.limit_over} x FSDP2's measured peak = "
        f"{format_bytes(limit)}.",
        f"Step: median of {args.rounds} round-robin rounds after {args.warmup} warm-up step(s) "
        "of each system (a barrier before each step; a step's time is the slowest rank's).",
        f"Peak: the largest of the first {args.peak_steps} steps (from step 1) and of the ranks, "
        "measured by osdp_fx/runtime/storage_tracker.py; predicted: step 1's prediction for "
        "step 1, the steady one after; error: the worst step's (measured / predicted - 1).",
        f"Machine: {os.cpu_count()} cores, 1-min load average "
        f"{out['load_avg_before_after'][0]} before and {out['load_avg_before_after'][1]} after.",
        "Wall time (rank 0; a system's includes its build or compile and peak steps): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in result["timings_s"].items()) + ".",
        *(f"{LABELS[r['key']][1]}: {r['error']}" for r in rows if "error" in r),
    ]
    report = "\n".join([f"# A LoRA fine-tune vs FSDP2 and DDP: {title}", "", text, "",
                        *(f"- {n}" for n in notes), "", "```json", json.dumps(out), "```", ""])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"finetune-world{world}.md").write_text(report)
    raw = {"config": {**dataclasses.asdict(cfg), **vars(opts)}, "world_size": world,
           "backend": result["backend"], "device": result["device"], "limit_bytes": limit,
           "rows": rows, "checks": out, "timings_s": result["timings_s"]}
    (args.out_dir / f"finetune-world{world}.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(title, "", text, "", *(f"- {n}" for n in notes), sep="\n")
    print(json.dumps(out), flush=True)
    return raw


if __name__ == "__main__":
    main()

"""A LoRA fine-tune: osdp-fx against FSDP2 and DDP (issue 39); QLoRA against FSDP2 (issue 59).

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
        [--out-dir benchmarks/results] [--quick] [--qlora]

``--quick``: hidden 64, 2 layers, vocab 128, sequence 16, 1 round, 2 peak steps, no detection:
checks that it runs (no figures).

Targets (issue 39): osdp-fx ``full_shard`` <= 1.0x FSDP2 in step time and peak; the searched
plan at 1.1x FSDP2's measured peak fits (measured) and steps in <= 0.85x FSDP2's time. Prints a
Markdown table and, last, one JSON line with the checks; writes ``finetune-world{N}.md`` and
``.json`` to ``--out-dir``.

``--qlora`` (issue 59): the same Llama and LoRA on a 4-bit base, loaded as QLoRA loads it
(``examples/finetune_qlora.py``): the random-weight Llama is saved to a temporary directory and
each system loads it back with ``from_pretrained(..., dtype=bfloat16,
quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_compute_dtype=bfloat16))``: every linear of the decoder layers a bitsandbytes
``Linear4bit`` (nf4, a float32 scale per 64 weights), the embedding, norms and head frozen in
bfloat16, peft's adapters float32 (as peft makes them). Measured the same way, in one world:

- FSDP2 as QLoRA users run it (the bitsandbytes / Hugging Face FSDP-QLoRA recipe, which
  accelerate's FSDP2 path follows): the base loaded with ``bnb_4bit_quant_storage=bfloat16``,
  then ``fully_shard`` on every decoder layer and on the root, with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``. This runs as it is on
  the CPU with gloo (torch 2.13, bitsandbytes 0.50; nothing failed): ``fully_shard`` makes each
  ``Params4bit`` a DTensor, sharded, gathered packed and never reduced like any frozen weight,
  and ``Linear4bit`` takes its quantization state back from the module in forward (the first
  step's loss and adapter gradients equal the unsharded model's). The storage dtype is the
  recipe's: accelerate leaves a uint8-stored ``Params4bit`` out of ``fully_shard``
  (``ignored_params``: replicated), warning that its quantization state would not survive, and
  asks for a floating storage. The packed bytes are the same either way. The scales are an
  attribute of the weight, not a parameter: FSDP2 keeps them whole on every rank. Not done here
  (as in the LoRA row): accelerate's extra units for the embedding and for the final norm with
  the head.
- osdp-fx ``full_shard`` and the searched plan at ``--limit-over`` x FSDP2's measured peak, with
  ``mixed_precision="bf16"`` (floating weights gathered and computed in bfloat16, gradients
  reduced in float32, as the FSDP2 row), on the same base (the same bfloat16 storage: osdp-fx
  reads its bytes as the packed uint8 they are). Capture turns each ``Linear4bit`` into an
  ``BnbLinear4bit`` whose packed weight and scales are frozen parameters, sharded and gathered
  packed, a linear's tensors in one all-gather.

No DDP row. The checks: ``full_shard`` <= 1.0x FSDP2's peak and the searched plan fits (the step
ratios are reported). Writes ``finetune-qlora-world{N}.md`` and ``.json``. Needs
bitsandbytes (``pip install -e ".[hf]"``):

    python benchmarks/finetune.py --qlora [--quick] [the options above]
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
QLORA_LABELS = {
    FSDP2: ("FSDP2", "fully_shard per decoder layer + root, bf16 storage and compute"),
    FULL_SHARD: ("osdp-fx", "full_shard, bf16 compute"),
    SEARCHED: ("osdp-fx", "searched @ limit, bf16 compute"),
}
MODEL = {"vocab": 2048, "dim": 512, "intermediate": 1408, "depth": 8, "heads": 8, "seq": 64,
         "batch": 2, "rank": 16}
MEASURE = {"rounds": 8, "warmup": 1, "peak_steps": 3, "limit_over": 1.1}
QUICK = {"vocab": 128, "dim": 64, "intermediate": 128, "depth": 2, "heads": 2, "seq": 16,
         "rank": 4, "rounds": 1, "peak_steps": 2, "detect": False}


def quiet_transformers() -> None:
    """No warnings or progress bars from transformers."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def random_llama(opts: argparse.Namespace) -> torch.nn.Module:
    """The random-weight Llama (seed 0, float32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=opts.dim, intermediate_size=opts.intermediate, num_hidden_layers=opts.depth,
        num_attention_heads=opts.heads, num_key_value_heads=opts.heads, vocab_size=opts.vocab,
        max_position_embeddings=opts.seq, use_cache=False))


def with_lora(model: torch.nn.Module, opts: argparse.Namespace) -> HFCausalLMWithLoss:
    """peft's LoRA on ``model`` (q, k, v, o), its forward returning the LM loss."""
    from peft import LoraConfig, get_peft_model

    return HFCausalLMWithLoss(get_peft_model(model, LoraConfig(
        r=opts.rank, lora_alpha=2 * opts.rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])))


def build_lora(opts: argparse.Namespace, device: torch.device) -> HFCausalLMWithLoss:
    """peft's LoRA on the random-weight Llama, its forward returning the LM loss."""
    return with_lora(random_llama(opts), opts).to(device)


def build_qlora(opts: argparse.Namespace, device: torch.device) -> HFCausalLMWithLoss:
    """peft's LoRA on the Llama saved in ``opts.checkpoint``, loaded in 4-bit as the FSDP-QLoRA
    recipe loads it (nf4, bfloat16 weights and compute, the packed weights stored as
    bfloat16), in train mode, its forward returning the LM loss."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quiet_transformers()
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16,
                                      bnb_4bit_quant_storage=torch.bfloat16)
    base = LlamaForCausalLM.from_pretrained(opts.checkpoint, quantization_config=quantization,
                                            dtype=torch.bfloat16, use_cache=False,
                                            device_map={"": device})
    torch.manual_seed(0)  # the same adapters on every rank
    return with_lora(base, opts).train()  # from_pretrained returns it in eval mode


def build(opts: argparse.Namespace, device: torch.device) -> HFCausalLMWithLoss:
    """The model osdp-fx compiles: QLoRA's (``--qlora``) or LoRA's."""
    return build_qlora(opts, device) if opts.qlora else build_lora(opts, device)


def parameter_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the parameters (a 4-bit weight's packed bytes and its scales) and of the
    trainable ones."""
    total = trainable = 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        state = getattr(p, "quant_state", None)  # a bitsandbytes Params4bit's
        if state is not None:
            size += state.absmax.nbytes + (state.state2.absmax.nbytes if state.nested else 0)
        total += size
        trainable += size if p.requires_grad else 0
    return total, trainable


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
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            if self.opts.qlora:  # the FSDP-QLoRA recipe: 4-bit weights stored as bf16
                model = build_qlora(self.opts, self.device)
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                              reduce_dtype=torch.float32)
            else:
                model, policy = build_lora(self.opts, self.device), MixedPrecisionPolicy()
            mesh = init_device_mesh(self.device.type, (self.world,))
            for layer in decoder_layers(model):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            return model, {}
        return make

    def osdp(self, plan: str | None, limit: int | None = None,  # type: ignore[override]
             prefetch: int | None = None) -> Make:
        def make(x: torch.Tensor) -> tuple[torch.nn.Module, dict]:
            model = build(self.opts, self.device)
            start = time.perf_counter()
            compiled = compile_osdp(model, (x,), self.devices, plan=plan, memory_limit=limit,
                                    optimizer="adamw", prefetch=prefetch,
                                    mixed_precision="bf16" if self.opts.qlora else None)
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
    w = FinetuneWorld(rank, world, device, cfg, opts, QLORA_LABELS if opts.qlora else LABELS)
    w.add(FSDP2, w.fsdp2())
    limit = int(opts.limit_over * w.rows[FSDP2]["peak_bytes"])
    if opts.qlora:
        w.add(FULL_SHARD, w.osdp("full_shard"))
    else:
        w.add(DDP, w.ddp())
        w.add(FULL_SHARD, w.osdp("full_shard"))
        w.add(PREFETCH3, w.osdp("full_shard", prefetch=3))
        with tempfile.TemporaryDirectory(prefix="osdp-finetune-") as directory:
            w.add(SMALL, w.osdp(small_buckets_plan(directory)))  # compiled (the file read) here
        w.add(REPLICATE, w.osdp("replicate"))
    w.add(SEARCHED, w.osdp(None, limit), limit)
    rows = w.timed_rows()
    model_bytes, adapter_bytes = parameter_bytes(
        build_qlora(opts, device) if opts.qlora else build_lora(opts, torch.device("meta")))
    return {"rows": rows, "limit": limit, "timings_s": w.timings_s,
            "model_bytes": model_bytes, "adapter_bytes": adapter_bytes,
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


def checks(rows: list[dict[str, Any]], limit: int, world: int, limit_over: float = 1.1,
           qlora: bool = False) -> dict[str, Any]:
    """The issue's targets, with the ratios they rest on (None where a system has no time);
    ``qlora``: the QLoRA rows' (issue 59: the peak and the fit; the step ratios reported)."""
    by = {r["key"]: r for r in rows}

    def ratio(a: str, b: str, what: str) -> float | None:
        x, y = by[a].get(what), by[b].get(what)
        return round(x / y, 3) if x and y else None

    out: dict[str, Any] = {
        "world_size": world, "limit_mib": round(limit / MiB, 2),
        "full_shard_over_fsdp2_step": ratio(FULL_SHARD, FSDP2, "step_s"),
        "full_shard_over_fsdp2_peak": ratio(FULL_SHARD, FSDP2, "peak_bytes"),
        "searched_fits": by[SEARCHED].get("fits") is True,
        "searched_over_fsdp2_step": ratio(SEARCHED, FSDP2, "step_s"),
        "peak_errors": {r["key"]: round(r["peak_error"], 4) for r in rows if "peak_error" in r},
    }
    step, peak = out["full_shard_over_fsdp2_step"], out["full_shard_over_fsdp2_peak"]
    searched = out["searched_over_fsdp2_step"]
    targets = {
        "full_shard <= 1.0x FSDP2 peak": peak is not None and peak <= 1.0,
        f"searched fits {limit_over}x FSDP2's peak": out["searched_fits"],
    }
    if not qlora:
        out.update({
            "full_shard_prefetch3_over_fsdp2_step": ratio(PREFETCH3, FSDP2, "step_s"),
            "full_shard_small_over_fsdp2_step": ratio(SMALL, FSDP2, "step_s"),
            "replicate_over_ddp_step": ratio(REPLICATE, DDP, "step_s"),
        })
        targets.update({
            "full_shard <= 1.0x FSDP2 step": step is not None and step <= 1.0,
            "searched <= 0.85x FSDP2 step": searched is not None and searched <= 0.85,
        })
    out["targets_met"] = targets
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, __doc__, {**MODEL, **MEASURE, "qlora": False}, QUICK)
    cfg = Config(vocab=args.vocab, dim=args.dim, depth=args.depth, heads=args.heads,
                 seq=args.seq, batch=args.batch, steps=args.rounds, warmup=args.warmup)
    opts = argparse.Namespace(**{n: getattr(args, n)
                                 for n in (*MODEL, *MEASURE, "detect", "qlora")})
    world = args.world_size
    labels = QLORA_LABELS if args.qlora else LABELS
    wall = time.perf_counter()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="osdp-finetune-llama-") as checkpoint:
        if args.qlora:  # every system of every rank loads it in 4-bit
            random_llama(opts).save_pretrained(checkpoint)
        result = start_world(world, measure, cfg,
                             argparse.Namespace(**vars(opts), checkpoint=checkpoint))[0]
    load_after = os.getloadavg()[0]
    rows, limit = result["rows"], result["limit"]
    base = ("loaded in 4-bit (bitsandbytes nf4; embedding, norms and head bfloat16), computed "
            "in bfloat16" if args.qlora else "float32")
    title = (f"world {world} ({result['backend']}, {result['device']}): peft LoRA r={args.rank} "
             f"(q, k, v, o) on a Llama of hidden {args.dim}, intermediate {args.intermediate}, "
             f"{args.depth} layers, {args.heads} heads, vocab {args.vocab}, {base}; sequence "
             f"{args.seq}, batch {args.batch}/rank, AdamW"
             + (" (--quick: no figures)" if args.quick else ""))
    text = table(rows)
    out = checks(rows, limit, world, args.limit_over, args.qlora)
    out["wall_s"] = round(time.perf_counter() - wall, 1)
    out["load_avg_before_after"] = [round(load_before, 2), round(load_after, 2)]
    notes = [
        f"Parameters: {format_bytes(result['model_bytes'])}, of them "
        f"{format_bytes(result['adapter_bytes'])} of adapters (trainable); the rest is the "
        "frozen base" + (" (the 4-bit weights' packed bytes and their scales)."
                         if args.qlora else "."),
        *(["FSDP2 loads the 4-bit weights stored as bfloat16 (the FSDP-QLoRA recipe; the same "
           "bytes) and keeps their scales whole on every rank; osdp-fx loads them stored as "
           "uint8 and shards the scales too."] if args.qlora else []),
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
        *(f"{labels[r['key']][1]}: {r['error']}" for r in rows if "error" in r),
    ]
    heading = "A QLoRA fine-tune vs FSDP2" if args.qlora else "A LoRA fine-tune vs FSDP2 and DDP"
    report = "\n".join([f"# {heading}: {title}", "", text, "",
                        *(f"- {n}" for n in notes), "", "```json", json.dumps(out), "```", ""])
    name = f"finetune-qlora-world{world}" if args.qlora else f"finetune-world{world}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.md").write_text(report)
    raw = {"config": {**dataclasses.asdict(cfg), **vars(opts)}, "world_size": world,
           "backend": result["backend"], "device": result["device"], "limit_bytes": limit,
           "rows": rows, "checks": out, "timings_s": result["timings_s"]}
    (args.out_dir / f"{name}.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(title, "", text, "", *(f"- {n}" for n in notes), sep="\n")
    print(json.dumps(out), flush=True)
    return raw


if __name__ == "__main__":
    main()

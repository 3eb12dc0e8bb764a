"""``torch.compile(compiled)`` against eager osdp-fx: step time under each uniform strategy.

Starts one local world (gloo on CPU, NCCL on GPUs) and, on ``--model`` (``gpt``: the GPT of
``compare.py``, its forward returning the LM loss, default vocab 2048, dim 512, depth 4, 8 heads,
sequence 32, per-rank batch 8; ``llama``: a Hugging Face Llama captured by torch.export, default
vocab 2048, hidden 256, 4 layers, 4 heads, sequence 128, per-rank batch 4), with AdamW, compiles
with osdp-fx under each of ``--plans`` twice: one module run eagerly, one wrapped in
``torch.compile(compiled, backend=--backend)``. What inductor sees is the compute between the
runtime's collectives ([Note: torch.compile] in ``osdp_fx/runtime/compile_support.py``,
``docs/training.md``). The reference, in the same world: DDP eager and DDP under
``torch.compile`` (what inductor gains on this model without osdp-fx; ``--no-reference``
leaves it out).

Every system gets ``--warmup`` steps first, at least the 19 after which torch.compile's regions
run their measured way ([Note: measured regions]: the compiled ones compile, then time each
region compiled and eager; the table shows those seconds), then all are timed round-robin in the
same world (``--rounds`` rounds, the order rotated each round so that changes in the machine's
load hit every system alike; a step is forward, backward, AdamW step and zero_grad, after a
barrier; its time is the slowest rank's; the median is kept). Besides the ratio of the medians
it prints, per plan, the median of each round's compiled / eager ratio with its 90 % interval (a
step varies by ±15 % on a loaded 2-core machine: 16 rounds gave 0.94-1.06x between runs). That
the two train alike is tested (``tests/distributed/test_torch_compile.py``), not measured here.

    python benchmarks/torch_compile.py [--model gpt|llama] [--world-size 2]
        [--plans replicate,shard_grad_op,full_shard] [--backend inductor] [--dim N] [--depth N]
        [--vocab N] [--heads N] [--seq N] [--batch N] [--rounds 40] [--warmup 2]
        [--gather-bucket-bytes N] [--no-reference] [--out-dir benchmarks/results]

Without ``--gather-bucket-bytes`` each plan is named (``plan="full_shard"``) and gathers in the
buckets a named plan chooses: one block per all-gather, as FSDP2 (the table's "gather buckets"
column).
``--gather-bucket-bytes 1073741824``: the plans gather each transformer block in one all-gather
(a bucket holding a parameter larger than 64 KiB never spans two blocks), as FSDP2 does; there
are then about as many collective calls, and graph breaks, as blocks.

Target (issue 17): compiled <= 1.0x eager's step time under every uniform strategy. Prints a
Markdown table and, last, one JSON line with the ratios; writes the table to
``<out-dir>/torch-compile-<model>-world{N}.md`` and the rows to ``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from compare import (  # noqa: E402,E501
    RESULTS_DIR,
    UNIFORM_PLANS,
    Config,
    System,
    build_model,
    local_batch,
    start_world,
    time_round_robin,  # noqa: E402
)

from osdp_fx import Devices, compile_osdp  # noqa: E402
from osdp_fx.examples import HFCausalLMWithLoss  # noqa: E402
from osdp_fx.runtime.compiled_regions import SETTLED_AFTER  # noqa: E402

DDP = "DDP"
"""The reference row's plan: DDP, eager and compiled, in the same world (what torch.compile
gains on this model without osdp-fx)."""
EAGER = "eager"
MODEL_DEFAULTS = {
    "gpt": {"vocab": 2048, "dim": 512, "depth": 4, "heads": 8, "seq": 32, "batch": 8},
    "llama": {"vocab": 2048, "dim": 256, "depth": 4, "heads": 4, "seq": 128, "batch": 4},
}


@dataclasses.dataclass(frozen=True)
class Options:
    """What to compare, besides the model (:class:`compare.Config`)."""

    plans: tuple[str, ...]
    """The uniform plans to run, each eager and compiled."""
    backend: str
    """The ``torch.compile`` backend."""
    gather_bucket_bytes: int | None = None
    """The plans' gather bucket size (None: the default, small parameters only)."""
    model: str = "gpt"
    """"gpt" (compare.py's) or "llama" (Hugging Face, captured by torch.export)."""
    reference: bool = True
    """Also time DDP eager and under torch.compile."""


def plan_spec(plan: str, gather_bucket_bytes: int | None, directory: str) -> str:
    """The uniform ``plan``, by name, or as a plan file with ``gather_bucket_bytes`` (one per
    rank and process: a rank never reads a file another is writing)."""
    if gather_bucket_bytes is None:
        return plan
    path = Path(directory) / f"{plan}-rank{dist.get_rank()}.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": plan,
                                "params": {}, "gather_bucket_bytes": gather_bucket_bytes}))
    return str(path)


def build(model: str, cfg: Config, device: torch.device) -> torch.nn.Module:
    """The benchmark's model, returning its loss: the compare.py GPT, or a Hugging Face Llama
    (hidden ``--dim``, ``--depth`` layers, ``--heads`` heads, half as many key/value heads,
    intermediate size 3x hidden; torch.export captures it) whose RMSNorm, rotary embedding
    and SiLU gate are many small operators in eager mode."""
    if model == "gpt":
        return build_model(cfg, device)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=cfg.dim, intermediate_size=3 * cfg.dim,
                         num_hidden_layers=cfg.depth, num_attention_heads=cfg.heads,
                         num_key_value_heads=max(1, cfg.heads // 2), vocab_size=cfg.vocab,
                         max_position_embeddings=cfg.seq)
    return HFCausalLMWithLoss(LlamaForCausalLM(config)).to(device)


def make_system(cfg: Config, world: int, device: torch.device, x: torch.Tensor,
                devices: Devices, plan: str, backend: str | None,
                gather_bucket_bytes: int | None = None, model: str = "gpt") -> System:
    """osdp-fx under ``plan`` (or, for ``plan`` "DDP", the reference: DDP), run eagerly
    (``backend`` None) or under ``torch.compile``."""
    buckets = None
    if plan == DDP:
        from torch.nn.parallel import DistributedDataParallel

        module: torch.nn.Module = DistributedDataParallel(build(model, cfg, device))
    else:
        with tempfile.TemporaryDirectory() as directory:
            module = compile_osdp(build(model, cfg, device), (x,), devices,
                                  plan=plan_spec(plan, gather_bucket_bytes, directory),
                                  optimizer="adamw")
        buckets = module.plan.schedule.gather_bucket_bytes
    if backend is not None:
        module = torch.compile(module, backend=backend)
    return System(EAGER if backend is None else f"torch.compile ({backend})", plan, module,
                  x, device, gather_bucket_bytes=buckets)


def warm_up(systems: list[System], steps: int) -> None:
    """``steps`` timed steps of each system (compiling the compiled ones), recorded apart."""
    for s in systems:
        start = time.perf_counter()
        for _ in range(steps):
            dist.barrier()
            s.timed_step()
        s.info["warmup_s"] = time.perf_counter() - start


def measure(rank: int, world: int, device: torch.device, cfg: Config,
            options: Options) -> dict[str, Any]:
    x = local_batch(cfg, rank, device)
    devices = Devices(world_size=world)  # the plans are uniform: no search, no detection
    systems = [make_system(cfg, world, device, x, devices, plan, backend,
                           options.gather_bucket_bytes, options.model)
               for plan in (*options.plans, *((DDP,) if options.reference else ()))
               for backend in (None, options.backend)]
    # the compiled systems compile, then time their regions both ways and choose
    warm_up(systems, max(cfg.warmup, SETTLED_AFTER))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    time_round_robin(systems, cfg.steps, 0)
    for s in systems:
        s.info["regions"] = compiled_regions(s.model)
    rows = [s.row(world, cfg.batch) for s in systems]
    return {"rows": rows, "graphs": graphs, "backend": dist.get_backend(), "device": str(device)}


def compiled_regions(module: torch.nn.Module) -> str:
    """How many of an osdp-fx module's regions run compiled after the trials: "k of n"
    ([Note: measured regions]); "-" for the others."""
    from osdp_fx.runtime.compiled_regions import COMPILED

    regions = getattr(getattr(module, "_orig_mod", module), "_regions", None)
    if regions is None:
        return "-"
    return f"{sum(r.mode == COMPILED for r in regions.regions)} of {len(regions.regions)}"


def _bucket_label(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.2f} MiB"


def table(rows: list[dict]) -> str:
    head = ("| plan | gather buckets | regions compiled | eager step s | compiled step s "
            "| compiled / eager | eager fwd / bwd / opt s | compiled fwd / bwd / opt s "
            "| compiled warm-up s |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    by_plan: dict[str, list[dict]] = {}
    for r in rows:
        by_plan.setdefault(r["plan"], []).append(r)
    for plan, (eager, comp) in by_plan.items():
        phases = [" / ".join(f"{r[f'{p}_s']:.3f}" for p in ("forward", "backward", "optimizer"))
                  for r in (eager, comp)]
        lines.append(
            f"| {plan} | {_bucket_label(eager['gather_bucket_bytes'])} | {comp['regions']} "
            f"| {eager['step_s']:.3f} | {comp['step_s']:.3f} | "
            f"{comp['step_s'] / eager['step_s']:.2f}x | {phases[0]} | {phases[1]} | "
            f"{comp['warmup_s']:.1f} |")
    return "\n".join(lines)


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float]:
    """A distribution-free ``confidence`` interval for the median of ``values``: the order
    statistics the binomial distribution gives (the whole range when there are too few)."""
    v, n = sorted(values), len(values)
    alpha, below, k = (1 - confidence) / 2, 0.0, 0
    while k < n and below + math.comb(n, k) / 2**n <= alpha:
        below += math.comb(n, k) / 2**n
        k += 1
    return (v[k - 1], v[n - k]) if k else (v[0], v[-1])


def ratios(rows: list[dict]) -> dict[str, Any]:
    """compiled / eager per plan: the ratio of the median steps, and the median of the ratios
    of each round's two steps (timed in the same round, so the machine's slow drifts cancel)
    with its 90 % interval."""
    eager = {r["plan"]: r for r in rows if r["system"] == EAGER}
    out, paired = {}, {}
    for r in rows:
        if r["system"] == EAGER:
            continue
        e = eager[r["plan"]]
        out[r["plan"]] = round(r["step_s"] / e["step_s"], 3)
        per_round = [c / t for c, t in zip(r["step_s_all"], e["step_s_all"])]
        low, high = median_interval(per_round)
        paired[r["plan"]] = {"median": round(statistics.median(per_round), 3),
                             "interval_90": [round(low, 3), round(high, 3)]}
    return {"compiled_over_eager_step": out, "paired": paired,
            "targets_met": {f"{p}: compiled<=1.0x eager": v <= 1.0 for p, v in out.items()
                            if p != DDP}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--plans", default=",".join(UNIFORM_PLANS))
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--gather-bucket-bytes", type=int, default=None,
                    help="gather bucket size of the plans (default: small parameters only; "
                         "1073741824 gathers each transformer block in one all-gather, as "
                         "FSDP2 does)")
    ap.add_argument("--model", choices=sorted(MODEL_DEFAULTS), default="gpt",
                    help="gpt: compare.py's GPT; llama: a Hugging Face Llama captured by "
                         "torch.export (defaults: dim 256, 4 heads, sequence 128, batch 4)")
    ap.add_argument("--no-reference", action="store_true",
                    help="leave out the reference rows (DDP, eager and compiled)")
    for name in ("vocab", "dim", "depth", "heads", "seq", "batch"):
        ap.add_argument(f"--{name}", type=int, default=None)
    for name, default in (("rounds", 40), ("warmup", 2)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    shape = {name: getattr(args, name) if getattr(args, name) is not None else default
             for name, default in MODEL_DEFAULTS[args.model].items()}
    cfg = Config(**shape, steps=args.rounds, warmup=args.warmup)
    options = Options(plans=tuple(args.plans.split(",")), backend=args.backend,
                      gather_bucket_bytes=args.gather_bucket_bytes, model=args.model,
                      reference=not args.no_reference)
    start = time.perf_counter()
    result = start_world(args.world_size, measure, cfg, options)[0]
    rows = result["rows"]
    text = table(rows)
    buckets = (f"gather buckets of {options.gather_bucket_bytes} bytes"
               if options.gather_bucket_bytes else "each named plan's gather buckets")
    print(f"world {args.world_size} ({result['backend']}, {result['device']}), "
          f"{options.model} {cfg}, backend {options.backend}, {buckets}, "
          f"{result['graphs']} graphs compiled on rank 0, "
          f"{time.perf_counter() - start:.0f} s in all")
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / (f"torch-compile-{options.model}-world{args.world_size}" + (
        f"-buckets{options.gather_bucket_bytes}" if options.gather_bucket_bytes else ""))
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"model": options.model,
                                                     "config": dataclasses.asdict(cfg),
                                                     "backend": options.backend,
                                                     "gather_bucket_bytes":
                                                         options.gather_bucket_bytes, **result}))
    out = ratios(rows)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()

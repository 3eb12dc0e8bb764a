"""Activation recomputation chosen with sharding, against FSDP2 with ``torch.utils.checkpoint``
(issue 16).

Starts one local world (gloo on CPU; ``compare.start_world``) and builds, in that one world, on
one activation-heavy GPT (``osdp_fx.examples.GPTWithLoss(TinyGPT)``; default vocab 2048, dim 256,
depth 4, 4 heads, sequence 256, per-rank batch 4), trained with AdamW:

- FSDP2: ``torch.distributed.fsdp.fully_shard`` on every block, then on the root, over
  ``init_device_mesh("cpu", (world,))`` (``compare.fsdp2_model``);
- FSDP2 + checkpoint: the same, each block's forward run under
  ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` (applied before ``fully_shard``);
- osdp-fx ``full_shard``; ``full_shard`` with every region (block, ``osdp_fx.core.regions.
  find_regions``) recomputed ``"full"``; the same with every region ``"selective"``;
  ``full_shard`` with gather buckets of one block's gathered bytes (one all-gather per block),
  alone and with every region ``"full"`` (plan files);
- osdp-fx ``replicate``: its peak only (not timed), to place the limit B;
- osdp-fx searched (``compile_osdp(memory_limit=A)``) at A = ``--a-fraction`` (0.6) x the
  measured all-``full_shard`` peak, and the sharding-only search at A (expected: no plan fits);
- osdp-fx searched sharding-only and searched jointly at B, ``--b-fraction`` (0.5) of the way
  from the measured all-``full_shard`` peak to the measured all-``replicate`` peak.

The sharding-only search is ``compile_osdp(..., recompute=False)``: the same search (splits,
schedules, the rank-0 agreement) with no region offered for recomputation (the plan it returns
is checked to recompute nothing).
Every osdp-fx system compiles with one ``detect_devices()`` measured at the start.

Peak memory: every system's first ``--peak-steps`` steps (forward, backward, AdamW step, from
step 1) are each measured by ``storage_tracker.StorageTracker`` (independent of osdp-fx):
what the step adds to what the process held at its start, plus what the system holds at its
start (every storage the process holds that it did not hold before the system was built: its
parameters, optimizer state, batch, whatever its library keeps). The largest step of the
largest rank is the measured peak. The predicted peak is the first step's prediction for step 1
and the steady one for later steps; the error column is the worst step's.

Step time: every system built (all but ``replicate`` and the searches that raised) is timed
round-robin: ``--warmup`` steps of each, then ``--rounds`` rounds of one step of every system,
the order rotated each round, a barrier before each step (``compare.time_round_robin``); a
step's time is the slowest rank's, the median is shown. A system measured over its limit is
timed too (FSDP2 + checkpoint may not fit A, and its time is still the baseline), marked
``NO`` in the fits column; the checks that need it to fit say so.

    python benchmarks/recompute.py [--world-size 2] [--vocab 2048] [--dim 256] [--depth 4]
        [--heads 4] [--seq 256] [--batch 4] [--rounds 8] [--warmup 1] [--peak-steps 3]
        [--a-fraction 0.6] [--b-fraction 0.5] [--no-detect] [--out-dir benchmarks/results]
        [--quick]

``--quick``: vocab 64, dim 32, depth 2, 2 heads, sequence 16, 1 round, 2 peak steps, the
``Devices()`` defaults instead of ``detect_devices()`` (``--no-detect``): checks that it runs
(its figures are no figures; at that size the limits hold little activation).

Targets (issue 16): at A the searched plan fits (measured) where no plan without recomputation
does (all-full_shard measures over A, the sharding-only search raises PlanError) and steps in
<= 0.85x the time of FSDP2 + checkpoint, which must fit under A too; at B the joint plan is never
slower than the sharding-only one and >= 1.15x faster than full_shard with every block ``full``;
every recomputing plan's predicted peak within 5 % of measured. Prints a Markdown table and,
last, one JSON line with the checks; writes ``recompute-world{N}.md`` and ``.json`` to
``--out-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from compare import (  # noqa: E402
    Config,
    System,
    _mib,
    build_model,
    every_rank,
    fsdp2_model,
    local_batch,
    start_world,
    time_round_robin,
)
from torch.utils.checkpoint import checkpoint  # noqa: E402

from osdp_fx import Devices, compile_osdp, detect_devices  # noqa: E402
from osdp_fx.core.regions import find_regions  # noqa: E402
from osdp_fx.errors import PlanError  # noqa: E402
from osdp_fx.passes.capture import capture  # noqa: E402
from osdp_fx.runtime.storage_tracker import StorageTracker, dense_tensors, held_tensors  # noqa: E402
from osdp_fx.units import format_bytes  # noqa: E402

MiB = 2**20
RESULTS_DIR = ROOT / "benchmarks" / "results"
TOLERANCE = 0.05  # predicted against measured peak of the plans that recompute

# the rows, in the order they are built and shown: (key, system, plan label)
FSDP2, FSDP2_CKPT = "fsdp2", "fsdp2_ckpt"
FULL_SHARD, FULL_RECOMPUTE, SELECTIVE = "full_shard", "full_shard_full", "full_shard_selective"
BLOCKS, BLOCKS_FULL = "full_shard_blocks", "full_shard_blocks_full"
REPLICATE, REPLICATE_FULL = "replicate", "replicate_full"
SEARCHED_A, SHARDING_A = "searched_A", "sharding_only_A"
SHARDING_B, JOINT_B = "sharding_only_B", "joint_B"
LABELS = {
    FSDP2: ("FSDP2", "fully_shard per block + root"),
    FSDP2_CKPT: ("FSDP2", "fully_shard per block + root, checkpoint every block"),
    FULL_SHARD: ("osdp-fx", "full_shard"),
    FULL_RECOMPUTE: ("osdp-fx", "full_shard, every block full"),
    SELECTIVE: ("osdp-fx", "full_shard, every block selective"),
    BLOCKS: ("osdp-fx", "full_shard, block-sized gather buckets"),
    BLOCKS_FULL: ("osdp-fx", "full_shard, block-sized gather buckets, every block full"),
    REPLICATE: ("osdp-fx", "replicate (peak only: places B)"),
    REPLICATE_FULL: ("osdp-fx", "replicate, every block full (a floor for plans recomputing "
                                "every block)"),
    SEARCHED_A: ("osdp-fx", "searched @ A"),
    SHARDING_A: ("osdp-fx", "searched sharding-only @ A"),
    SHARDING_B: ("osdp-fx", "searched sharding-only @ B"),
    JOINT_B: ("osdp-fx", "searched joint @ B"),
}
MODEL = {"vocab": 2048, "dim": 256, "depth": 4, "heads": 4, "seq": 256, "batch": 4}
MEASURE = {"rounds": 8, "warmup": 1, "peak_steps": 3, "a_fraction": 0.6, "b_fraction": 0.5}
QUICK = {"vocab": 64, "dim": 32, "depth": 2, "heads": 2, "seq": 16, "rounds": 1, "peak_steps": 2,
         "detect": False}


# ---- the systems --------------------------------------------------------------------------

def checkpoint_forward(block: torch.nn.Module) -> None:
    """Run ``block``'s forward under ``torch.utils.checkpoint`` (non-reentrant): it keeps only
    the block's inputs and re-runs the forward in backward."""
    forward = block.forward
    block.forward = functools.partial(checkpoint, forward, use_reentrant=False)


def recompute_plan_files(cfg: Config, directory: Path, world: int) -> dict[str, str]:
    """Plan files: every parameter full_shard, every region ``full`` (``selective``);
    full_shard with gather buckets of one block's gathered parameters (``blocks``; one
    all-gather per block, as FSDP2 groups one), alone and with every region ``full``; every
    parameter replicated with every region ``full`` (``replicate_full``: the fewest
    collectives any plan that recomputes every block can have)."""
    model = build_model(cfg, torch.device("cpu"))
    gm = capture(model, (local_batch(cfg, 0, torch.device("cpu")),)).gm
    regions = find_regions(gm.graph)
    block = max(sum(-(-gm.get_parameter(t).numel() // world) * world * 4 for t in
                    {a.target for op in ops for a in op.all_input_nodes if a.op == "get_attr"})
                for ops in regions.values())
    every_full = {r: "full" for r in regions}
    plans = {"full": {"recompute": every_full},
             "selective": {"recompute": {r: "selective" for r in regions}},
             "blocks": {"gather_bucket_bytes": block},
             "blocks_full": {"gather_bucket_bytes": block, "recompute": every_full},
             "replicate_full": {"default": "replicate", "recompute": every_full}}
    files = {}
    for name, extra in plans.items():
        path = directory / f"full_shard-{name}.json"
        path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1,
                                    "default": "full_shard", "params": {}, **extra}))
        files[name] = str(path)
    return files


def _storages() -> dict[int, weakref.ref]:
    """Every storage the process holds (by its address), weakly."""
    return {d.untyped_storage()._cdata: weakref.ref(d.untyped_storage())
            for t in held_tensors() for d in dense_tensors(t)}


def _new_bytes(before: dict[int, weakref.ref]) -> int:
    """Bytes of the storages the process holds now and did not hold ``before``."""
    now = {d.untyped_storage()._cdata: d.untyped_storage()
           for t in held_tensors() for d in dense_tensors(t)}
    return sum(s.nbytes() for key, s in now.items()
               if key not in before or before[key]() is not s)


def measured_peaks(s: System, before: dict[int, weakref.ref], steps: int) -> list[int]:
    """Each of the system's first ``steps`` steps: what it holds at the step's start (storages
    new since ``before``) plus what the step adds to the process's live storage at its peak."""
    peaks = []
    for _ in range(steps):
        own = _new_bytes(before)
        tracker = StorageTracker()
        with tracker:
            s.step()
            s.zero_grad()
        peaks.append(own + tracker.peak_bytes - tracker.start_bytes)
    return peaks


def _summary(counts: dict[str, int]) -> str:
    return ", ".join(f"{s} {n}" for s, n in counts.items() if n)


class World:
    """The systems of one rank, built and measured one after the other; ``labels``: each
    system's key -> (system, plan label)."""

    def __init__(self, rank: int, world: int, device: torch.device, cfg: Config,
                 opts: argparse.Namespace, labels: dict[str, tuple[str, str]] = LABELS) -> None:
        self.rank, self.world, self.device, self.cfg, self.opts = rank, world, device, cfg, opts
        self.labels = labels
        self.systems: dict[str, System] = {}
        self.rows: dict[str, dict[str, Any]] = {}
        self.timings_s: dict[str, float] = {}
        start = time.perf_counter()
        # once, for every compile; detect() is collective and gives every rank the same figures
        self.devices = detect_devices() if opts.detect else Devices(world_size=world)
        self.timings_s["devices"] = time.perf_counter() - start

    def add(self, key: str, make: Callable[[torch.Tensor], tuple[torch.nn.Module, dict]],
            limit: int | None = None) -> dict[str, Any]:
        """Build a system (``make(x)`` -> (module, info)) and measure its peak; a PlanError
        becomes a row saying so."""
        system, label = self.labels[key]
        start = time.perf_counter()
        gc.collect()  # what earlier systems left: not this system's
        before = _storages()
        x = local_batch(self.cfg, self.rank, self.device)
        try:
            module, info = make(x)
        except PlanError as e:  # the same on every rank: the memory model is shape-based
            self.rows[key] = {"key": key, "system": system, "plan": label, "limit_bytes": limit,
                              "error": str(e).splitlines()[0]}
            self.timings_s[key] = time.perf_counter() - start
            return self.rows[key]
        info["build_s"] = time.perf_counter() - start  # with its gc.collect() and snapshot
        s = System(system, label, module, x, self.device, key=key, limit_bytes=limit, **info)
        del module
        per_step = measured_peaks(s, before, self.opts.peak_steps)
        peaks = [every_rank(p, self.device) for p in per_step]  # [step][rank]
        s.info["peak_bytes_per_step"] = [max(p) for p in peaks]
        s.info["peak_bytes_per_rank"] = [max(step[r] for step in peaks)
                                         for r in range(self.world)]
        s.info["peak_bytes"] = max(s.info["peak_bytes_per_step"])
        predicted = s.info.get("predicted_peak_bytes_per_step")
        if predicted:
            s.info["peak_error"] = max(
                (m / p - 1 for m, p in zip(s.info["peak_bytes_per_step"], predicted)), key=abs)
            s.info["predicted_peak_bytes"] = max(predicted)
        s.info["fits"] = None if limit is None else s.info["peak_bytes"] <= limit
        self.systems[key] = s
        self.rows[key] = s.info
        self.timings_s[key] = time.perf_counter() - start
        return s.info

    def timed_rows(self) -> list[dict[str, Any]]:
        """Time every system built round-robin (``opts.rounds`` rounds after ``opts.warmup``
        warm-up steps each; collective) and return every row, in ``labels`` order."""
        timed = list(self.systems.values())
        start = time.perf_counter()
        time_round_robin(timed, self.opts.rounds, self.opts.warmup)
        self.timings_s["timed rounds"] = time.perf_counter() - start
        for s in timed:
            self.rows[s.info["key"]] = s.row(self.world, self.cfg.batch)  # collective
        rows = [self.rows[key] for key in self.labels]
        for r in rows:
            r.setdefault("system", self.labels[r["key"]][0])
            r.setdefault("plan", self.labels[r["key"]][1])
        return rows

    def drop(self, key: str) -> None:
        del self.systems[key]
        gc.collect()

    # -- builders: make(x) -> (module, info) --

    def fsdp2(self, checkpointed: bool) -> Callable[[torch.Tensor], tuple[torch.nn.Module, dict]]:
        def make(x: torch.Tensor) -> tuple[torch.nn.Module, dict]:
            model = fsdp2_model(self.cfg, self.world, self.device,
                                checkpoint_forward if checkpointed else None)
            n = len(model.model.blocks)
            return model, {"recomputed": {"full (torch.utils.checkpoint)": n} if checkpointed
                           else {}}
        return make

    def osdp(self, plan: str | None, limit: int | None = None,
             sharding_only: bool = False) -> Callable[[torch.Tensor], tuple[torch.nn.Module, dict]]:
        def make(x: torch.Tensor) -> tuple[torch.nn.Module, dict]:
            model = build_model(self.cfg, self.device)
            compiled = compile_osdp(model, (x,), self.devices, plan=plan, memory_limit=limit,
                                    optimizer="adamw", recompute=not sharding_only)
            del model
            p = compiled.plan
            recompute = dict(p.recompute)
            if sharding_only and recompute:
                raise RuntimeError(f"the sharding-only search recomputes {recompute}")
            pr = p.prediction
            assert pr is not None and pr.first_step_peak_bytes is not None
            steady = self.opts.peak_steps - 1
            policies: dict[str, int] = {}
            for policy in recompute.values():
                policies[policy] = policies.get(policy, 0) + 1
            return compiled, {
                "plan_counts": p.counts(), "splits": dict(p.splits), "schedule": str(p.schedule),
                "hash": p.hash(), "recompute": recompute, "recomputed": policies,
                "predicted_step_s": pr.step_time_s,
                "predicted_peak_bytes_per_step": [pr.first_step_peak_bytes]
                + [pr.peak_memory_bytes] * steady,
            }
        return make


def measure(rank: int, world: int, device: torch.device, cfg: Config,
            opts: argparse.Namespace, plan_files: dict[str, str]) -> dict[str, Any]:
    """Every system on this rank; the rows (identical on every rank) come back from rank 0."""
    w = World(rank, world, device, cfg, opts)
    w.add(FULL_SHARD, w.osdp("full_shard"))
    w.add(REPLICATE, w.osdp("replicate"))
    w.drop(REPLICATE)
    low, high = w.rows[FULL_SHARD]["peak_bytes"], w.rows[REPLICATE]["peak_bytes"]
    limit_a = int(opts.a_fraction * low)
    limit_b = int(low + opts.b_fraction * (high - low))
    w.add(FSDP2, w.fsdp2(False))
    w.add(FSDP2_CKPT, w.fsdp2(True), limit_a)
    w.add(FULL_RECOMPUTE, w.osdp(plan_files["full"]))
    w.add(SELECTIVE, w.osdp(plan_files["selective"]))
    w.add(BLOCKS, w.osdp(plan_files["blocks"]))
    w.add(BLOCKS_FULL, w.osdp(plan_files["blocks_full"]))
    w.add(REPLICATE_FULL, w.osdp(plan_files["replicate_full"]))
    w.add(SEARCHED_A, w.osdp(None, limit_a), limit_a)
    w.add(SHARDING_A, w.osdp(None, limit_a, sharding_only=True), limit_a)
    w.add(SHARDING_B, w.osdp(None, limit_b, sharding_only=True), limit_b)
    w.add(JOINT_B, w.osdp(None, limit_b), limit_b)
    return {"rows": w.timed_rows(), "limit_a": limit_a, "limit_b": limit_b, "timings_s": w.timings_s,
            "backend": dist.get_backend(), "device": str(device)}


# ---- reporting ----------------------------------------------------------------------------

def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| system | plan | recomputed regions | measured step ms | predicted step ms | "
            "measured peak MiB | predicted peak MiB | peak error | limit MiB | fits |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in rows:
        limit = _mib(r.get("limit_bytes")) if r.get("limit_bytes") else "-"
        if "error" in r:
            lines.append(f"| {r['system']} | {r['plan']} | - | no plan fits (PlanError) | - | "
                         f"- | - | - | {limit} | no |")
            continue
        plan = r["plan"]
        if r.get("plan_counts") and r["plan"].startswith("searched"):
            plan += f" ({_summary(r['plan_counts'])}; {r['schedule']}"
            plan += f"; splits {r['splits']})" if r["splits"] else ")"
        error = f"{r['peak_error']:+.1%}" if "peak_error" in r else "-"
        fits = {None: "-", True: "yes", False: "NO"}[r["fits"]]
        lines.append(
            f"| {r['system']} | {plan} | {_summary(r['recomputed']) or 'none'} | "
            f"{_ms(r.get('step_s'))} | {_ms(r.get('predicted_step_s'))} | "
            f"{_mib(r['peak_bytes'])} | {_mib(r.get('predicted_peak_bytes'))} | {error} | "
            f"{limit} | {fits} |")
    return "\n".join(lines)


def checks(rows: list[dict[str, Any]], limit_a: int, limit_b: int, world: int) -> dict[str, Any]:
    """The issue's targets, with the ratios they rest on (None where a system has no time)."""
    by = {r["key"]: r for r in rows}

    def step(key: str) -> float | None:
        return by[key].get("step_s")

    def ratio(a: str, b: str) -> float | None:
        return round(step(a) / step(b), 3) if step(a) and step(b) else None

    recomputing = [r for r in rows if r.get("recompute") and "peak_error" in r]
    out: dict[str, Any] = {
        "world_size": world,
        "limit_a_mib": round(limit_a / MiB, 2), "limit_b_mib": round(limit_b / MiB, 2),
        "full_shard_peak_mib": round(by[FULL_SHARD]["peak_bytes"] / MiB, 2),
        "replicate_peak_mib": round(by[REPLICATE]["peak_bytes"] / MiB, 2),
        "full_shard_over_a": by[FULL_SHARD]["peak_bytes"] > limit_a,
        "sharding_only_at_a_raises": "error" in by[SHARDING_A],
        "searched_at_a_fits": by[SEARCHED_A].get("fits") is True,
        "fsdp2_ckpt_fits_a": by[FSDP2_CKPT].get("fits") is True,
        "searched_a_over_fsdp2_ckpt_step": ratio(SEARCHED_A, FSDP2_CKPT),
        "sharding_only_at_b_fits": by[SHARDING_B].get("fits") is True,
        "joint_at_b_fits": by[JOINT_B].get("fits") is True,
        "joint_b_over_sharding_only_b_step": ratio(JOINT_B, SHARDING_B),
        "joint_b_same_plan_as_sharding_only_b": (
            by[JOINT_B].get("hash") is not None
            and by[JOINT_B].get("hash") == by[SHARDING_B].get("hash")),
        "full_recompute_over_joint_b_step": ratio(FULL_RECOMPUTE, JOINT_B),
        # no plan that recomputes every block has fewer collectives than this one
        "replicate_full_over_fsdp2_ckpt_step": ratio(REPLICATE_FULL, FSDP2_CKPT),
        "recompute_peak_errors": {r["key"]: round(r["peak_error"], 4) for r in recomputing},
        "max_recompute_peak_error": (round(max(abs(r["peak_error"]) for r in recomputing), 4)
                                     if recomputing else None),
    }
    a, b = out["searched_a_over_fsdp2_ckpt_step"], out["joint_b_over_sharding_only_b_step"]
    full = out["full_recompute_over_joint_b_step"]
    err = out["max_recompute_peak_error"]
    out["targets_met"] = {
        "A: searched fits, full_shard and sharding-only do not": bool(
            out["searched_at_a_fits"] and out["full_shard_over_a"]
            and out["sharding_only_at_a_raises"]),
        "A: FSDP2+checkpoint fits": bool(out["fsdp2_ckpt_fits_a"]),
        "A: searched <= 0.85x FSDP2+checkpoint step": a is not None and a <= 0.85,
        "B: joint <= sharding-only step (or the same plan)": bool(
            out["sharding_only_at_b_fits"] and out["joint_at_b_fits"]
            and ((b is not None and b <= 1.0) or out["joint_b_same_plan_as_sharding_only_b"])),
        "B: full recompute >= 1.15x joint step": full is not None and full >= 1.15,
        "peak predicted within 5% for recomputing plans": err is not None and err <= TOLERANCE,
    }
    return out


def parse_args(argv: list[str] | None, doc: str, options: dict[str, Any],
               quick: dict[str, Any]) -> argparse.Namespace:
    """A benchmark's command line: ``--world-size``, an option per entry of ``options`` (its
    default's type; a flag where the default is False), ``--no-detect``, ``--out-dir`` and
    ``--quick`` (which sets ``quick``)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    for name, default in options.items():
        flag = f"--{name.replace('_', '-')}"
        if default is False:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--no-detect", dest="detect", action="store_false",
                        help="plan with Devices() defaults instead of detect_devices() (~15 s)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny model, 1 round: checks that it runs (no figures)")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in quick.items():
            setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv, __doc__, {**MODEL, **MEASURE}, QUICK)
    cfg = Config(**{n: getattr(args, n) for n in MODEL}, steps=args.rounds, warmup=args.warmup)
    opts = argparse.Namespace(**{n: getattr(args, n) for n in (*MEASURE, "detect")})
    world = args.world_size
    wall = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="osdp-recompute-") as plan_dir:
        plan_files = recompute_plan_files(cfg, Path(plan_dir), args.world_size)
        result = start_world(world, measure, cfg, opts, plan_files)[0]
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows, limit_a, limit_b = result["rows"], result["limit_a"], result["limit_b"]
    title = (f"world {world} ({result['backend']}, {result['device']}): GPT vocab {cfg.vocab}, "
             f"dim {cfg.dim}, depth {cfg.depth}, heads {cfg.heads}, seq {cfg.seq}, "
             f"batch {cfg.batch}/rank, AdamW" + (" (--quick: no figures)" if args.quick else ""))
    text = table(rows)
    out = checks(rows, limit_a, limit_b, world)
    out["wall_s"] = round(time.perf_counter() - wall, 1)
    out["load_avg_before_after"] = [None if v is None else round(v, 2)
                                    for v in (load_before, load_after)]
    notes = [
        f"A = {opts.a_fraction} x the measured all-full_shard peak = {format_bytes(limit_a)}; "
        f"B = {opts.b_fraction} of the way from it to the all-replicate peak = "
        f"{format_bytes(limit_b)}.",
        f"Step: median of {opts.rounds} round-robin rounds after {opts.warmup} warm-up step(s) "
        "of each system (a barrier before each step; a step's time is the slowest rank's); "
        "systems over their limit are timed too (fits: NO).",
        f"Peak: the largest of the first {opts.peak_steps} steps (from step 1) and of the ranks, "
        "measured by osdp_fx/runtime/storage_tracker.py; predicted: step 1's prediction for step 1, "
        "the steady one after; error: the worst step's (measured / predicted - 1).",
        f"Machine: {os.cpu_count()} cores, 1-min load average "
        f"{out['load_avg_before_after'][0]} before and {out['load_avg_before_after'][1]} after.",
        "Wall time (rank 0; a system's includes its compile and peak steps): "
        + ", ".join(f"{k} {v:.1f} s" for k, v in result["timings_s"].items()) + ".",
        *(f"{LABELS[r['key']][1]}: {r['error']}" for r in rows if "error" in r),
    ]
    report = "\n".join([f"# Recomputation with sharding vs FSDP2 + checkpoint: {title}", "",
                        text, "", *(f"- {n}" for n in notes), "", "```json", json.dumps(out),
                        "```", ""])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"recompute-world{world}.md").write_text(report)
    raw = {"config": {**dataclasses.asdict(cfg), **vars(opts)}, "world_size": world,
           "backend": result["backend"], "device": result["device"], "limit_a_bytes": limit_a,
           "limit_b_bytes": limit_b, "rows": rows, "checks": out,
           "timings_s": result["timings_s"]}
    (args.out_dir / f"recompute-world{world}.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(title, "", text, "", *(f"- {n}" for n in notes), sep="\n")
    print(json.dumps(out), flush=True)
    return raw


if __name__ == "__main__":
    main()

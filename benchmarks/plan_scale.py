"""How long planning takes, stage by stage, and how long the search alone takes on a large model.

By default: ``python -m osdp_fx plan`` of the Llama shapes of ``examples/llama_shapes.py``
(Llama-3.2-1B and Llama-3-8B for 64 ranks, Llama-3-70B for 512; ``h100-sxm-8x``, bf16, built on
the meta device), each in a fresh process as a launch would run it, with the seconds of each
stage its progress log reports: building the model, capture, the profiles (how many), the
sequence analysis, the search and the rest of planning, the comparison with uniform plans, and
the whole command (process start and imports included). Prints a Markdown table.

    python benchmarks/plan_scale.py [--shapes llama3_1b,llama3_8b,llama3_70b]

``--search-only``: GPT-2 with 48 layers, hidden 2048, planned for 8 ranks from a profile taken on
the meta device; prints one JSON line: parameter groups, graph nodes, profile seconds, and the
seconds of the two searches (which linears to split, with every k in 2, 4, 8 and every number
of sharded parts as options; then a strategy per group) and their sum; then the joint search of
strategies and recomputation (``docs/recomputation.md``) at a limit only recomputation meets
(halfway between the least predicted peak with every block recomputed and the all-full_shard
peak without): once (``search_plan``, the default schedule) and under every candidate schedule
(``search_schedules``, what ``compile_osdp`` runs).

    python benchmarks/plan_scale.py --search-only [--world-size 8] [--memory 16GiB]

``--restart``: what a restarted job pays. ``compile_osdp`` of a Hugging Face GPT-2 (12 layers,
hidden 768, built on the meta device, sequence 512) in two launches of ``torchrun
--nproc-per-node 2`` (gloo, devices measured) that share a fresh plan cache: the first searches
and saves its plan, the second takes it. Prints a Markdown table: per launch, capture, plan,
the whole ``compile_osdp`` (the time before the first step), what the plan cache did and the
plan's hash.

    python benchmarks/plan_scale.py --restart [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osdp_fx import compile_osdp  # noqa: E402
from osdp_fx.core.devices import Devices  # noqa: E402
from osdp_fx.core.regions import find_regions  # noqa: E402
from osdp_fx.core.setting import StepSetting  # noqa: E402
from osdp_fx.cost_models.timeline import predict_step_memory  # noqa: E402
from osdp_fx.examples import gpt2_48_layers_meta, hf_gpt2_meta  # noqa: E402
from osdp_fx.passes.capture import capture  # noqa: E402
from osdp_fx.planner.analysis import MEMORY_MARGIN, param_states  # noqa: E402
from osdp_fx.planner.make import analyze  # noqa: E402
from osdp_fx.planner.search import (  # noqa: E402
    choose_splits,
    search_plan,
    search_schedules,
    search_strategies,
)
from osdp_fx.units import parse_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = {"llama3_1b": 64, "llama3_8b": 64, "llama3_70b": 512}
"""Each shape of ``examples/llama_shapes.py`` and the ranks it is planned for."""
_DONE = re.compile(r"\[osdp-fx\] (.+): done in ([0-9.]+) s")
RESTART_MODEL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "seq": 512}
"""``--restart``'s model: GPT-2 small's shape (``examples.hf_gpt2_meta``)."""
_STAGE = re.compile(r"([a-z][a-z (),]*?) ([0-9.]+) s")


def plan_stages(shape: str, world_size: int) -> dict[str, float]:
    """Seconds of each stage of ``python -m osdp_fx plan`` for ``shape``, from its progress log
    (a fresh process; its plan is not printed here)."""
    command = [sys.executable, "-m", "osdp_fx", "plan", f"examples/llama_shapes.py:{shape}",
               "--devices", "h100-sxm-8x", "--world-size", str(world_size),
               "--mixed-precision", "bf16"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    whole = time.perf_counter() - start
    stages: dict[str, float] = {"profiles": 0, "profile_s": 0.0, "sequence_s": 0.0}
    for label, seconds in _DONE.findall(done.stderr):
        last = label.split(" > ")[-1]
        if last == "profile":
            stages["profiles"] += 1
            stages["profile_s"] += float(seconds)
        elif last.startswith("sizes at sequence length"):
            stages["sequence_s"] += float(seconds)
        elif " > " not in label:
            stages[label] = float(seconds)
    plan_s = stages.pop("plan (profile, search)")
    return {"build_s": stages.pop("build model"), "capture_s": stages.pop("capture"),
            "profiles": stages["profiles"], "profile_s": stages["profile_s"],
            "sequence_s": stages["sequence_s"],
            "search_s": plan_s - stages["profile_s"] - stages["sequence_s"],
            "compare_s": stages.pop("compare with uniform plans"), "whole_s": whole}


def launches(shapes: list[str]) -> None:
    """The table of :func:`plan_stages` for ``shapes``."""
    print("| model | ranks | build | capture | profiles | sequence analysis | search and the "
          "rest | comparison rows | whole command |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in shapes:
        t = plan_stages(shape, LAUNCHES[shape])
        print(f"| {shape} | {LAUNCHES[shape]} | {t['build_s']:.1f} s | {t['capture_s']:.1f} s | "
              f"{t['profiles']} x, {t['profile_s']:.1f} s | {t['sequence_s']:.1f} s | "
              f"{t['search_s']:.1f} s | {t['compare_s']:.1f} s | {t['whole_s']:.0f} s |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(LAUNCHES),
                        help="comma-separated shapes of examples/llama_shapes.py")
    parser.add_argument("--search-only", action="store_true",
                        help="time the searches on GPT-2 with 48 layers instead")
    parser.add_argument("--world-size", type=int, default=8, help="--search-only: ranks")
    parser.add_argument("--memory", default="16GiB", help="--search-only: limit per rank")
    parser.add_argument("--restart", action="store_true",
                        help="time a compile and its restart, which takes the cached plan")
    parser.add_argument("--layers", type=int, default=RESTART_MODEL["n_layer"],
                        help="--restart: the GPT-2's layers")
    parser.add_argument("--restart-launch", nargs=3, metavar=("LAYERS", "CACHE", "OUT"),
                        help=argparse.SUPPRESS)  # one launch's rank (torchrun runs it)
    args = parser.parse_args()
    if args.restart_launch:
        restart_launch(*args.restart_launch)
    elif args.restart:
        restarts(args.layers)
    elif args.search_only:
        searches(args.world_size, parse_bytes(args.memory))
    else:
        launches(args.shapes.split(","))


def restarts(layers: int) -> None:
    """The table of ``--restart``: two launches sharing a fresh plan cache."""
    print("| launch | capture | plan | compile_osdp in all | plan cache | plan hash |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for launch in ("first", "restart"):
            out = Path(tmp) / f"{launch}.json"
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", "2", __file__, "--restart-launch",
                                   str(layers), str(Path(tmp) / "plans"), str(out)],
                                  cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"the {launch} launch failed:\n{done.stderr[-3000:]}")
            r = json.loads(out.read_text())
            plan_s = sum(v for k, v in r["stages"].items() if k.startswith("plan"))
            print(f"| {launch} | {r['stages']['capture']:.1f} s | {plan_s:.1f} s | "
                  f"{r['whole_s']:.1f} s | {r['cache']} | `{r['hash']}` |", flush=True)


def restart_launch(layers: str, cache: str, out: str) -> None:
    """One rank of a ``--restart`` launch: compile the model (of ``layers`` layers) with the
    plan cache in ``cache``; rank 0 writes its stages, the whole time, what the cache did and
    the plan hash to ``out``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    api_log = logging.getLogger("osdp_fx.api")
    api_log.addHandler(handler)
    api_log.setLevel(logging.INFO)
    torch.manual_seed(0)  # a model on the meta device: every rank initialises the same values
    model, (idx,) = hf_gpt2_meta(**(RESTART_MODEL | {"n_layer": int(layers)}))
    start = time.perf_counter()
    compiled = compile_osdp(model, (torch.zeros_like(idx, device="cpu"),), plan_cache=cache,
                            init_fn=model.model._init_weights)
    whole = time.perf_counter() - start
    summary = next(m for m in records if m.startswith("compile_osdp:"))
    stages = {k: float(v) for k, v in _STAGE.findall(summary.split("(", 1)[1])}
    used = any(m.startswith("plan cache: using") for m in records)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({
            "whole_s": whole, "stages": stages, "hash": compiled.plan.hash(),
            "cache": "took the saved plan" if used else "searched, saved the plan"}))
    dist.destroy_process_group()


def searches(world_size: int, limit: int) -> None:
    """The JSON line of ``--search-only``."""
    model, inputs = gpt2_48_layers_meta()
    captured = capture(model, inputs)
    start = time.perf_counter()
    analysis = analyze(captured, inputs, fake=True)
    profile_s = time.perf_counter() - start
    setting = StepSetting(Devices(world_size=world_size, memory_bytes=limit), optimizer="adamw")
    start = time.perf_counter()
    splits = choose_splits(analysis, setting, limit)
    split_search_s = time.perf_counter() - start
    start = time.perf_counter()
    strategies = search_strategies(analysis, setting, limit)
    search_s = time.perf_counter() - start
    counts: dict[str, int] = {}
    for s in strategies.values():
        counts[s] = counts.get(s, 0) + 1
    joint = joint_search(analysis, world_size)
    print(json.dumps({
        "parameter_groups": len(strategies), "graph_nodes": len(captured.gm.graph.nodes),
        "profile_seconds": round(profile_s, 3),
        "split_search_seconds": round(split_search_s, 3),
        "strategy_search_seconds": round(search_s, 3),
        "search_seconds": round(split_search_s + search_s, 3),
        "linears_split": len(splits), "strategies": counts, **joint,
    }))


def joint_search(analysis, world_size: int) -> dict[str, object]:
    """Seconds of the joint search at a limit that needs recomputation."""
    def peak(recompute: dict[str, str]) -> int:
        states = param_states(analysis, {n: "full_shard" for n in analysis.captured.params})
        return predict_step_memory(analysis.captured.gm, states, analysis.facts,
                                   setting=StepSetting(Devices(world_size=world_size),
                                                       optimizer="adamw"),
                                   profiled_batch=analysis.batch_size,
                                   recompute=recompute).peak_bytes

    regions = find_regions(analysis.captured.gm.graph)
    low, high = peak({r: "full" for r in regions}), peak({})
    limit = int((low + high) / 2 / (1 - MEMORY_MARGIN))
    setting = StepSetting(Devices(world_size=world_size, memory_bytes=limit), optimizer="adamw")
    start = time.perf_counter()
    recompute = search_plan(analysis, setting, limit).recompute
    once_s = time.perf_counter() - start
    start = time.perf_counter()
    ranked = search_schedules(analysis, setting, limit)
    schedules_s = time.perf_counter() - start
    return {"joint_limit_bytes": limit, "full_shard_peak_bytes": high,
            "joint_regions_recomputed": len(recompute), "joint_search_seconds": round(once_s, 3),
            "joint_search_all_schedules_seconds": round(schedules_s, 3),
            "joint_schedule_candidates": len(ranked)}


if __name__ == "__main__":
    main()

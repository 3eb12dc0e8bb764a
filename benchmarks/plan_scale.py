"""How long the search takes on a large model: GPT-2 with 48 layers, hidden 2048, planned for
8 ranks from a profile taken on the meta device (nothing is allocated or run).

Prints one JSON line: parameter groups, graph nodes, profile seconds, and the seconds of the two
searches (which linears to split, with every k in 2, 4, 8 and every number of sharded parts as
options; then a strategy per group) and their sum (the target is at most 1 s); then the joint
search of strategies and recomputation (``docs/recomputation.md``) at a limit only
recomputation meets (halfway between the least predicted peak with every block recomputed and
the all-full_shard peak without): once (``search_plan``, the default schedule) and under every
candidate schedule (``search_schedules``, what ``compile_osdp`` runs; the target is at most 2 s).

    python benchmarks/plan_scale.py [--world-size 8] [--memory 16GiB]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osdp_fx.core.devices import Devices  # noqa: E402
from osdp_fx.core.regions import find_regions  # noqa: E402
from osdp_fx.cost_models.timeline import predict_step_memory  # noqa: E402
from osdp_fx.examples import gpt2_48_layers_meta  # noqa: E402
from osdp_fx.passes.capture import capture  # noqa: E402
from osdp_fx.planner.analysis import MEMORY_MARGIN, param_states  # noqa: E402
from osdp_fx.planner.make import analyze, choose_splits, search_strategies  # noqa: E402
from osdp_fx.planner.search import search_plan, search_schedules  # noqa: E402
from osdp_fx.units import parse_bytes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--memory", default="16GiB")
    args = parser.parse_args()
    limit = parse_bytes(args.memory)
    model, inputs = gpt2_48_layers_meta()
    captured = capture(model, inputs)
    start = time.perf_counter()
    analysis = analyze(captured, inputs, fake=True)
    profile_s = time.perf_counter() - start
    devices = Devices(world_size=args.world_size, memory_bytes=limit)
    start = time.perf_counter()
    splits = choose_splits(analysis, devices=devices, memory_limit_bytes=limit, optimizer="adamw")
    split_search_s = time.perf_counter() - start
    start = time.perf_counter()
    strategies = search_strategies(analysis, devices=devices, memory_limit_bytes=limit,
                                   optimizer="adamw")
    search_s = time.perf_counter() - start
    counts: dict[str, int] = {}
    for s in strategies.values():
        counts[s] = counts.get(s, 0) + 1
    joint = joint_search(analysis, args.world_size)
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
                                   devices=Devices(world_size=world_size),
                                   optimizer="adamw", profiled_batch=analysis.batch_size,
                                   recompute=recompute).peak_bytes

    regions = find_regions(analysis.captured.gm.graph)
    low, high = peak({r: "full" for r in regions}), peak({})
    limit = int((low + high) / 2 / (1 - MEMORY_MARGIN))
    devices = Devices(world_size=world_size, memory_bytes=limit)
    kw = dict(devices=devices, memory_limit_bytes=limit, optimizer="adamw")
    start = time.perf_counter()
    recompute = search_plan(analysis, **kw).recompute
    once_s = time.perf_counter() - start
    start = time.perf_counter()
    ranked = search_schedules(analysis, **kw)
    schedules_s = time.perf_counter() - start
    return {"joint_limit_bytes": limit, "full_shard_peak_bytes": high,
            "joint_regions_recomputed": len(recompute), "joint_search_seconds": round(once_s, 3),
            "joint_search_all_schedules_seconds": round(schedules_s, 3),
            "joint_schedule_candidates": len(ranked)}


if __name__ == "__main__":
    main()

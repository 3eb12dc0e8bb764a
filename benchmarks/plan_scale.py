"""How long the search takes on a large model: GPT-2 with 48 layers, hidden 2048, planned for
8 ranks from a profile taken on the meta device (nothing is allocated or run).

Prints one JSON line: parameter groups, graph nodes, profile seconds, and the seconds of the two
searches (which linears to split, with every k in 2, 4, 8 and every number of sharded parts as
options; then a strategy per group) and their sum (the target is at most 1 s).

    python benchmarks/plan_scale.py [--world-size 8] [--memory 16GiB]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from osdp_fx.capture import capture  # noqa: E402
from osdp_fx.devices import Devices  # noqa: E402
from osdp_fx.examples import gpt2_48_layers_meta  # noqa: E402
from osdp_fx.planner import analyze, choose_splits, search_strategies  # noqa: E402
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
    print(json.dumps({
        "parameter_groups": len(strategies), "graph_nodes": len(captured.gm.graph.nodes),
        "profile_seconds": round(profile_s, 3),
        "split_search_seconds": round(split_search_s, 3),
        "strategy_search_seconds": round(search_s, 3),
        "search_seconds": round(split_search_s + search_s, 3),
        "linears_split": len(splits), "strategies": counts,
    }))


if __name__ == "__main__":
    main()

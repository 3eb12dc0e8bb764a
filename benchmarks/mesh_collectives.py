"""The two-stage collectives of ``hierarchical`` and ``hybrid_shard`` on the clock, beside what
the step model prices them at.

Starts a world of ``--world-size`` ranks as nodes of ``--ranks-per-node`` (gloo on the CPU,
default 2 x 2: two "nodes" sharing this machine's cores), measures its links with
``detect_devices()``, and times, through the runtime's own functions, each stage alone (an
all-gather, reduce-scatter and all-reduce over a node's ranks and over the ranks of one local
index, one per node) and each strategy's gathers and reduce-scatters in their stages
(``runtime/hierarchy.py``: ``gather_shards_start``, ``reduce_scatter_shards_start``, the first
stage started and the rest run at the wait), for parameters of ``--sizes-kib``. Each call
follows a 256 x 256 matmul, as a collective follows computation in a step; the matmul's time,
timed alone in the same rounds, is subtracted. Every run is timed once per round, the runs in
turn within a round, for ``--rounds`` rounds; the median of a run's rounds is kept (the slowest
rank's). Prints, per size, measured against priced (``collective_time_s`` per stage,
``plan.collective_stages``, summed), in milliseconds.

    python benchmarks/mesh_collectives.py [--world-size 4] [--ranks-per-node 2]
        [--sizes-kib 16 256 1024] [--rounds 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from osdp_fx import detect_devices  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402

CALLS = 4
"""Calls of a collective (each after its matmul) per timed run, after one barrier."""


def timings(rank: int, world: int, ranks_per_node: int, sizes_kib: list[int],
            rounds: int) -> list[dict[str, Any]]:
    """Per size and collective: measured and priced milliseconds (module docstring)."""
    import torch.distributed as dist

    from osdp_fx.core.layout import collective_stages, mesh_group_name, mesh_shape
    from osdp_fx.cost_models.communication import collective_time_s
    from osdp_fx.planner.detect import collective_starts
    from osdp_fx.runtime.collectives import WORLD
    from osdp_fx.runtime.hierarchy import gather_shards_start, init_mesh, reduce_scatter_shards_start

    devices = detect_devices(ranks_per_node=ranks_per_node)
    init_mesh(world, ranks_per_node)
    nodes, per_node = mesh_shape(world, ranks_per_node)
    intra, inter = f"intra/{nodes}x{per_node}", f"inter/{nodes}x{per_node}"
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    cpu = torch.device("cpu")

    def priced_ms(strategy: str, numel: int, kinds: tuple[str, ...]) -> float:
        forward, backward = collective_stages(strategy, numel, 4, world_size=world,
                                              ranks_per_node=ranks_per_node, regathered=False)
        return 1e3 * sum(
            collective_time_s(st.collective, st.nbytes, devices, group_size=st.ranks,
                              spans_nodes=st.spans_nodes(devices.num_nodes))
            for st in (forward if kinds == ("all_gather",) else backward)
            if st.collective in kinds)

    def stage_ms(collective: str, nbytes: int, ranks: int, spans: bool) -> float:
        return 1e3 * collective_time_s(collective, nbytes, devices, group_size=ranks,
                                       spans_nodes=spans)

    rows = []
    for kib in sizes_kib:
        numel = kib * 1024 // 4 // world * world  # the parameter, padded to the world
        # each stage alone: over a node's ranks (the whole parameter), and over the ranks of
        # one local index (a node's block of it, across nodes)
        stages = {"node": (numel, per_node, intra, False),
                  "cross-node": (numel // per_node, nodes, inter, True)}
        runs: dict[str, tuple[Any, float]] = {}
        for where, (stage_numel, size, name, spans) in stages.items():
            for collective, start in collective_starts(stage_numel, size, name, cpu).items():
                if where == "node" and collective == "all_reduce":
                    continue  # no strategy all-reduces inside a node
                runs[f"{where} {collective.replace('_', '-')}"] = (
                    lambda start=start: start().wait(),
                    stage_ms(collective, stage_numel * 4, size, spans))
        for strategy in ("hierarchical", "hybrid_shard", "full_shard"):
            group = (mesh_group_name(strategy, world, ranks_per_node)
                     if strategy != "full_shard" else WORLD)
            chunks = numel // world if strategy != "hybrid_shard" else numel // per_node
            runs[f"{strategy} gather"] = (
                lambda g=group, c=chunks: gather_shards_start(torch.empty(c), g).wait(),
                priced_ms(strategy, numel, ("all_gather",)))
            runs[f"{strategy} gradient"] = (
                lambda g=group: reduce_scatter_shards_start(torch.empty(numel), g,
                                                            consume=True).wait(),
                priced_ms(strategy, numel, ("reduce_scatter", "all_reduce")))
        times: dict[str, list[float]] = {label: [] for label in [*runs, "matmul"]}
        bodies = {label: fn for label, (fn, _) in runs.items()}
        bodies["matmul"] = lambda: None
        for r in range(rounds + 1):  # the first round warms up
            for label, fn in bodies.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(CALLS):
                    torch.mm(a, b)
                    fn()
                if r:
                    times[label].append((time.perf_counter() - start) / CALLS)
        medians = torch.tensor([statistics.median(times[label]) for label in times])
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        matmul = float(medians[-1])
        for (label, (_, priced)), measured in zip(runs.items(), medians.tolist()):
            rows.append({"size": f"{kib} KiB", "collective": label,
                         "measured": (measured - matmul) * 1e3, "priced": priced})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    if args.ranks_per_node in (1, args.world_size) or args.world_size % args.ranks_per_node:
        parser.error("--ranks-per-node must divide --world-size into several nodes of several "
                     "ranks")
    rows = run_world(args.world_size, timings, args.ranks_per_node, args.sizes_kib,
                     args.rounds, timeout_s=600)[0]
    print("| size | collective | measured (ms) | priced (ms) | priced / measured |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['collective']} | {r['measured']:.2f} | {r['priced']:.2f} | "
              f"{r['priced'] / r['measured']:.2f} |" if r["measured"] > 0 else
              f"| {r['size']} | {r['collective']} | {r['measured']:.2f} | {r['priced']:.2f} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

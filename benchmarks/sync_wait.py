"""What a blocking collective takes after a stretch of computation, against what the step model
charges for it: its price (the link figures) and the wait for the ranks to arrive, the share
``sqrt(c / SYNC_STRETCH_S)`` of ``Devices.sync_wait_s`` after ``c`` of computation
(``overlap.sync_wait_share``, [Note: the wait after a stretch of computation] in
``osdp_fx/cost_models/overlap.py``); and the same all-gather started before the stretch (as a
prefetched gather is, right after the ranks synchronised), which the model charges its price.

    python benchmarks/sync_wait.py [--world-size 2] [--ranks-per-node N]
        [--compute-ms 0.3 2 5 10 20 40] [--runs 15]

Starts a gloo world on the CPU (one torch thread per rank) and measures its devices once
(``detect_devices()``). Per stretch, timed round-robin for ``--runs`` rounds, each run 4 calls
after a barrier: 256x256 matmuls for about that many milliseconds (the same count on every
rank, from the slowest rank's timing of one), and the same matmuls followed by a 256-byte
all-gather through the runtime's collective function, waited for. Prints per stretch each
rank's mean difference (what the all-gather took after the stretch), the slowest rank's, and
the model's charge: the all-gather's price plus its share of ``sync_wait_s``. Then, timed in
the same rounds, the all-gather started before the matmuls and waited for after them: the
slowest rank's time over the matmuls alone; and when such an all-gather completes, polled
between the matmuls (the slowest rank's median of the runs, each run one call, against the
median of the all-gather alone).

With ``--ranks-per-node`` on several nodes (``--world-size 4 --ranks-per-node 2``), a third
table times ``hierarchical``'s two-stage gather of the same bytes started before the matmuls
(as a prefetched gather is) beside the flat one started so, in the same rounds: the two-stage
gather runs its second stage, over a node's ranks, when it is waited for, after the ranks
drifted apart, and the model charges that stage's price and ``overlap.group_wait_ratio`` of the
wait for the ranks after the stretch. Run it with nothing else running.
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

from osdp_fx.cost_models.overlap import group_wait_ratio, sync_wait_share  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402

CALLS = 4
"""Calls per timed run, after one barrier (as ``detect_devices`` times its collectives)."""
GATHER_BYTES = 256


def measure(rank: int, world: int, compute_ms: list[float], runs: int,
            ranks_per_node: int | None = None) -> dict[str, Any]:
    """This rank's mean time of the all-gather after each stretch (module docstring), and the
    model's figures."""
    import torch.distributed as dist

    from osdp_fx import detect_devices
    from osdp_fx.core.layout import collective_stages, mesh_group_name
    from osdp_fx.cost_models.communication import collective_time_s
    from osdp_fx.runtime.collectives import WORLD, all_gather_flat_start
    from osdp_fx.runtime.hierarchy import gather_shards_start, init_mesh

    torch.set_num_threads(1)
    devices = detect_devices(ranks_per_node=ranks_per_node)
    two_stage = ranks_per_node is not None and 1 < ranks_per_node < world
    if two_stage:
        init_mesh(world, ranks_per_node)
        mesh = mesh_group_name("hierarchical", world, ranks_per_node)
    shard = torch.zeros(GATHER_BYTES // 4 // world)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    per_mm = torch.tensor((time.perf_counter() - start) / 20, dtype=torch.float64)
    dist.all_reduce(per_mm, op=dist.ReduceOp.MAX)  # the same work on every rank, as in a step
    after: dict[float, float] = {}
    started_before: dict[float, float] = {}
    staged: dict[float, float] = {}
    completed: dict[float, float] = {}
    for ms in compute_ms:
        count = max(1, round(ms / 1e3 / float(per_mm)))

        def compute(count: int = count) -> None:
            for _ in range(count):
                a @ b

        def then_gather() -> None:
            compute()
            all_gather_flat_start(shard, WORLD).wait()

        def beside(count: int = count) -> None:
            pending = all_gather_flat_start(shard, WORLD)
            compute(count)
            pending.wait()

        def staged_beside(count: int = count) -> None:
            pending = gather_shards_start(shard, mesh)
            compute(count)
            pending.wait()

        bodies = [("compute", compute), ("gather", then_gather), ("beside", beside)]
        if two_stage:
            bodies.append(("staged", staged_beside))
        times: dict[str, list[float]] = {key: [] for key, _ in bodies}
        for _ in range(runs + 1):  # the first round warms up
            for key, body in bodies:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    body()
                times[key].append((time.perf_counter() - t0) / CALLS)
        alone = statistics.mean(times["compute"][1:])
        after[ms] = statistics.mean(times["gather"][1:]) - alone
        started_before[ms] = statistics.mean(times["beside"][1:]) - alone
        if two_stage:
            staged[ms] = statistics.mean(times["staged"][1:]) - alone
        completed[ms] = _completion_s(shard, a, b, count, runs)
    price = collective_time_s("all_gather", GATHER_BYTES, devices)
    stages = [st for st in collective_stages("hierarchical", GATHER_BYTES // 4, 4,
                                             world_size=world, ranks_per_node=ranks_per_node)[0]
              if st.collective == "all_gather"] if two_stage else []
    return {"after": after, "before": started_before, "completed": completed,
            "alone": _completion_s(shard, a, b, 0, runs), "price": price,
            "sync_wait_s": devices.sync_wait_s, "staged": staged,
            "stage_prices": [collective_time_s(st.collective, st.nbytes, devices,
                                               group_size=st.ranks,
                                               spans_nodes=st.spans_nodes(devices.num_nodes))
                             for st in stages],
            "stage_ranks": [st.ranks for st in stages]}


def _completion_s(shard: torch.Tensor, a: torch.Tensor, b: torch.Tensor, count: int,
                  runs: int) -> float:
    """The median over ``runs`` runs (after a barrier each) of the time from starting an
    all-gather of ``shard`` to its completion, polled between up to ``count`` matmuls run
    meanwhile (then waited for; ``count`` 0: waited for at once)."""
    import torch.distributed as dist

    out = torch.empty(shard.numel() * dist.get_world_size())
    ends = []
    for _ in range(runs + 1):
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_gather_into_tensor(out, shard, async_op=True)
        for _ in range(count):
            if work.is_completed():
                break
            a @ b
        work.wait()
        ends.append(time.perf_counter() - t0)
    return statistics.median(ends[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, nargs="+",
                        default=[0.3, 2, 5, 10, 20, 40])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per node (default: one node); on several nodes the "
                             "two-stage gather is timed too")
    args = parser.parse_args()
    results: list[dict[str, Any]] = run_world(args.world_size, measure, args.compute_ms,
                                              args.runs, args.ranks_per_node)
    first = results[0]
    print(f"world {args.world_size}, {args.runs} rounds per stretch; a {GATHER_BYTES}-byte "
          f"all-gather after a stretch of matmuls, ms; its price {first['price'] * 1e3:.2f}, "
          f"sync_wait_s {first['sync_wait_s'] * 1e3:.2f} (detect_devices())\n")
    ranks = " | ".join(f"rank {r}" for r in range(args.world_size))
    print(f"| computation before it, ms | {ranks} | the slowest rank | the model's charge |")
    print("|---:|" + "---:|" * (args.world_size + 2))
    for ms in args.compute_ms:
        cells = " | ".join(f"{r['after'][ms] * 1e3:.2f}" for r in results)
        slowest = max(r["after"][ms] for r in results)
        charge = first["price"] + sync_wait_share(ms / 1e3) * first["sync_wait_s"]
        print(f"| {ms:g} | {cells} | {slowest * 1e3:.2f} | {charge * 1e3:.2f} |")
    print(f"\nThe same all-gather started before the matmuls, waited for after them (the "
          f"slowest rank's time over the matmuls alone; the model charges its price, "
          f"{first['price'] * 1e3:.2f}), and when it completes (the slowest rank's median; "
          f"alone, waited for at once: {max(r['alone'] for r in results) * 1e3:.2f}), ms\n")
    print("| computation after its start, ms | started before it: what it adds | "
          "completed after |")
    print("|---:|---:|---:|")
    for ms in args.compute_ms:
        print(f"| {ms:g} | {max(r['before'][ms] for r in results) * 1e3:.2f} | "
              f"{max(r['completed'][ms] for r in results) * 1e3:.2f} |")
    if first["staged"]:
        _print_staged(results, args.compute_ms, args.world_size)


def _print_staged(results: list[dict[str, Any]], compute_ms: list[float], world: int) -> None:
    """The third table (module docstring): the two-stage gather started before the stretch
    against the flat one, the slowest rank's, beside the model's charge for each."""
    first = results[0]
    later_price = sum(first["stage_prices"][1:])
    ratio = group_wait_ratio(first["stage_ranks"][1], world)
    print(f"\n`hierarchical`'s gather of the same bytes started before the matmuls, waited for "
          f"after them, beside the flat one (the slowest rank's time over the matmuls alone); "
          f"the model charges the flat one its price, {first['price'] * 1e3:.2f}, and the "
          f"two-stage one its stages' prices, {sum(first['stage_prices']) * 1e3:.2f}, and "
          f"{ratio:.2f} of the wait for the ranks after the stretch, ms\n")
    print("| computation after its start, ms | flat | two-stage | two-stage less flat | "
          "the model: second stage and its wait |")
    print("|---:|---:|---:|---:|---:|")
    for ms in compute_ms:
        flat = max(r["before"][ms] for r in results)
        two = max(r["staged"][ms] for r in results)
        charge = later_price + ratio * sync_wait_share(ms / 1e3) * first["sync_wait_s"]
        print(f"| {ms:g} | {flat * 1e3:.2f} | {two * 1e3:.2f} | {(two - flat) * 1e3:.2f} | "
              f"{charge * 1e3:.2f} |")


if __name__ == "__main__":
    main()

"""How long a blocking collective waits for the other ranks after a stretch of computation:
the wait a plan pays at each collective it blocks on in the middle of a step (a sharded
group's all-gather in forward, its re-gather in backward), which the step model does not
charge ("What a mixed plan costs beyond its collectives" in ``docs/benchmarks.md``).

    python benchmarks/sync_wait.py [--world-size 2] [--compute-ms 0 2 5 10 20 40] [--runs 40]

Per stretch: every rank passes a barrier, multiplies 256x256 matrices for about that many
milliseconds (the same count on every rank, from the slowest rank's timing of one), then
all-gathers 256 bytes through the runtime's collective function and waits for it. Prints, per
stretch, each rank's median and mean wait over ``--runs`` runs and the mean over the runs of
the longest wait among the ranks; on the CPU, one torch thread per rank. Run it with nothing
else running.
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

from osdp_fx.runtime.launch import run_world  # noqa: E402


def waits(rank: int, world: int, compute_ms: list[float], runs: int) -> dict[float, list[float]]:
    """Per stretch, this rank's wait in seconds for each run (module docstring)."""
    import torch.distributed as dist

    from osdp_fx.runtime.collectives import WORLD, all_gather_flat_start

    torch.set_num_threads(1)
    shard = torch.zeros(64)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    per_mm = torch.tensor((time.perf_counter() - start) / 20, dtype=torch.float64)
    dist.all_reduce(per_mm, op=dist.ReduceOp.MAX)  # the same work on every rank, as in a step
    out: dict[float, list[float]] = {}
    for ms in compute_ms:
        count = int(ms / 1e3 / float(per_mm))
        out[ms] = []
        for _ in range(runs):
            dist.barrier()
            for _ in range(count):
                a @ b
            t0 = time.perf_counter()
            all_gather_flat_start(shard, WORLD).wait()
            out[ms].append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[0, 2, 5, 10, 20, 40])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    results: list[Any] = run_world(args.world_size, waits, args.compute_ms, args.runs)
    print(f"world {args.world_size}, {args.runs} runs per stretch; the wait of a 256-byte "
          "all-gather, ms\n")
    ranks = " | ".join(f"rank {r}: median / mean" for r in range(args.world_size))
    print(f"| computation before it, ms | {ranks} | the longest wait, mean |")
    print("|---:|" + "---:|" * (args.world_size + 1))
    for ms in args.compute_ms:
        cells = " | ".join(f"{statistics.median(r[ms]) * 1e3:.2f} / "
                           f"{statistics.mean(r[ms]) * 1e3:.2f}" for r in results)
        longest = statistics.mean(max(run) for run in zip(*(r[ms] for r in results)))
        print(f"| {ms:g} | {cells} | {longest * 1e3:.2f} |")


if __name__ == "__main__":
    main()

"""Collectives alone and two at once, through the runtime's collective functions: what a step
gains when its collectives are in flight together (backward's re-gathers beside the
reduce-scatters in flight, ``Schedule.scatters_in_flight``), which the step model's
communication lane, one collective at a time, does not count.

    python benchmarks/concurrent_collectives.py [--world-size 2] [--sizes-mib 1 4]

Per size: the median over 15 runs (after 2 warmups, each after a barrier) of an all-gather
(AG) and a reduce-scatter (RS) alone, one after the other, and two started together and then
waited for. gloo on the CPU, NCCL on a GPU; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from osdp_fx.runtime.launch import run_world  # noqa: E402
from timing import median_s  # noqa: E402

RUNS = 15


def timings(rank: int, world: int, sizes_mib: list[int]) -> list[dict[str, Any]]:
    """Per size, milliseconds of each way of running the collectives (module docstring)."""
    import torch.distributed as dist

    from osdp_fx.runtime.collectives import (
        WORLD,
        all_gather_flat_start,
        reduce_scatter_flat_start,
    )

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    def median_ms(fn: Any) -> float:
        return median_s(fn, device, runs=RUNS, warmup=2, before=dist.barrier) * 1e3

    rows = []
    for mib in sizes_mib:
        numel = mib * 2**20 // 4 // world * world
        shard = torch.zeros(numel // world, device=device)

        def ag() -> Any:
            return all_gather_flat_start(shard, WORLD)

        def rs() -> Any:
            return reduce_scatter_flat_start(torch.zeros(numel, device=device), WORLD,
                                             consume=True)

        rows.append({
            "size": f"{mib} MiB",
            "AG": median_ms(lambda: ag().wait()),
            "RS": median_ms(lambda: rs().wait()),
            "AG then RS": median_ms(lambda: (ag().wait(), rs().wait())),
            "AG with RS": median_ms(lambda: [p.wait() for p in (ag(), rs())]),
            "AG then AG": median_ms(lambda: (ag().wait(), ag().wait())),
            "AG with AG": median_ms(lambda: [p.wait() for p in (ag(), ag())]),
            "RS with RS": median_ms(lambda: [p.wait() for p in (rs(), rs())]),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = run_world(args.world_size, timings, args.sizes_mib, backend=backend,
                     timeout_s=600)[0]
    columns = [c for c in rows[0] if c != "size"]
    print("| size | " + " | ".join(f"{c} (ms)" for c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row['size']} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

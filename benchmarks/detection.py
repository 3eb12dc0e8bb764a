"""How steady ``detect_devices()`` is: several calls in one world, and what each call's figures
predict for a few collectives and for the runtime's host time.

Each call's figures price an all-gather, a reduce-scatter and an all-reduce over the whole
world at 64 KiB, 1 MiB and 4 MiB (``cost_models/communication.py``'s ``collective_time_s``),
beside the host probe's figures (``Devices.param_host_time_s`` and
``Devices.bucket_host_time_s`` under ``full_shard``), the ratio of two collectives in flight
together (``Devices.concurrent_collective_ratio``, and by size: ``Devices.
concurrent_collective_ratios``, "together 64K" ...), the share of a collective's time hidden
under computation that hiding saves (``Devices.overlap_efficiency``: "overlap"), the wait of a
blocking collective after a stretch of computation (``Devices.sync_wait_s``), the matmul rate
and the call's own seconds. The last row is each column's largest over its smallest: how far
two calls a minute apart can disagree.

A second table checks the last call against the collectives themselves: each collective of
``CHECKED_SIZES`` (1 to 16 MiB, past the largest size the fit saw at 4 MiB and at it) timed
directly through the runtime's collective functions, the median of ``CHECK_RUNS`` runs, each
after a barrier and a short matmul (as ``detect_devices()`` times them), against its price
(``collective_time_s``: on the polyline through the call's timed sizes).

A third table checks it against the collectives as a step of their size runs them: for each of
``LOOPED_SIZES``, an all-gather and a reduce-scatter each run ``LOOP_LINKS`` times in a loop,
each time after about ``LOOP_COMPUTE_S`` of matmuls, less the matmuls alone, timed
interleaved (as ``detect_devices()`` times its collectives, ``LOOP_ROUNDS`` rounds, the
slowest rank's), per collective; beside its price and its price plus the wait for the ranks
the step model charges after that much computation (``overlap.sync_wait_share``).

    python benchmarks/detection.py [--world-size 2] [--ranks-per-node N] [--repeats 5]

gloo on the CPU, NCCL on a GPU; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from osdp_fx.runtime.launch import run_world  # noqa: E402
from timing import median_s  # noqa: E402

SIZES = ((64 << 10, "64K"), (1 << 20, "1M"), (4 << 20, "4M"))
COLLECTIVES = (("all_gather", "AG"), ("reduce_scatter", "RS"), ("all_reduce", "AR"))
CHECKED_SIZES = (1, 4, 8, 12, 16)
"""MiB of the collectives timed directly against the last call's prediction."""
CHECK_RUNS = 10
LOOPED_SIZES = (1, 4)
"""MiB of the collectives timed in a loop of computation (the third table)."""
LOOP_LINKS = 10
"""Collectives (each after its computation) in one run of the loop."""
LOOP_COMPUTE_S = 1e-3
"""Seconds of matmuls before each collective of the loop."""
LOOP_ROUNDS = 9
"""Timed rounds of the loops, interleaved with the matmuls alone."""


def calls(rank: int, world: int, repeats: int, ranks_per_node: int,
          ) -> tuple[list[dict[str, float]], list[dict[str, float]], list[dict[str, float]]]:
    """``repeats`` calls of ``detect_devices()`` on this rank, each as a row of figures, and
    the last call's predictions against collectives timed directly (:func:`checked`) and in a
    loop of computation (:func:`looped`)."""
    from osdp_fx import detect_devices
    from osdp_fx.cost_models.communication import collective_time_s

    rows = []
    devices = None
    for _ in range(repeats):
        start = time.perf_counter()
        devices = detect_devices(ranks_per_node=ranks_per_node)
        row: dict[str, float] = {"seconds": time.perf_counter() - start}
        for collective, short in COLLECTIVES:
            for nbytes, label in SIZES:
                row[f"{short} {label} (ms)"] = collective_time_s(collective, nbytes,
                                                                  devices) * 1e3
        row["host/param (us)"] = devices.param_host_time_s["full_shard"] * 1e6
        row["host/bucket (us)"] = devices.bucket_host_time_s["full_shard"] * 1e6
        row["together"] = devices.concurrent_collective_ratio
        table = devices.concurrent_collective_ratios
        for nbytes, r in zip(table.get("total_bytes", []), table.get("ratios", [])):
            row[f"together {_label(nbytes)}"] = r
        row["overlap"] = devices.overlap_efficiency
        row["sync wait (ms)"] = devices.sync_wait_s * 1e3
        row["GFLOP/s"] = devices.compute_flops_per_s / 1e9
        rows.append(row)
    return rows, checked(devices, world), looped(devices, world)


def _label(nbytes: int) -> str:
    """A size as the tables print it: 64K, 1M."""
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"


def checked(devices: Any, world: int) -> list[dict[str, float]]:
    """Per size of :data:`CHECKED_SIZES`, each collective over the world timed directly
    (module docstring) and as ``devices`` predicts it, in milliseconds."""
    import torch.distributed as dist

    from osdp_fx.cost_models.communication import collective_time_s
    from osdp_fx.planner.detect import collective_runs, filler_operands
    from osdp_fx.runtime.collectives import WORLD

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    a, b = filler_operands(device)

    def before() -> None:
        dist.barrier()
        torch.mm(a, b)

    rows = []
    for mib in CHECKED_SIZES:
        numel = mib * 2**20 // 4 // world * world
        runs = collective_runs(numel, world, WORLD, device)
        row: dict[str, float] = {"MiB": float(mib)}
        for collective, short in COLLECTIVES:
            row[f"{short} timed (ms)"] = median_s(runs[collective], device, runs=CHECK_RUNS,
                                                  warmup=2, before=before) * 1e3
            row[f"{short} predicted (ms)"] = collective_time_s(collective, numel * 4,
                                                               devices) * 1e3
        rows.append(row)
    return rows


def looped(devices: Any, world: int) -> list[dict[str, float]]:
    """Per size of :data:`LOOPED_SIZES` and collective, its time in a loop of computation
    (module docstring) against what ``devices`` predicts, in milliseconds."""
    import torch.distributed as dist

    from osdp_fx.cost_models.communication import collective_time_s
    from osdp_fx.cost_models.overlap import sync_wait_share
    from osdp_fx.planner.detect import (
        _all_reduce_floats,
        _interleaved_times_s,
        collective_starts,
        filler_operands,
    )
    from osdp_fx.runtime.collectives import WORLD

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    a, b = filler_operands(device)
    matmul_s = median_s(lambda: torch.mm(a, b), device, runs=CHECK_RUNS, warmup=2)
    count = max(1, round(_all_reduce_floats([LOOP_COMPUTE_S / matmul_s], "max", None, device,
                                            True)[0]))

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, b)

    def loop(start: Any) -> Any:
        def run() -> None:
            for _ in range(LOOP_LINKS):
                compute()
                start().wait()
        return run

    def computes() -> None:
        for _ in range(LOOP_LINKS):
            compute()

    keys, runs = [], []
    for mib in LOOPED_SIZES:
        numel = mib * 2**20 // 4 // world * world
        starts = collective_starts(numel, world, WORLD, device)
        for collective, short in COLLECTIVES[:2]:
            keys.append((collective, short, mib, numel * 4))
            runs.append(loop(starts[collective]))
    times = _interleaved_times_s([*runs, computes], device, barrier=dist.barrier,
                                 rounds=LOOP_ROUNDS, calls=[1] * (len(runs) + 1))
    *times, alone = _all_reduce_floats(times, "max", None, device, True)
    wait = devices.sync_wait_s * sync_wait_share(LOOP_COMPUTE_S)
    rows = []
    for (collective, short, mib, nbytes), t in zip(keys, times):
        price = collective_time_s(collective, nbytes, devices)
        rows.append({"collective": short, "MiB": float(mib),
                     "in a loop (ms)": (t - alone) / LOOP_LINKS * 1e3,
                     "predicted (ms)": price * 1e3,
                     "predicted with the wait (ms)": (price + wait) * 1e3})
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    """``rows`` as a markdown table, numbers to two decimals."""
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(row[c] if isinstance(row[c], str) else f"{row[c]:.2f}"
                                for c in columns) + " |")


def table(rows: list[dict[str, Any]]) -> str:
    """The calls as a markdown table, and each column's largest over its smallest."""
    def spread(column: str) -> float:
        low, high = min(r[column] for r in rows), max(r[column] for r in rows)
        return high / low if low > 0 else (1.0 if high == 0 else float("inf"))

    columns = list(rows[0])
    lines = ["| call | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for i, row in enumerate(rows):
        lines.append(f"| {i + 1} | " + " | ".join(f"{row[c]:.2f}" for c in columns) + " |")
    lines.append("| largest / smallest | " + " | ".join(f"{spread(c):.2f}x" for c in columns)
                 + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows, check, loop = run_world(args.world_size, calls, args.repeats,
                                  args.ranks_per_node or args.world_size, backend=backend,
                                  timeout_s=1800)[0]
    print(table(rows))
    print()
    _print_rows(check)
    print()
    _print_rows(loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())

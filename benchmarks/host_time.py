"""The runtime's own host time per parameter and step, by strategy: ``detect_devices``'s host
probe (``osdp_fx/planner/host_probe.py``) run alone, several times.

The probe runs the runtime's functions on a chain of small matmuls whose weights are gathered
in one bucket, at 8 and at 40 parameters, forward and backward; the slope, less the same
chain's over plain tensors, is one parameter's host time per step. What it measures is the
runtime's work per parameter (copies into and out of the bucket's buffers, gradient views, the
re-gather's handles), which is what changes when the runtime does.

    python benchmarks/host_time.py [--world-size 1] [--repeats 3]

Prints one row per repeat (microseconds per parameter and step under ``replicate``,
``shard_grad_op`` and ``full_shard``) and the median row; gloo on the CPU, NCCL on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from osdp_fx.runtime.launch import run_world  # noqa: E402
from timing import median_s  # noqa: E402

STRATEGIES = ("replicate", "shard_grad_op", "full_shard")


def _times(device: torch.device) -> Any:
    """Each run's median time, the runs one after the other (``detect_devices`` interleaves
    them round by round)."""
    return lambda runs: [median_s(fn, device) for fn in runs]


def probe(rank: int, world: int, repeats: int) -> list[dict[str, float]]:
    """``repeats`` runs of the probe on this rank: seconds per parameter by strategy."""
    from osdp_fx.planner.host_probe import runtime_host_times

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return [runtime_host_times(_times(device), world_size=world, rank=rank,
                               device=device).param_s for _ in range(repeats)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = run_world(args.world_size, probe, args.repeats, backend=backend, timeout_s=600)[0]
    print("| run | " + " | ".join(f"{s} (us)" for s in STRATEGIES) + " |")
    print("|---|" + "---|" * len(STRATEGIES))
    for i, row in enumerate(rows):
        print(f"| {i + 1} | " + " | ".join(f"{row[s] * 1e6:.1f}" for s in STRATEGIES) + " |")
    print("| median | " + " | ".join(
        f"{statistics.median(r[s] for r in rows) * 1e6:.1f}" for s in STRATEGIES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

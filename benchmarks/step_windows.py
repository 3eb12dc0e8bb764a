"""How far a short timing of a step lies from a long one on this machine: what the profile's
whole-graph timing (``passes/profile.py``, ``WHOLE_GRAPH_SECONDS``) is up against.

Starts a gloo world of ``--world-size`` ranks (one torch thread each) and times the plain
model of ``prediction_accuracy.py`` (``--model``: mlp, gpt or hf_gpt2; no osdp-fx, no
collectives), forward and backward, step after step for ``--seconds``, every rank running
each step at once (a barrier before each), as the profile times the whole graph. The steps
are cut into windows of ``--short`` steps and into windows of about ``--long-seconds``
seconds; each window's median (the slowest rank's) is divided by the median of all steps.
Prints, per kind of window, how many there were and the 5th, 50th and 95th percentile, the
least and the most of that ratio: how far a timing of that length can miss the machine's
speed over the whole run.

    python benchmarks/step_windows.py [--model gpt] [--world-size 4] [--seconds 60]
        [--short 5] [--long-seconds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from osdp_fx.runtime.launch import run_world  # noqa: E402


def step_times(rank: int, world: int, model: str, seconds: float) -> list[float]:
    """Every step's time over ``seconds``, the slowest rank's (module docstring)."""
    import torch.distributed as dist

    from prediction_accuracy import build

    torch.set_num_threads(1)
    plain, inputs = build(model)

    def step() -> None:
        plain(*inputs).backward()
        for p in plain.parameters():
            p.grad = None

    for _ in range(3):
        step()
    times: list[float] = []
    end = time.perf_counter() + seconds
    going = torch.ones(1)
    while going.item():
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        going.fill_(float(time.perf_counter() < end))
        dist.all_reduce(going, op=dist.ReduceOp.MIN)  # every rank stops after the same step
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def window_ratios(times: list[float], size: int) -> list[float]:
    """The median of each window of ``size`` consecutive steps over the median of all."""
    whole = statistics.median(times)
    return [statistics.median(times[i:i + size]) / whole
            for i in range(0, len(times) - size + 1, size)]


def summary(ratios: list[float]) -> dict[str, Any]:
    ordered = sorted(ratios)
    n = len(ordered)
    return {"windows": n, "p5": ordered[int(0.05 * (n - 1))], "p50": statistics.median(ordered),
            "p95": ordered[int(round(0.95 * (n - 1)))], "least": ordered[0], "most": ordered[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=("mlp", "gpt", "hf_gpt2"))
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--short", type=int, default=5, help="steps in a short window")
    parser.add_argument("--long-seconds", type=float, default=2.0,
                        help="seconds of steps in a long window")
    args = parser.parse_args()
    times = run_world(args.world_size, step_times, args.model, args.seconds)[0]
    median_s = statistics.median(times)
    long_steps = max(args.short, round(args.long_seconds / median_s))
    print(f"{args.model}, world {args.world_size}: {len(times)} steps in {sum(times):.1f} s, "
          f"median {median_s * 1e3:.1f} ms")
    print()
    print("| window | windows | p5 | p50 | p95 | least | most |")
    print("|---|---|---|---|---|---|---|")
    for label, size in ((f"{args.short} steps", args.short),
                        (f"{long_steps} steps (about {args.long_seconds:g} s)", long_steps)):
        ratios = window_ratios(times, size)
        if not ratios:
            print(f"| {label} | 0 (fewer steps than a window) | | | | | |")
            continue
        s = summary(ratios)
        print(f"| {label} | {s['windows']} | {s['p5']:.2f} | {s['p50']:.2f} | {s['p95']:.2f} "
              f"| {s['least']:.2f} | {s['most']:.2f} |")


if __name__ == "__main__":
    main()

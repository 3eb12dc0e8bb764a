"""Does splitting linears change what a graph computes, in time? The searched plan's split
graph against the unsplit one, profiled apart and timed whole in the same rounds.

Starts a gloo world on the CPU (``--world-size`` ranks, one thread each, nodes of
``--ranks-per-node`` ranks) and, per model of ``prediction_accuracy.py`` (``--models``), takes
the linears that the search splits under the limit that benchmark searches at (halfway between
the ``full_shard`` and ``replicate`` peaks, with ``detect_devices()``). It then captures the
model twice, once as it is and once with those splits, and for each graph prints

- its computation as the profile makes it when the graph is profiled on its own (``analyze``:
  the forward and backward node times, scaled to the whole graph timed at that moment), as the
  search priced the split graph before its computation was taken from the unsplit one
  ([Note: the split graph's computation] in ``osdp_fx/planner/make.py``);
- its forward and backward timed whole, the two graphs in turn within each of ``--rounds``
  rounds of ``--runs`` runs (every rank running each run at once, a barrier before each; the
  median over the rounds, the slowest rank's), so that the machine's speed falls on both alike.

The split graph's time over the unsplit one's, in each column, is what the split changes of
the computation (the second column) and what two snapshots of the machine differ by beside it
(the first).

``--splits NAME=PARTS ...`` times those splits of one model instead of the searched plan's.

    python benchmarks/split_cost.py [--models mlp gpt] [--world-size 4] [--ranks-per-node 2]
        [--rounds 12] [--runs 5] [--splits mlp.layers.1.weight=2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from osdp_fx import compile_osdp, detect_devices  # noqa: E402
from osdp_fx.passes.capture import capture  # noqa: E402
from osdp_fx.passes.profile import summarize_profile  # noqa: E402
from osdp_fx.passes.split_linear import apply_splits  # noqa: E402
from osdp_fx.planner.analysis import analyze  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402


def searched_splits(name: str, devices: Any) -> dict[str, int]:
    """The splits of the plan searched as ``prediction_accuracy.py`` searches it."""
    from prediction_accuracy import build

    peaks = {}
    for plan in ("replicate", "full_shard"):
        model, inputs = build(name)
        peaks[plan] = compile_osdp(model, inputs, devices, plan=plan, optimizer="sgd",
                                   plan_cache=False).plan.peak_memory_bytes
    model, inputs = build(name)
    searched = compile_osdp(model, inputs, devices, optimizer="sgd", plan_cache=False,
                            memory_limit=(peaks["replicate"] + peaks["full_shard"]) // 2)
    return dict(searched.plan.splits)


def whole_graph_run(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> Callable[[], None]:
    """One forward and backward of ``gm`` to its trainable parameters, as the profile times
    the whole graph."""
    leaves = [p for p in gm.parameters() if p.requires_grad]

    def run() -> None:
        with torch.enable_grad():
            out = gm(*inputs)
        outs = [t for t in (out if isinstance(out, (list, tuple)) else [out])
                if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.autograd.grad(outs, leaves, [torch.ones_like(t) for t in outs],
                            allow_unused=True)
    return run


def measure(rank: int, world: int, models: list[str], ranks_per_node: int, rounds: int,
            runs: int, given: dict[str, int]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from prediction_accuracy import build

    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    devices = None if given else detect_devices(ranks_per_node=ranks_per_node)
    rows = []
    for name in models:
        splits = given or searched_splits(name, devices)
        if not splits:
            rows.append({"model": name, "splits": {}})
            continue
        apart, graphs = {}, {}
        for label, chosen in (("unsplit", {}), ("split", splits)):
            model, inputs = build(name)
            captured = capture(model, inputs)
            apply_splits(captured, chosen)
            analyze(captured, inputs)  # the profile the search priced the graph on
            summary = summarize_profile(captured.gm)
            apart[label] = summary.fwd_time_s + summary.bwd_time_s
            graphs[label] = whole_graph_run(captured.gm, inputs)
        times: dict[str, list[float]] = {label: [] for label in graphs}
        for r in range(rounds + 1):  # the first round warms up
            for label, run in graphs.items():
                for _ in range(runs):
                    dist.barrier()
                    start = time.perf_counter()
                    run()
                    if r:
                        times[label].append(time.perf_counter() - start)
        together = torch.tensor([statistics.median(times[label]) for label in graphs])
        dist.all_reduce(together, op=dist.ReduceOp.MAX)
        rows.append({"model": name, "splits": splits, "apart_s": apart,
                     "together_s": dict(zip(graphs, together.tolist()))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"],
                        choices=["mlp", "gpt", "hf_gpt2"])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per (pretended) node (default: half the world)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--splits", nargs="+", default=[], metavar="NAME=PARTS",
                        help="time these splits (one model) instead of the searched plan's")
    args = parser.parse_args()
    given = {name: int(parts) for name, parts in (s.split("=") for s in args.splits)}
    if given and len(args.models) != 1:
        parser.error("--splits names the linears of one model: give one in --models")
    per_node = args.ranks_per_node or max(1, args.world_size // 2)
    rows = run_world(args.world_size, measure, args.models, per_node, args.rounds,
                     args.runs, given)[0]
    print(f"world {args.world_size} ({per_node} ranks per node), {args.rounds} rounds of "
          f"{args.runs} runs; forward + backward, ms\n")
    print("| model | splits | profiled apart: unsplit | split | split / unsplit "
          "| timed together: unsplit | split | split / unsplit |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        if not row["splits"]:
            print(f"| {row['model']} | none | | | | | | |")
            continue
        splits = ", ".join(f"{k} x{v}" for k, v in sorted(row["splits"].items()))
        cells = []
        for column in ("apart_s", "together_s"):
            unsplit, split = row[column]["unsplit"], row[column]["split"]
            cells += [f"{unsplit * 1e3:.1f}", f"{split * 1e3:.1f}", f"{split / unsplit:.3f}"]
        print(f"| {row['model']} | {splits} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

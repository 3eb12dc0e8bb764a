"""Collectives in flight together inside a training step: what running them side by side saves
in a real step, against what the step model credits for it ([Note: collectives together] in
``cost_models/overlap.py``).

Starts a gloo world on the CPU (``--world-size`` ranks, one thread each; at world 4 two
pretended nodes of 2) and compiles the model of ``prediction_accuracy.py`` (``--model``) under
two pairs of plans, each pair timed round-robin (``--rounds`` rounds of ``--steps`` steps, the
slowest rank's median):

- **the reduce-scatters beside the all-reduce**: the plan searched under
  ``prediction_accuracy.py``'s limit (a mixed plan: some groups sharded, the rest replicated),
  run as the runtime runs it (the replicated gradients' all-reduce started while the sharded
  gradients' reduce-scatters are in flight) and with the all-reduce started only after those
  reduce-scatters completed (the benchmark waits for them first, an experiment no plan
  makes). Predicted: the plan's step under the ``detect_devices()`` of the world, and under
  the same devices with ``concurrent_collective_ratio`` 1 (nothing saved by collectives in
  flight together), so the difference is what the model credits them;
- **two reduce-scatters in flight against one**: ``full_shard`` with
  ``Schedule.scatters_in_flight`` 2 (the default) and 1, each predicted under its own schedule;
  and the same in 64 KiB gather buckets (``prediction_accuracy.py``'s bucket plan: many small
  collectives).

Prints per pair both steps, predicted and measured, and what the first saves over the second.

    python benchmarks/collectives_in_step.py [--model mlp] [--world-size 4] [--rounds 10]
        [--steps 5]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from osdp_fx import compile_osdp, detect_devices  # noqa: E402
from osdp_fx.core.buckets import Schedule  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402


@contextlib.contextmanager
def all_reduce_after_scatters(on: list[bool]) -> Iterator[None]:
    """While ``on[0]``, the reducer starts each all-reduce only after every reduce-scatter the
    step started before it has completed; otherwise as the runtime runs it."""
    import osdp_fx.runtime.collectives as collectives
    import osdp_fx.runtime.reducer as reducer

    started: list[Any] = []
    init, start = collectives._ChunkPending.__init__, reducer.all_reduce_sum_start

    def remembered(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        started.append(self)

    def after_scatters(tensor: torch.Tensor, group: str) -> Any:
        if on[0]:
            for pending in started:
                if pending._work is not None:
                    pending._work.wait()
        started.clear()
        return start(tensor, group)

    collectives._ChunkPending.__init__ = remembered
    reducer.all_reduce_sum_start = after_scatters
    try:
        yield
    finally:
        collectives._ChunkPending.__init__ = init
        reducer.all_reduce_sum_start = start


def _medians_s(cases: dict[str, tuple[Any, tuple[Any, ...], Any]], rounds: int,
               steps: int, before: dict[str, Any]) -> dict[str, float]:
    """Each case's median step (the slowest rank's), the cases in turn within a round after a
    warm-up round; ``before[label]()`` runs before the case's steps."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {label: [] for label in cases}
    for r in range(rounds + 1):
        for label, (compiled, inputs, opt) in cases.items():
            before[label]()
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                compiled(*inputs).backward()
                opt.step()
                elapsed = time.perf_counter() - start
                opt.zero_grad(set_to_none=True)
                if r:
                    times[label].append(elapsed)
    medians = torch.tensor([statistics.median(times[label]) for label in cases])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(cases, medians.tolist()))


def measure(rank: int, world: int, model_name: str, rounds: int, steps: int,
            ranks_per_node: int, directory: str) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from prediction_accuracy import build

    torch.set_num_threads(1)
    devices = detect_devices(ranks_per_node=ranks_per_node)
    apart = dataclasses.replace(devices, concurrent_collective_ratio=1.0,
                                concurrent_collective_ratios={})

    def compiled(plan: Any, on: Any = devices, **kw: Any) -> Any:
        model, inputs = build(model_name)
        module = compile_osdp(model, inputs, on, plan=plan, optimizer="sgd", plan_cache=False,
                              **kw)
        return module, inputs, torch.optim.SGD(module.parameters(), lr=1e-3)

    def saved(plan: Any, name: str) -> str:
        path = Path(directory) / name
        if rank == 0:
            plan.save(path)
        dist.barrier()
        return str(path)

    full = compiled("full_shard")
    limit = (compiled("replicate")[0].plan.peak_memory_bytes
             + full[0].plan.peak_memory_bytes) // 2
    searched = compiled(None, memory_limit=limit)
    searched_file = saved(searched[0].plan, "searched.json")

    def in_flight(n: int, schedule: Schedule, name: str) -> Any:
        return compiled(saved(dataclasses.replace(full[0].plan, schedule=dataclasses.replace(
            schedule, scatters_in_flight=n)), name))

    one_module = in_flight(1, full[0].plan.schedule, "one-in-flight.json")
    small = Schedule(prefetch=full[0].plan.schedule.prefetch)  # 64 KiB gather buckets
    small_two, small_one = (in_flight(n, small, f"64KiB-{n}-in-flight.json") for n in (2, 1))
    on = [False]
    rows = []
    with all_reduce_after_scatters(on):
        pairs = {
            "the reduce-scatters beside the all-reduce": {
                "together": (searched, lambda: on.__setitem__(0, False),
                             searched[0].plan.prediction.step_time_s),
                "apart": (searched, lambda: on.__setitem__(0, True),
                          compiled(searched_file, apart)[0].plan.prediction.step_time_s)},
            "two reduce-scatters in flight against one": {
                "together": (full, lambda: None, full[0].plan.prediction.step_time_s),
                "apart": (one_module, lambda: None,
                          one_module[0].plan.prediction.step_time_s)},
            "two reduce-scatters in flight against one, 64 KiB gather buckets": {
                "together": (small_two, lambda: None, small_two[0].plan.prediction.step_time_s),
                "apart": (small_one, lambda: None, small_one[0].plan.prediction.step_time_s)},
        }
        for pair, ways in pairs.items():
            cases = {way: case for way, (case, _, _) in ways.items()}
            medians = _medians_s(cases, rounds, steps,
                                 {way: before for way, (_, before, _) in ways.items()})
            plan = ways["together"][0][0].plan
            rows.append({"pair": pair, "plan": ", ".join(
                f"{n} {strategy}" for strategy, n in
                collections.Counter(p.strategy for p in plan.params).items()),
                         "predicted_s": (ways["together"][2], ways["apart"][2]),
                         "measured_s": (medians["together"], medians["apart"])})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt", "hf_gpt2"])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    ranks_per_node = 2 if args.world_size == 4 else args.world_size
    rows = run_world(args.world_size, measure, args.model, args.rounds, args.steps,
                     ranks_per_node, tempfile.mkdtemp(), timeout_s=1800)[0]
    print(f"{args.model}, world {args.world_size}, {args.rounds} rounds of {args.steps} steps;"
          " ms\n")
    print("| collectives | plan | together: predicted | measured | apart: predicted | measured "
          "| saved: predicted | measured |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        (p_with, p_apart), (m_with, m_apart) = row["predicted_s"], row["measured_s"]
        print(f"| {row['pair']} | {row['plan']} | {p_with * 1e3:.1f} | {m_with * 1e3:.1f} "
              f"| {p_apart * 1e3:.1f} | {m_apart * 1e3:.1f} | {(p_apart - p_with) * 1e3:+.1f} "
              f"| {(m_apart - m_with) * 1e3:+.1f} |")


if __name__ == "__main__":
    main()

"""What prefetching saves inside a training step, against what the step model credits it with:
the gathers' time hidden under the computation, and the waits for the ranks that a gather
issued at another's wait does not pay ([Note: the wait after a stretch of computation] in
``cost_models/overlap.py``).

Starts a gloo world on the CPU (``--world-size`` ranks, one thread each; at world 4 two
pretended nodes of 2) and compiles the model of ``prediction_accuracy.py`` (``--model``)
under ``full_shard`` in its block-sized gather buckets and in 64 KiB ones (the bucket plan of
``prediction_accuracy.py``: many small collectives), each at ``Schedule.prefetch`` 0, 1 and 2,
all with one ``detect_devices()``. The six are timed round-robin together
(``prediction_accuracy.time_round_robin``: ``--rounds`` rounds of ``--steps`` steps after
``--warm-steps`` untimed ones, the slowest rank's median). Prints each one's predicted step,
the blocking collectives' predicted waits for the ranks within it, its measured step, and what
prefetching 1 and 2 ahead saves over not prefetching, predicted and measured, and the CPU a
step takes (the ranks' mean of each one's median): the thread that runs it, and the process's
other threads (gloo's, whose work beside the computation takes the cores from it); and the
untimed first step of each round, right after another plan's (the slowest rank's median).

    python benchmarks/prefetch_in_step.py [--model hf_gpt2] [--world-size 2] [--rounds 25]
        [--steps 2] [--warm-steps 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from osdp_fx import compile_osdp, detect_devices  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402

PREFETCH = (0, 1, 2)
"""The prefetch distances compared (0: each gather issued at its use)."""
BUCKETS = {"block buckets": None, "64 KiB buckets": 2**16}
"""The gather buckets of each plan: ``full_shard``'s own (None), or that many bytes."""


def measure(rank: int, world: int, model: str, rounds: int, steps: int,
            warm_steps: int = 1) -> list[dict[str, Any]]:
    """Every (buckets, prefetch) plan's predicted step and waits and its measured step."""
    from prediction_accuracy import build, time_round_robin

    torch.set_num_threads(1)
    ranks_per_node = 2 if world == 4 else world
    devices = detect_devices(ranks_per_node=ranks_per_node)
    module, inputs = build(model)
    full = compile_osdp(module, inputs, devices, plan="full_shard", optimizer="sgd",
                        plan_cache=False).plan
    cases: dict[tuple[str, int], Any] = {}
    for buckets, nbytes in BUCKETS.items():
        for prefetch in PREFETCH:
            schedule = dataclasses.replace(full.schedule, prefetch=prefetch, **(
                {} if nbytes is None else {"gather_bucket_bytes": nbytes}))
            path = Path(tempfile.mkdtemp()) / "plan.json"
            dataclasses.replace(full, schedule=schedule).save(path)
            module, inputs = build(model)
            cases[(buckets, prefetch)] = (compile_osdp(module, inputs, devices, plan=str(path),
                                                       optimizer="sgd", plan_cache=False),
                                          inputs)
    rows = time_round_robin(cases, "sgd", rounds=rounds, steps=steps, warm_steps=warm_steps)
    return [{"buckets": r["plan"][0], "prefetch": r["plan"][1],
             "predicted_s": r["predicted_s"], "waits_s": r["predicted_waits_s"],
             "measured_s": r["measured_s"], "cpu_s": r["cpu_s"],
             "first_step_s": r["first_step_s"]} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hf_gpt2", choices=("mlp", "gpt", "hf_gpt2"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warm-steps", type=int, default=1,
                        help="untimed steps of a plan before its timed ones in each round")
    args = parser.parse_args()
    ranks = run_world(args.world_size, measure, args.model, args.rounds, args.steps,
                      args.warm_steps, timeout_s=3600)
    by = {(r["buckets"], r["prefetch"]): r for r in ranks[0]}
    cpu = {key: [statistics.mean(r["cpu_s"][k] for rows in ranks for r in rows
                                 if (r["buckets"], r["prefetch"]) == key) for k in (0, 1)]
           for key in by}  # the ranks' mean: (process, the step's thread)
    print(f"{args.model}, world {args.world_size}, `full_shard`")
    print()
    print("| buckets | prefetch | predicted step, ms | of it waits for the ranks | measured | "
          "error | saved over prefetch 0: predicted | measured | CPU: the step's thread | "
          "the process's other threads | the first step after another plan's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for buckets in BUCKETS:
        base = by[(buckets, 0)]
        for prefetch in PREFETCH:
            r = by[(buckets, prefetch)]
            saved = ("" if not prefetch else
                     f" {(base['predicted_s'] - r['predicted_s']) * 1e3:+.1f} | "
                     f"{(base['measured_s'] - r['measured_s']) * 1e3:+.1f} |")
            print(f"| {buckets} | {prefetch} | {r['predicted_s'] * 1e3:.1f} | "
                  f"{r['waits_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | "
                  f"{(r['predicted_s'] / r['measured_s'] - 1) * 100:+.1f} % |"
                  + (saved or " | |") + f" {cpu[(buckets, prefetch)][1] * 1e3:.1f} | "
                  f"{(cpu[(buckets, prefetch)][0] - cpu[(buckets, prefetch)][1]) * 1e3:.1f} | "
                  + (f"{r['first_step_s'] * 1e3:.1f} |" if r["first_step_s"] else "|"))


if __name__ == "__main__":
    main()

"""What a plan that shards some parameter groups costs beyond its collectives: `replicate`
against the same model with one small group sharded, and with its largest group sharded.

Starts a gloo world on the CPU (``--world-size`` ranks, one thread each) and compiles the
GPT of ``prediction_accuracy.py`` (``--model``) under ``replicate``, under ``full_shard`` on its
last bias alone (a few hundred bytes gathered: next to no communication) and under
``full_shard`` on its largest group, everything else replicated, with one
``detect_devices()``. It times the three round-robin (``--rounds`` rounds of ``--steps``
steps, the slowest rank's median), each step's forward, backward and optimizer step apart, and
prints per plan the predicted and measured step and the measured phases, how much slower than
``replicate`` it was predicted and measured to be, and the CPU time a step took on the rank's
main thread (``time.thread_time``) and on its other threads (gloo's: the process's CPU time
less the main thread's), each the slowest rank's median. ``--profile DIR``: then, per plan and
rank, 5 more steps under torch's profiler, its operators by self CPU time written to
``DIR/<plan number>-rank<rank>.txt`` (a collective's wait is the self time of the function
that waits for it).

    python benchmarks/mixed_cost.py [--model gpt] [--world-size 2] [--rounds 10] [--steps 4]
        [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from osdp_fx import compile_osdp, detect_devices  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


def plans_of(model: torch.nn.Module) -> dict[str, dict[str, str]]:
    """The three plans (module docstring) as {label: {parameter name: strategy}}."""
    sizes = {n: p.numel() for n, p in model.named_parameters()}  # tied weights once
    bias = [n for n in sizes if n.endswith("bias")][-1]
    largest = max(sizes, key=sizes.__getitem__)
    return {label: {n: "full_shard" if n == chosen else "replicate" for n in sizes}
            for label, chosen in (("replicate", None), (f"full_shard on {bias}", bias),
                                  (f"full_shard on {largest}", largest))}


def measure(rank: int, world: int, model_name: str, rounds: int, steps: int,
            directory: str, profile_dir: str | None = None) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from prediction_accuracy import build

    torch.set_num_threads(1)
    devices = detect_devices()
    cases = {}
    for label, strategies in plans_of(build(model_name)[0]).items():
        path = Path(directory) / f"plan{len(cases)}.json"
        if rank == 0:
            path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1,
                                        "params": strategies}))
        dist.barrier()
        model, inputs = build(model_name)
        compiled = compile_osdp(model, inputs, devices, plan=str(path), optimizer="sgd",
                                plan_cache=False)
        cases[label] = (compiled, inputs, torch.optim.SGD(compiled.parameters(), lr=1e-3))
    times: dict[str, list[list[float]]] = {label: [] for label in cases}
    for r in range(rounds + 1):  # the first round warms up
        for label, (compiled, inputs, opt) in cases.items():
            for _ in range(steps):
                dist.barrier()
                cpu0, main0 = time.process_time(), time.thread_time()
                t0 = time.perf_counter()
                loss = compiled(*inputs)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
                t3 = time.perf_counter()
                cpu1, main1 = time.process_time(), time.thread_time()
                opt.zero_grad(set_to_none=True)
                if r:
                    times[label].append([t3 - t0, t1 - t0, t2 - t1, t3 - t2, main1 - main0,
                                         (cpu1 - cpu0) - (main1 - main0)])
    rows = []
    for label, (compiled, _, _) in cases.items():
        medians = torch.tensor([statistics.median(column) for column in zip(*times[label])])
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        rows.append({"plan": label, "predicted_s": compiled.plan.prediction.step_time_s,
                     "measured_s": float(medians[0]),
                     "phases_s": dict(zip(PHASES, medians[1:4].tolist())),
                     "main_thread_cpu_s": float(medians[4]),
                     "other_threads_cpu_s": float(medians[5])})
    if profile_dir is not None:
        _profile(cases, rank, profile_dir)
    return rows


def _profile(cases: dict[str, Any], rank: int, directory: str) -> None:
    """5 steps of each plan under torch's profiler; its operators by self CPU time, to
    ``directory/<plan number>-rank<rank>.txt``."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    Path(directory).mkdir(parents=True, exist_ok=True)
    for number, (label, (compiled, inputs, opt)) in enumerate(cases.items()):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                dist.barrier()
                compiled(*inputs).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        (Path(directory) / f"{number}-rank{rank}.txt").write_text(f"{label}, 5 steps\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=["mlp", "gpt", "hf_gpt2"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="also profile 5 steps of each plan on every rank into DIR")
    args = parser.parse_args()
    rows = run_world(args.world_size, measure, args.model, args.rounds, args.steps,
                     tempfile.mkdtemp(), args.profile)[0]
    print(f"{args.model}, world {args.world_size}, {args.rounds} rounds of {args.steps} steps; ms\n")
    print("| plan | step predicted | measured | forward | backward | optimizer "
          "| over replicate: predicted | measured | CPU: main thread | other threads |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = rows[0]
    for row in rows:
        phases = " | ".join(f"{row['phases_s'][p] * 1e3:.1f}" for p in PHASES)
        over_p = (row["predicted_s"] - base["predicted_s"]) * 1e3
        over_m = (row["measured_s"] - base["measured_s"]) * 1e3
        print(f"| {row['plan']} | {row['predicted_s'] * 1e3:.1f} | {row['measured_s'] * 1e3:.1f} "
              f"| {phases} | {over_p:+.1f} | {over_m:+.1f} | {row['main_thread_cpu_s'] * 1e3:.1f} "
              f"| {row['other_threads_cpu_s'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()

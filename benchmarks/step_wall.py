"""Where a training step's wall time goes, measured by the thread that runs it, beside the step
model's prediction of the same parts.

Starts a gloo world on the CPU (``--world-size`` ranks, one thread each; at world 4 two
pretended nodes of 2) and compiles the model of ``prediction_accuracy.py`` (``--model``) with one
``detect_devices()`` under ``replicate`` and ``full_shard``, and ``full_shard`` in 64 KiB gather
buckets (many small collectives), each ``full_shard`` at ``Schedule.prefetch`` 1 (its default)
and 0; at world 4 also ``hierarchical`` at prefetch 1 and 0 and ``hybrid_shard`` (the
two-stage collectives of ``runtime/hierarchy.py``). The plans and the plain model (no
osdp-fx, no collectives) are timed round-robin together: ``--rounds`` rounds of ``--steps``
steps after a warm-up round, each step after a barrier, under the runtime's collective clock
(``runtime/collectives.py``, [Note: the collective clock]). Per step, on each rank: the
forward, the backward and the optimizer step;
the seconds spent starting collectives ("launches") and waiting for them ("waits"); the rest of
the step (its computation, the runtime's host work, and the time its thread lost its core);
and the thread's CPU time, from which "off its core" is the rest less the thread's CPU outside
the waits (the step less the waits less the thread's CPU: a thread sleeping in a wait uses
none).

Prints, per plan, the slowest rank's median step against its prediction, and the ranks' mean of
each rank's median part beside the prediction's: its communication (of it the waits for the
ranks) against the measured launches and waits, and its computation, host lane and optimizer
step against the measured rest. The plain model's row gives the machine's speed in the rounds
against the profile's, as ``prediction_accuracy.py`` does.

    python benchmarks/step_wall.py [--model gpt] [--world-size 2] [--rounds 20] [--steps 2]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from osdp_fx.runtime.collectives import collective_clock  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402

PLANS = (("replicate", None, None), ("full_shard", None, 1), ("full_shard", None, 0),
         ("full_shard", 2**16, 1), ("full_shard", 2**16, 0))
"""(strategy, gather bucket bytes or None for the plan's own, prefetch or None for the
plan's own) of each plan timed."""
MESH_PLANS = (("hierarchical", None, 1), ("hierarchical", None, 0), ("hybrid_shard", None, 1))
"""The plans timed besides on several nodes (world 4: 2 nodes x 2), as :data:`PLANS`."""
PLAIN = "plain model"
PARTS = ("step", "forward", "backward", "optimizer", "launches", "launch_s", "waits", "wait_s",
         "cpu")
"""What each timed step records, in seconds (counts for launches and waits)."""


def label(strategy: str, nbytes: int | None, prefetch: int | None) -> str:
    """A plan's name in the table."""
    buckets = "" if nbytes is None else f", {nbytes >> 10} KiB buckets"
    ahead = "" if prefetch is None else f", prefetch {prefetch}"
    return f"{strategy}{buckets}{ahead}"


def compile_plans(model: str, ranks_per_node: int) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Every plan of :data:`PLANS` (and on several nodes of :data:`MESH_PLANS`), compiled with
    one ``detect_devices()``, and its inputs."""
    from prediction_accuracy import build

    devices = detect_devices(ranks_per_node=ranks_per_node)
    cases: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    several_nodes = devices.num_nodes > 1
    for strategy, nbytes, prefetch in PLANS + (MESH_PLANS if several_nodes else ()):
        module, inputs = build(model)
        compiled = compile_osdp(module, inputs, devices, plan=strategy, optimizer="sgd",
                                plan_cache=False)
        if nbytes is not None or prefetch is not None:
            changes: dict[str, Any] = {}
            if nbytes is not None:
                changes["gather_bucket_bytes"] = nbytes
            if prefetch is not None:
                changes["prefetch"] = prefetch
            schedule = dataclasses.replace(compiled.plan.schedule, **changes)
            path = Path(tempfile.mkdtemp()) / "plan.json"
            dataclasses.replace(compiled.plan, schedule=schedule).save(path)
            module, inputs = build(model)
            compiled = compile_osdp(module, inputs, devices, plan=str(path), optimizer="sgd",
                                    plan_cache=False)
        cases[label(strategy, nbytes, prefetch)] = (compiled, inputs)
    return cases


def timed_step(module: Any, inputs: tuple[Any, ...], optimizer: Any) -> dict[str, float]:
    """One step after a barrier, each part of :data:`PARTS` measured on this rank."""
    torch.distributed.barrier()
    with collective_clock() as clock:
        start, cpu = time.perf_counter(), time.thread_time()
        loss = module(*inputs)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        used = time.thread_time() - cpu
    optimizer.zero_grad(set_to_none=True)
    return {"step": end - start, "forward": forward - start, "backward": backward - forward,
            "optimizer": end - backward, "launches": clock.launches,
            "launch_s": clock.launch_s, "waits": clock.waits, "wait_s": clock.wait_s,
            "cpu": used}


def measure(rank: int, world: int, model: str, rounds: int, steps: int) -> dict[str, Any]:
    """Each plan's and the plain model's median parts on this rank, the slowest rank's median
    step, and each plan's predicted parts."""
    from prediction_accuracy import build

    torch.set_num_threads(1)
    cases = compile_plans(model, 2 if world == 4 else world)
    cases[PLAIN] = build(model)
    optimizers = {name: torch.optim.SGD(module.parameters(), lr=1e-3)
                  for name, (module, _) in cases.items()}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for r in range(rounds + 1):  # the first round warms up
        for name, (module, inputs) in cases.items():
            for _ in range(steps):
                sample = timed_step(module, inputs, optimizers[name])
                if r:
                    samples[name].append(sample)
    medians = {name: {part: statistics.median(s[part] for s in ss) for part in PARTS}
               for name, ss in samples.items()}
    steps_s = torch.tensor([medians[name]["step"] for name in cases], dtype=torch.float64)
    torch.distributed.all_reduce(steps_s, op=torch.distributed.ReduceOp.MAX)
    predicted = {}
    for name, (module, _) in cases.items():
        if name != PLAIN:
            p = module.plan.prediction
            predicted[name] = {"step": p.step_time_s, "compute": p.compute_s,
                               "comm": p.comm_s, "sync": p.sync_wait_s, "host": p.host_s,
                               "optimizer": p.optim_s}
    return {"medians": medians, "slowest": dict(zip(cases, steps_s.tolist())),
            "predicted": predicted}


def table(ranks: list[dict[str, Any]]) -> list[str]:
    """The Markdown rows: each plan's measured parts (the ranks' mean of their medians) beside
    its predicted ones, ms."""
    first = ranks[0]
    names = list(first["slowest"])

    def mean(name: str, part: str) -> float:
        return statistics.mean(r["medians"][name][part] for r in ranks)

    lines = ["| plan | step, ms: predicted | measured | error | forward / backward / "
             "optimizer | communication predicted (of it waits for the ranks) | launches: "
             "count, ms | waits: count, ms | computation + host + optimizer predicted | the "
             "rest measured | of it off its core |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = first["slowest"][PLAIN]
    for name in names:
        step = first["slowest"][name]
        parts = " / ".join(f"{mean(name, p) * 1e3:.1f}"
                           for p in ("forward", "backward", "optimizer"))
        rest = mean(name, "step") - mean(name, "launch_s") - mean(name, "wait_s")
        off = mean(name, "step") - mean(name, "wait_s") - mean(name, "cpu")
        if name == PLAIN:
            p = first["predicted"][names[0]]
            lines.append(f"| {name} | {(p['compute'] + p['optimizer']) * 1e3:.1f} | "
                         f"{plain * 1e3:.1f} | "
                         f"{((p['compute'] + p['optimizer']) / plain - 1) * 100:+.1f} % | "
                         f"{parts} | | | | | {rest * 1e3:.1f} | {off * 1e3:.1f} |")
            continue
        p = first["predicted"][name]
        lines.append(
            f"| {name} | {p['step'] * 1e3:.1f} | {step * 1e3:.1f} | "
            f"{(p['step'] / step - 1) * 100:+.1f} % | {parts} | {p['comm'] * 1e3:.1f} "
            f"({p['sync'] * 1e3:.1f}) | {mean(name, 'launches'):.0f}, "
            f"{mean(name, 'launch_s') * 1e3:.1f} | {mean(name, 'waits'):.0f}, "
            f"{mean(name, 'wait_s') * 1e3:.1f} | "
            f"{(p['compute'] + p['host'] + p['optimizer']) * 1e3:.1f} | {rest * 1e3:.1f} | "
            f"{off * 1e3:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=("mlp", "gpt", "hf_gpt2"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    ranks = run_world(args.world_size, measure, args.model, args.rounds, args.steps,
                      timeout_s=3600)
    print(f"{args.model}, world {args.world_size}"
          + (" (2 nodes x 2)" if args.world_size == 4 else ""))
    print()
    print("\n".join(table(ranks)))


if __name__ == "__main__":
    main()

"""What splitting a linear's weight costs in a training step, predicted and measured: the
searched plan against the same strategies with no split (and with each split alone).

Starts a gloo world on the CPU (``--world-size`` ranks, one thread each) and, for a model of
``prediction_accuracy.py`` (``--model``), searches its plan as that benchmark does (under a limit
halfway between the ``full_shard`` and ``replicate`` peaks, with ``detect_devices()``). When the
plan splits weights whose parts share one strategy, it compiles, with the plan's own schedule:
the searched plan, the same strategies with every weight whole, and, where it splits several
weights, each split alone. It times
their training steps (SGD) round-robin (``--rounds`` rounds of ``--steps`` steps after one
untimed step, ``prediction_accuracy.time_round_robin``) and prints, per plan, the predicted and
the measured median step, and each one's difference from the unsplit plan: what the splits
change of the step, as the step model prices it and as it runs. A split weight's gradient is
one tensor that its parts' gradients are added into (``runtime/sharded.py``'s ``SplitGrads``),
which the step model charges by ``step.SPLIT_GRADIENT_PASSES``; the thread's CPU per step
(rank 0's, median) shows that work beside the rest.

``--splits NAME=PARTS ...`` times those splits of the named plan ``--strategy`` instead.

    python benchmarks/split_step.py [--model mlp] [--world-size 4] [--rounds 12] [--steps 2]
        [--splits mlp.layers.1.weight=2 --strategy replicate]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from osdp_fx import Devices, compile_osdp, detect_devices  # noqa: E402
from osdp_fx.core.layout import row_numel, split_weights  # noqa: E402
from osdp_fx.cost_models.graph_facts import ParamState  # noqa: E402
from osdp_fx.cost_models.step import split_gradient_s  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402
from prediction_accuracy import time_round_robin  # noqa: E402


def plan_files(plan: Any, names: list[str],
               splits: dict[str, int]) -> dict[str, dict[str, Any]] | None:
    """The plans to time as plan-file dicts, by label, each with ``plan``'s strategy per
    parameter and its schedule: ``splits``, each of them alone when there are several, and no
    split; None when ``splits`` is empty or a weight's parts in ``plan`` differ (no plan
    without the split has the same strategies)."""
    if not splits:
        return None
    strategy = {}
    for name in names:
        parts = plan.parts_of(name)
        kinds = {p.strategy for p in parts} if parts else {plan[name].strategy}
        if len(kinds) > 1:
            return None
        strategy[name] = kinds.pop()
    head = {k: v for k, v in plan.to_dict().items()
            if k not in ("params", "splits", "predicted", "autotuned", "memory_limit_bytes")}

    def with_splits(chosen: dict[str, int]) -> dict[str, Any]:
        params = {}
        for name in names:
            weight = name.rsplit(".", 1)[0] + ".weight"  # a split weight splits its bias
            k = chosen.get(weight, 1)
            params.update({f"{name}_part{i}": strategy[name] for i in range(k)} if k > 1
                          else {name: strategy[name]})
        return {**head, **({"splits": chosen} if chosen else {}), "params": params}

    def label(chosen: dict[str, int]) -> str:
        return ", ".join(f"{w} x{k}" for w, k in sorted(chosen.items()))

    files = {"unsplit": with_splits({}), label(splits): with_splits(splits)}
    if len(splits) > 1:
        files.update({f"only {label({w: k})}": with_splits({w: k})
                      for w, k in sorted(splits.items())})
    return files


def measure(rank: int, world: int, model_name: str, rounds: int, steps: int,
            directory: str, given: dict[str, int], strategy: str) -> dict[str, Any]:
    import torch.distributed as dist

    from prediction_accuracy import build

    torch.set_num_threads(1)
    devices = detect_devices()

    def compiled(plan: Any, **kw: Any) -> Any:
        model, inputs = build(model_name)
        return compile_osdp(model, inputs, devices, plan=plan, optimizer="sgd",
                            plan_cache=False, **kw)

    if given:
        base = compiled(strategy).plan
    else:
        limit = sum(compiled(p).plan.peak_memory_bytes for p in ("replicate", "full_shard")) // 2
        base = compiled(None, memory_limit=limit).plan
    names = [n for n, _ in build(model_name)[0].named_parameters()]
    files = plan_files(base, names, given or dict(base.splits))
    if files is None:
        return {"plan": str(base), "rows": []}
    cases = {}
    for k, (label, data) in enumerate(files.items()):
        path = Path(directory) / f"plan{k}.json"
        if rank == 0:
            path.write_text(json.dumps(data))
        dist.barrier()
        cases[label] = (compiled(str(path)), build(model_name)[1])
    rows = time_round_robin(cases, "sgd", rounds=rounds, steps=steps, warm_steps=1)
    for row in rows:
        row["joining_s"] = joining_s(cases[row["plan"]][0].plan, devices)
    return {"plan": str(base), "rows": rows}


def joining_s(plan: Any, devices: Devices) -> float:
    """What the step model charges ``plan`` for joining its split weights' gradients on
    ``devices`` (the parts' ``step.split_gradient_s``)."""
    parts = split_weights([p.name for p in plan.params])
    return sum(split_gradient_s(ParamState(math.prod(p.shape), p.element_size, p.strategy,
                                           p.trainable, row=row_numel(p.shape)), devices)
               for p in plan.params if p.name in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt", "hf_gpt2"])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--splits", nargs="+", default=[], metavar="NAME=PARTS",
                        help="time these splits under --strategy instead of the searched plan's")
    parser.add_argument("--strategy", default="replicate",
                        help="the named plan whose strategies --splits splits")
    args = parser.parse_args()
    given = {name: int(parts) for name, parts in (s.split("=") for s in args.splits)}
    result = run_world(args.world_size, measure, args.model, args.rounds, args.steps,
                       tempfile.mkdtemp(), given, args.strategy)[0]
    if not result["rows"]:
        print("the plan splits no weight into parts of one strategy:\n")
        print(result["plan"])
        return
    print(f"{args.model}, world {args.world_size}, {args.rounds} rounds of {args.steps} "
          f"steps; ms\n")
    print("| plan | step predicted | of it, joining split gradients | measured | error | "
          "predicted - unsplit | measured - unsplit | thread CPU | thread CPU - unsplit |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = {r["plan"]: r for r in result["rows"]}
    base = rows["unsplit"]
    for label, r in rows.items():
        pred, meas, cpu = (r["predicted_s"] * 1e3, r["measured_s"] * 1e3,
                           r["cpu_s"][1] * 1e3)
        print(f"| {label} | {pred:.1f} | {r['joining_s'] * 1e3:.1f} | {meas:.1f} | "
              f"{pred / meas - 1:+.1%} | "
              f"{pred - base['predicted_s'] * 1e3:+.1f} | {meas - base['measured_s'] * 1e3:+.1f} | "
              f"{cpu:.1f} | {cpu - base['cpu_s'][1] * 1e3:+.1f} |")
    print()
    print(result["plan"])


if __name__ == "__main__":
    main()

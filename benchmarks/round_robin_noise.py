"""How far copies of one plan, timed round-robin together, measure apart: the noise of the
wall side of ``prediction_accuracy.py``'s comparison, by how its rounds are cut.

Starts a gloo world of ``--world-size`` ranks (one torch thread each), compiles
``--copies`` copies of each of ``--plans`` for the model of ``prediction_accuracy.py``
(``--model``: mlp, gpt or hf_gpt2) with one ``detect_devices()``, and times them all
round-robin with ``prediction_accuracy.time_round_robin`` under each setting of
``--settings`` (``ROUNDSxSTEPS``: that many rounds of that many steps of every copy, after a
warm-up round, each copy's steps in a round after ``--warm-steps`` untimed ones), each
setting ``--repeats`` times, one after the other in the same world.
Copies of a plan are the same computation and the same collectives, so every difference
between their median steps is the measurement's: prints, per setting and plan, the copies'
medians (the slowest rank's) and their spread, the largest over the smallest less one.

    python benchmarks/round_robin_noise.py [--model hf_gpt2] [--world-size 2]
        [--plans full_shard,replicate] [--copies 3] [--settings 4x5,10x2,20x2] [--repeats 2]
        [--warm-steps 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from osdp_fx import compile_osdp, detect_devices  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402


def copies_timed(rank: int, world: int, model: str, plans: list[str], copies: int,
                 settings: list[tuple[int, int]], repeats: int, warm_steps: int = 1,
                 ) -> list[tuple[tuple[int, int], dict[str, float]]]:
    """Each setting's (module docstring) median step of every copy, by ``plan#k`` label, in
    the order timed."""
    from prediction_accuracy import build, time_round_robin

    torch.set_num_threads(1)
    devices = detect_devices()
    cases: dict[str, Any] = {}
    for plan in plans:
        for k in range(copies):
            module, inputs = build(model)
            cases[f"{plan}#{k}"] = (compile_osdp(module, inputs, devices, plan=plan,
                                                 optimizer="sgd", plan_cache=False), inputs)
    timed = []
    for _ in range(repeats):
        for rounds, steps in settings:
            rows = time_round_robin(cases, "sgd", rounds=rounds, steps=steps,
                                    warm_steps=warm_steps)
            timed.append(((rounds, steps), {r["plan"]: r["measured_s"] for r in rows}))
    return timed


def spread(values: list[float]) -> float:
    """The largest of ``values`` over the smallest, less one."""
    return max(values) / min(values) - 1.0


def parse_setting(text: str) -> tuple[int, int]:
    rounds, _, steps = text.partition("x")
    try:
        return int(rounds), int(steps)
    except ValueError:
        raise SystemExit(f"--settings takes ROUNDSxSTEPS items (like 20x2), got {text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hf_gpt2", choices=("mlp", "gpt", "hf_gpt2"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--plans", default="full_shard,replicate")
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--settings", default="4x5,10x2,20x2",
                        help="comma-separated ROUNDSxSTEPS")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warm-steps", type=int, default=1,
                        help="untimed steps of each copy before its timed ones in a round")
    args = parser.parse_args()
    plans = args.plans.split(",")
    settings = [parse_setting(s) for s in args.settings.split(",")]
    timed = run_world(args.world_size, copies_timed, args.model, plans, args.copies, settings,
                      args.repeats, args.warm_steps, timeout_s=3600)[0]
    print(f"{args.model}, world {args.world_size}, {args.copies} copies of each plan, "
          f"{args.warm_steps} untimed steps before a copy's timed ones in a round")
    print()
    print("| rounds x steps | plan | copies' median steps, ms | spread |")
    print("|---|---|---|---|")
    for (rounds, steps), medians in timed:
        for plan in plans:
            ms = [medians[f"{plan}#{k}"] * 1e3 for k in range(args.copies)]
            print(f"| {rounds} x {steps} | `{plan}` | {', '.join(f'{m:.1f}' for m in ms)} "
                  f"| {spread(ms) * 100:+.1f} % |")


if __name__ == "__main__":
    main()

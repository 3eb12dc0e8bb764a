"""How well the cost models predict a training step: time and peak memory, per rank.

Starts a gloo world on the CPU (default 2 ranks, one thread each), and for an MLP, a GPT with
tied embeddings and (when transformers is installed) a tiny Hugging Face GPT-2 compiles, side by
side, every named plan (``replicate``, ``shard_grad_op``, ``full_shard``, ``hybrid_shard`` and
``hierarchical``, with the world as nodes of ``--ranks-per-node`` ranks), a plan file of
``full_shard`` in 64 KiB gather buckets, and the searched plan (under a limit halfway between
the full_shard and replicate peaks), with ``devices=None`` (measured by compile_osdp) and with
``detect_devices()``. It times the fourteen of a model round-robin (``--rounds`` rounds of
``--steps`` steps each after ``--warm-steps`` untimed ones, the plans of both columns in turn,
so that the machine's load falls on all alike), measures each one's peak memory over one step
with the live-tensor tracker, and prints the predicted against the measured median step and
peak, beside how far the fastest and the slowest round's median step lie from that median
(the machine's own spread). The plain
model, without osdp-fx or collectives, is timed in the same rounds, and a second table puts
its step beside what the profile made of it (computation and optimizer step): where the
machine ran faster or slower while profiling than in the rounds, every plan's prediction
moves with it. The column "error at the rounds' speed" takes that out: the plan's predicted
computation and optimizer step scaled by the plain model's measured / profiled step, the rest
as predicted. It tells the cost models' own error from the machine's drift; the target is
the column before it. In every round, after the plans, the world's all-gather and
reduce-scatter of 1 and 4 MiB are timed as ``detect`` times them, and a table puts their times
in the rounds beside what each column's measurement priced them at; the column "and the
collectives'" scales, beyond that, each plan's predicted collectives (less the waits for the
ranks) by their rounds / detected ratio: what is left once the machine's drift in the
collectives, between the measurement of the devices and the rounds, is taken out too. A
further table gives, for the plans compiled with ``detect_devices()``,
rank 0's CPU per step (``where_the_step_goes``): the thread that runs the step, what it uses
beyond the plain model's (the runtime's work: its host time, its copies, its collectives'
launches and waits; and what a plan adds to the computation, its recomputation) beside the
host lane the step model charges, the process's other threads (gloo's), and what is left of
the step: the cores' idle time.

    python benchmarks/prediction_accuracy.py [--world-size 2] [--ranks-per-node 1]
        [--optimizer sgd] [--rounds 20] [--steps 2] [--warm-steps 1]

Many short rounds rather than a few long ones: copies of one plan timed together measure
closer to each other so (``benchmarks/round_robin_noise.py``; the figures in
``docs/benchmarks.md``). A training loop steps one plan, and never takes a step right after
another plan's: each round first runs an untimed step of the plan and times the steps after
it (the plain MLP's step measured closer to its profile so; the figures in
``docs/benchmarks.md``).

Prints Markdown tables and, last, one JSON line with the worst absolute errors and how many
plans are predicted within 15 % of their measured step (and how many at the rounds' speed, and
at the rounds' speed of the collectives too).
The targets: memory within 10 %, step time within 15 %. The line also says how many plans
compiled alike under both devices (the same ``Plan.hash()``) and so were timed twice in the
same rounds, and the largest difference between a plan's two measured steps: how much of the
15 % the measurement alone takes (``twin_spreads``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from osdp_fx import Devices, compile_osdp, detect_devices  # noqa: E402
from osdp_fx.core.buckets import Schedule  # noqa: E402
from osdp_fx.core.layout import WORLD  # noqa: E402
from osdp_fx.examples import MLP, GPTWithLoss, TinyGPT  # noqa: E402
from osdp_fx.planner import detect  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402
from osdp_fx.runtime.memory import measure_step_peak_bytes  # noqa: E402


class MLPWithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP((512, 1024, 1024, 1024, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.mlp(x), x)


class HFWithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=64, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx, labels=idx).loss


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    if name == "mlp":
        return MLPWithLoss(), (torch.randn(16, 512),)
    if name == "gpt":
        return GPTWithLoss(TinyGPT(vocab=1024, dim=128, depth=2, heads=4, max_seq=64)), (
            torch.randint(0, 1024, (8, 64)),)
    return HFWithLoss(), (torch.randint(0, 1024, (8, 64)),)


REFERENCE = ("plain model", "no collectives")
"""The label of the plain model's row (:func:`time_round_robin`'s ``reference``)."""
PROBE = "the world's collectives"
"""The plan label of the rows that put the collectives timed in the rounds beside the
detection a column planned with (:func:`probe_rows`)."""
PROBE_BYTES = (2**20, 2**22)
"""Sizes of the world's all-gather and reduce-scatter timed in every round, as ``detect`` times
them: the sizes of the gathers and gradients the sharded plans here move."""
PROBE_ROUNDS = 3
"""Times each probe is timed per round (the trimmed mean of them is the round's figure)."""


def measure(rank: int, world: int, models: list[str], optimizer: str, rounds: int,
            steps: int, ranks_per_node: int, warm_steps: int = 0) -> list[dict[str, Any]]:
    given = {"devices=None": None,
             "detect_devices()": detect_devices(ranks_per_node=ranks_per_node)}
    rows = []
    for name in models:
        cases = {(label, plan): case for label, devices in given.items()
                 for plan, case in compile_cases(name, devices, optimizer,
                                                 ranks_per_node=ranks_per_node,
                                                 world=world).items()}
        plain, inputs = build(name)  # the model itself, no collectives: the computation
        probe: dict[tuple[str, int], list[float]] = {}
        timed = time_round_robin(cases, optimizer, rounds=rounds, steps=steps,
                                 reference=(plain, inputs), warm_steps=warm_steps,
                                 probe=probe)
        rows += [dict(r, model=name, devices=r["plan"][0], plan=r["plan"][1]) for r in timed]
        measured = {**given, "devices=None": compile_measurement()}
        rows += [dict(r, model=name) for r in probe_rows(measured, probe, world)]
        del cases
        gc.collect()  # the next model starts (and profiles) without this one's memory
    return rows


def compile_measurement() -> Devices:
    """The devices ``compile_osdp`` measured itself (``devices=None``): the one measurement
    ``detect`` keeps for the process group."""
    measured, = detect._detected_devices.values()
    return measured


def probe_runs(world: int) -> dict[tuple[str, int], Any]:
    """One call of the world's all-gather and reduce-scatter at each of :data:`PROBE_BYTES`,
    through the runtime's collectives, by (collective, total bytes) as ``detect`` keys them."""
    runs = {}
    for nbytes in PROBE_BYTES:
        numel = max(world, nbytes // 4 // world * world)
        for collective, run in detect.collective_runs(numel, world, WORLD,
                                                      torch.device("cpu")).items():
            if collective != "all_reduce":
                runs[(collective, numel * 4)] = run
    return runs


def timed_price_s(devices: Devices, collective: str, total_bytes: int, world: int) -> float:
    """What ``devices`` measured ``collective`` of ``total_bytes`` at over the whole world."""
    for scope in ("world", "inter_node", "intra_node"):
        entry = devices.collective_times.get(f"{scope}.{collective}")
        if entry and entry["group_size"] == world and total_bytes in entry["total_bytes"]:
            return entry["seconds"][entry["total_bytes"].index(total_bytes)]
    raise KeyError(f"no {collective} of {total_bytes} bytes over {world} ranks in the devices")


def probe_rows(given: dict[str, Devices], probe: dict[tuple[str, int], list[float]],
               world: int) -> list[dict[str, Any]]:
    """Per column (its devices), each probed collective's time in the rounds (the slowest
    rank's median over the rounds) beside what the column's detection measured it at, and
    their ratio pooled over the probes (the geometric mean): how far the measured devices'
    collective prices lay from what the collectives took while the plans were timed."""
    keys = sorted(probe)
    medians = torch.tensor([statistics.median(probe[k]) for k in keys])
    torch.distributed.all_reduce(medians, op=torch.distributed.ReduceOp.MAX)
    rounds = dict(zip(keys, medians.tolist()))
    rows = []
    for label, devices in given.items():
        detected = {k: timed_price_s(devices, k[0], k[1], world) for k in keys}
        ratio = statistics.geometric_mean([rounds[k] / detected[k] for k in keys])
        rows.append({"devices": label, "plan": PROBE, "rounds_s": rounds,
                     "detected_s": detected, "ratio": ratio})
    return rows


def compile_cases(name: str, devices: Devices | None, optimizer: str, *, ranks_per_node: int,
                  world: int) -> dict[str, Any]:
    """The compiled modules of every plan of one model (module docstring), by plan label."""
    import tempfile

    if devices is None and ranks_per_node < world:
        os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)  # as torchrun sets it
    cases: dict[str, Any] = {}

    def compile_one(label: str, plan: Any, **kw: Any) -> None:
        model, inputs = build(name)
        cases[label] = (compile_osdp(model, inputs, devices, plan=plan, optimizer=optimizer,
                                     plan_cache=False, **kw), inputs)

    for plan in ("replicate", "shard_grad_op", "full_shard", "hybrid_shard", "hierarchical"):
        compile_one(plan, plan)
    full = cases["full_shard"][0].plan
    path = Path(tempfile.mkdtemp()) / "buckets-64KiB.json"
    dataclasses.replace(full, schedule=Schedule(prefetch=full.schedule.prefetch)).save(path)
    compile_one("full_shard, 64 KiB buckets", str(path))
    limit = (cases["replicate"][0].plan.peak_memory_bytes + full.peak_memory_bytes) // 2
    compile_one("searched", None, memory_limit=limit)
    return cases


def time_round_robin(cases: dict[str, Any], optimizer: str, *, rounds: int, steps: int,
                     reference: tuple[nn.Module, tuple[Any, ...]] | None = None,
                     warm_steps: int = 0,
                     probe: dict[tuple[str, int], list[float]] | None = None,
                     ) -> list[dict[str, Any]]:
    """Each case's median step (the slowest rank's: every rank times the same steps) over
    ``rounds`` rounds of ``steps`` steps (after ``warm_steps`` untimed ones), the cases in turn
    within a round, the fastest and the slowest of its rounds' medians, and its peak; and this
    rank's median CPU seconds per step, of the whole process (its gloo threads' work with it)
    and of the thread that runs the step (``cpu_s``); with ``warm_steps``, the median of the
    untimed first step of each round, right after another case's (``first_step_s``, the
    slowest rank's). ``reference``: the plain model and its
    inputs, timed in the same rounds after the cases, without collectives; its row (plan
    ``REFERENCE``) holds what the profile predicts for it, the first case's computation and
    optimizer step: how far the machine's speed moved between the profile and the rounds.
    ``probe``: filled with the time of each of :func:`probe_runs`' collectives in every round
    (this rank's), timed after the cases as ``detect`` times collectives."""
    if reference is not None:
        first = next(iter(cases.values()))[0].plan.prediction
        cases = {**cases, REFERENCE: reference}
    opts = {label: (torch.optim.AdamW(c.parameters(), lr=1e-4) if optimizer == "adamw"
                    else torch.optim.SGD(c.parameters(), lr=1e-3))
            for label, (c, _) in cases.items()}
    times: dict[str, list[float]] = {label: [] for label in cases}
    firsts: dict[str, list[float]] = {label: [] for label in cases}  # the untimed first steps
    cpu: dict[str, list[tuple[float, float]]] = {label: [] for label in cases}
    runs = probe_runs(torch.distributed.get_world_size()) if probe is not None else {}
    a, b = detect.filler_operands(torch.device("cpu"))
    for r in range(rounds + 1):  # the first round warms up
        for label, (compiled, inputs) in cases.items():
            for k in range(warm_steps + steps):
                torch.distributed.barrier()
                start, process = time.perf_counter(), time.process_time()
                thread = time.thread_time()
                compiled(*inputs).backward()
                opts[label].step()
                elapsed = time.perf_counter() - start
                used = (time.process_time() - process, time.thread_time() - thread)
                opts[label].zero_grad(set_to_none=True)
                if r and k >= warm_steps:
                    times[label].append(elapsed)
                    cpu[label].append(used)
                elif r and k == 0:
                    firsts[label].append(elapsed)
        if runs and r:
            timed = detect._interleaved_times_s(
                list(runs.values()), torch.device("cpu"), barrier=torch.distributed.barrier,
                rounds=PROBE_ROUNDS, between=lambda: torch.mm(a, b), warmup=0,
                calls=[detect.calls_per_run(n) for _, n in runs])
            for key, t in zip(runs, timed):
                probe.setdefault(key, []).append(t)
    rows = []
    for label, (compiled, inputs) in cases.items():
        opt = opts[label]
        if label == REFERENCE:
            median = torch.tensor([statistics.median(times[label])])
            torch.distributed.all_reduce(median, op=torch.distributed.ReduceOp.MAX)
            rows.append({"plan": label, "predicted_s": first.compute_s + first.optim_s,
                         "measured_s": float(median[0]),
                         "cpu_s": tuple(statistics.median(c) for c in zip(*cpu[label]))})
            continue
        params = list(compiled.parameters())

        def step() -> None:
            compiled(*inputs).backward()  # noqa: B023 (run at once)
            opt.step()  # noqa: B023

        peak = measure_step_peak_bytes(step, params, opt, warmup_steps=0,
                                       zero_grad=lambda: opt.zero_grad(set_to_none=True))  # noqa: B023
        per_round = [statistics.median(times[label][i:i + steps])
                     for i in range(0, len(times[label]), steps)]
        measured = torch.tensor([statistics.median(times[label]), min(per_round),
                                 max(per_round), statistics.median(firsts[label] or [0.0])])
        torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
        pr = compiled.plan.prediction
        rows.append({"plan": label, "predicted_s": pr.step_time_s, "hash": compiled.plan.hash(),
                     "measured_s": float(measured[0]),
                     "rounds_s": (float(measured[1]), float(measured[2])),
                     "predicted_bytes": pr.peak_memory_bytes,
                     "measured_bytes": peak, "figures": pr.figures,
                     "predicted_parts_s": (pr.compute_s, pr.comm_s, pr.optim_s, pr.host_s),
                     "predicted_waits_s": pr.sync_wait_s,
                     "cpu_s": tuple(statistics.median(c) for c in zip(*cpu[label])),
                     "first_step_s": float(measured[3]) if warm_steps else None})
    return rows


def _parts_ms(row: dict[str, Any]) -> list[str]:
    """A row's predicted parts in milliseconds, the communication's waits for the ranks in
    parentheses."""
    cells = [f"{x * 1e3:.1f}" for x in row["predicted_parts_s"]]
    cells[1] += f" ({row['predicted_waits_s'] * 1e3:.1f})"
    return cells


def where_the_step_goes(rows: list[dict[str, Any]], drift: list[dict[str, Any]],
                        world: int) -> str:
    """A table of rank 0's CPU per step under each plan of the ``detect_devices()`` column
    (medians, ms): the step's thread, of it what lies beyond the plain model's thread (the
    runtime's host work, copies, collectives' launches and waits, and a plan's recomputation)
    beside the host lane the step model charges, the process's other threads (gloo's), and the
    cores' idle time: the step less the process's CPU times the ranks per core (every rank runs
    on this machine)."""
    share = max(1.0, world / (os.cpu_count() or 1))
    plain = {r["model"]: r["cpu_s"][1] for r in drift}
    lines = ["| model | plan | step, ms | CPU: the step's thread | beyond the plain model's | "
             "the host lane predicted | the other threads | the cores' idle |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["devices"] != "detect_devices()":
            continue
        process, thread = r["cpu_s"]
        idle = r["measured_s"] - share * process
        lines.append(f"| {r['model']} | {r['plan']} | {r['measured_s'] * 1e3:.1f} | "
                     f"{thread * 1e3:.1f} | {(thread - plain[r['model']]) * 1e3:+.1f} | "
                     f"{r['predicted_parts_s'][3] * 1e3:.1f} | {(process - thread) * 1e3:.1f} | "
                     f"{idle * 1e3:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks per (pretended) node, for hybrid_shard and hierarchical "
                             "(default: all on one node)")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2,
                        help="steps of a plan per round (module docstring)")
    parser.add_argument("--models", default=None, help="comma-separated: mlp, gpt, hf_gpt2")
    parser.add_argument("--warm-steps", type=int, default=1,
                        help="untimed steps of a plan before its timed ones in each round "
                             "(module docstring)")
    args = parser.parse_args()
    models = args.models.split(",") if args.models else ["mlp", "gpt"]
    if not args.models:
        try:
            import transformers  # noqa: F401

            models.append("hf_gpt2")
        except ImportError:
            pass
    rows = run_world(args.world_size, measure, models, args.optimizer, args.rounds, args.steps,
                     args.ranks_per_node or args.world_size, args.warm_steps,
                     timeout_s=1800)[0]
    print("| model | devices | plan | step ms predicted | measured | error | error at the "
          "rounds' speed | and the collectives' | rounds | peak MiB predicted | measured | error "
          "| predicted compute / comm (of it waits for the ranks) / optimizer / host ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst_time = worst_memory = 0.0
    within = within_at_speed = within_at_links = 0
    drift = [r for r in rows if (r["devices"], r["plan"]) == REFERENCE]
    speed = {r["model"]: r["measured_s"] / r["predicted_s"] for r in drift}
    probes = [r for r in rows if r["plan"] == PROBE]
    links = {(r["model"], r["devices"]): r["ratio"] for r in probes}
    rows = [r for r in rows if (r["devices"], r["plan"]) != REFERENCE and r["plan"] != PROBE]
    for r in rows:
        measured = r["measured_s"]
        t_err = r["predicted_s"] / measured - 1
        compute, comm, optim, _ = r["predicted_parts_s"]
        at_speed = r["predicted_s"] + (compute + optim) * (speed[r["model"]] - 1)
        s_err = at_speed / measured - 1
        # the collectives at the rounds' speed too: their time, less the waits for the ranks
        at_links = at_speed + (comm - r["predicted_waits_s"]) * (
            links[r["model"], r["devices"]] - 1)
        l_err = at_links / measured - 1
        m_err = r["predicted_bytes"] / r["measured_bytes"] - 1
        worst_time, worst_memory = max(worst_time, abs(t_err)), max(worst_memory, abs(m_err))
        within += abs(t_err) <= 0.15
        within_at_speed += abs(s_err) <= 0.15
        within_at_links += abs(l_err) <= 0.15
        print(f"| {r['model']} | {r['devices']} | {r['plan']} | {r['predicted_s'] * 1e3:.2f} | "
              f"{r['measured_s'] * 1e3:.2f} | {t_err:+.1%} | {s_err:+.1%} | {l_err:+.1%} | "
              f"{' to '.join(f'{x / measured - 1:+.0%}' for x in r['rounds_s'])} | "
              f"{r['predicted_bytes'] / 2**20:.2f} | "
              f"{r['measured_bytes'] / 2**20:.2f} | {m_err:+.1%} | "
              f"{' / '.join(_parts_ms(r))} |")
    print()
    print("| model | the plain model's step (no collectives), ms: profiled | measured in the "
          "rounds | profile / rounds |")
    print("|---|---|---|---|")
    for r in drift:
        print(f"| {r['model']} | {r['predicted_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | "
              f"{r['predicted_s'] / r['measured_s']:.2f} |")
    print()
    print(probe_table(probes))
    print()
    print(where_the_step_goes(rows, drift, args.world_size))
    twins = twin_spreads(rows)
    print(json.dumps({"world_size": args.world_size, "ranks_per_node": args.ranks_per_node,
                      "optimizer": args.optimizer, "cases": len(rows),
                      "within_15_percent": within,
                      "within_15_percent_at_the_rounds_speed": within_at_speed,
                      "within_15_percent_at_the_rounds_collective_speed_too": within_at_links,
                      "worst_time_error": round(worst_time, 4),
                      "worst_memory_error": round(worst_memory, 4),
                      "same_plan_timed_twice": len(twins),
                      "same_plan_worst_difference": round(max(twins, default=0.0), 4)}))


def probe_table(probes: list[dict[str, Any]]) -> str:
    """A table of each column's detected price of the world's collectives beside their time in
    the rounds (ms), and the ratio the column "and the collectives'" scales the predicted
    collectives by (rounds / detected, pooled)."""
    keys = sorted(probes[0]["rounds_s"]) if probes else []
    names = [f"{c.replace('_', '-')} {n // 2**20} MiB" for c, n in keys]
    lines = ["| model | devices | " + " | ".join(f"{n}: detected / rounds" for n in names)
             + " | rounds / detected |", "|---|---|" + "---|" * (len(keys) + 1)]
    for r in probes:
        cells = [f"{r['detected_s'][k] * 1e3:.2f} / {r['rounds_s'][k] * 1e3:.2f}" for k in keys]
        lines.append(f"| {r['model']} | {r['devices']} | " + " | ".join(cells)
                     + f" | {r['ratio']:.2f} |")
    return "\n".join(lines)


def twin_spreads(rows: list[dict[str, Any]]) -> list[float]:
    """For each plan compiled alike under both devices (the same strategies and schedule: the
    same ``Plan.hash()``), and so timed twice in the same rounds, how far its two measured
    median steps lie apart (the larger over the smaller, less 1): what the measurement alone
    moves a plan's error by."""
    by_plan: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_plan.setdefault((r["model"], r["plan"]), []).append(r)
    spreads = []
    for twins in by_plan.values():
        if len(twins) == 2 and twins[0]["hash"] == twins[1]["hash"]:
            a, b = sorted(t["measured_s"] for t in twins)
            spreads.append(b / a - 1)
    return spreads


if __name__ == "__main__":
    main()

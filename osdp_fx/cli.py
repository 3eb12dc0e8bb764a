"""Command line: ``python -m osdp_fx demo | plan | profile``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Any

import torch
import torch.distributed as dist


def _demo_rank(rank: int, world_size: int, steps: int, plan: str | None,
               memory_limit: str) -> dict[str, Any]:
    from . import compile_osdp
    from .examples import TinyGPT, lm_loss

    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=128, depth=4, heads=4, max_seq=64)
    local_batch, seq = 4, 32
    gen = torch.Generator().manual_seed(1)
    # Learnable data: each sequence counts up from a random start (mod the vocabulary); the
    # same batch every step, so the loss visibly falls in a few steps.
    batch = (torch.randint(0, 512, (world_size * local_batch, 1), generator=gen)
             + torch.arange(seq)) % 512
    mine = [batch[rank * local_batch:(rank + 1) * local_batch]] * steps
    compiled = compile_osdp(model, (mine[0],), plan=plan, memory_limit=memory_limit)
    del model
    opt = torch.optim.AdamW(compiled.parameters(), lr=4e-3)
    losses = []
    for x in mine:
        loss = lm_loss(compiled(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    shard_numel = sum(p.numel() for p in compiled.parameters())
    return {"plan": str(compiled.plan), "code": compiled.code, "losses": losses,
            "local_param_numel": shard_numel, "plan_obj": compiled.plan}


def demo(args: argparse.Namespace) -> int:
    from .runtime.launch import run_world

    print(f"osdp-fx demo: a {args.world_size}-rank gloo world on the CPU trains a GPT-style "
          f"model (tied embeddings) for {args.steps} steps", flush=True)
    results = run_world(args.world_size, _demo_rank, args.steps, args.plan, args.memory)
    first = results[0]
    print("\n== plan ==\n" + first["plan"])
    print("\n== rewritten graph (rank 0) ==" + first["code"])
    print("== training (mean loss over ranks) ==")
    for step, loss in enumerate(first["losses"]):
        print(f"step {step}: loss {loss:.4f}")
    per_rank = ", ".join(f"rank {r}: {res['local_param_numel']:,}" for r, res in enumerate(results))
    print(f"parameter elements held per rank: {per_rank}")
    if args.memory_plot:
        from .plotting import plot_memory_timeline

        print(f"memory plot of the plan: {plot_memory_timeline(first['plan_obj'], args.memory_plot)}")
    return 0


def load_factory(spec: str) -> tuple[Any, tuple[Any, ...]]:
    """Call ``FACTORY`` from ``FILE.py:FACTORY``; it returns ``(model, example_inputs)``."""
    import importlib.util
    import os

    from .capture import as_input_tuple
    from .errors import InputError

    path, _, name = spec.rpartition(":")
    if not path or not name or not os.path.isfile(path):
        raise InputError(f"{spec!r} is not FILE.py:FACTORY naming an existing file; e.g. "
                         "osdp_fx/examples.py:tiny_gpt")
    module_spec = importlib.util.spec_from_file_location("_osdp_factory", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise InputError(f"{path} has no function {name!r}; it must return (model, example_inputs)")
    result = factory()
    if not isinstance(result, tuple) or len(result) != 2:
        raise InputError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    return result[0], as_input_tuple(result[1])


def _devices_arg(args: argparse.Namespace) -> Any:
    from .devices import Devices

    devices = Devices.from_json(args.devices) if args.devices else Devices()
    return dataclasses.replace(
        devices, world_size=args.world_size,
        ranks_per_node=args.ranks_per_node or devices.ranks_per_node)


def plan_command(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from .capture import capture
    from .planner import make_plan
    from .units import format_bytes, parse_bytes

    model, inputs = load_factory(args.factory)
    torch.set_num_threads(args.threads)
    limit = parse_bytes(args.memory)
    devices = dataclasses.replace(_devices_arg(args), memory_bytes=limit)
    captured = capture(model, inputs)
    start = time.perf_counter()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else None
    from .precision import resolve_mixed_precision

    plan, analysis = make_plan(captured, inputs, plan=None, devices=devices,
                               memory_limit_bytes=limit, optimizer=args.optimizer, fake=args.fake,
                               batch_sizes=batch_sizes,
                               precision=resolve_mixed_precision(args.mixed_precision))
    batch = plan.prediction.batch_size
    search_s = time.perf_counter() - start
    print(plan)
    rows = []
    from .plan import MESH_STRATEGIES, resolve_plan
    from .planner import param_specs, predict
    labels = {"replicate": "DDP", "full_shard": "FSDP", "hybrid_shard": "FSDP HYBRID_SHARD",
              "hierarchical": "two-stage collectives"}
    for name in ("replicate", "full_shard", *(MESH_STRATEGIES if devices.num_nodes > 1 else ())):
        other = predict(analysis, resolve_plan(name, param_specs(captured),
                                               world_size=devices.world_size,
                                               ranks_per_node=devices.ranks_per_node),
                        devices=devices, optimizer=args.optimizer, batch_size=batch)
        rows.append(_totals_row(f"all {name} ({labels[name]})", other, limit))
    rows.insert(0, _totals_row("searched (osdp-fx)", plan, limit))
    print(f"\nper rank, world size {devices.world_size}, limit {format_bytes(limit)}, "
          f"optimizer {args.optimizer}, batch {batch} per rank:")
    print(tabulate(rows, headers=["plan", "step ms", "samples/s", "peak memory", "fits"],
                   disable_numparse=True))
    print(f"profiled and planned in {search_s:.2f} s")
    if args.save:
        plan.save(args.save)
        print(f"plan saved to {args.save}")
    if args.memory_plot:
        from .plotting import plot_memory_timeline

        print(f"memory plot: {plot_memory_timeline(plan, args.memory_plot)}")
    return 0


def _totals_row(label: str, plan: Any, limit: int) -> list[str]:
    from .units import format_bytes

    pr = plan.prediction
    samples_per_s = pr.batch_size * plan.world_size / pr.step_time_s
    return [label, f"{pr.step_time_s * 1e3:.1f}", f"{samples_per_s:.1f}",
            format_bytes(pr.peak_memory_bytes), "yes" if pr.peak_memory_bytes <= limit else "NO"]


def profile_command(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from .capture import capture
    from .meta import osdp_meta
    from .planner import make_plan
    from .runtime.memory import measure_step_peak_bytes
    from .units import format_bytes

    model, inputs = load_factory(args.factory)
    torch.set_num_threads(args.threads)
    captured = capture(model, inputs)
    devices = dataclasses.replace(_devices_arg(args), world_size=1)
    plan, analysis = make_plan(captured, inputs, plan="replicate", devices=devices,
                               memory_limit_bytes=None, optimizer="sgd")
    rows = []
    for node in captured.gm.graph.nodes:
        p = osdp_meta(node).profile
        if node.op in ("placeholder", "output") or (p.fwd_flops == 0 and not p.output_bytes):
            continue
        rows.append([node.name, str(node.target)[:40], f"{p.fwd_flops:.3g}", f"{p.bwd_flops:.3g}",
                     format_bytes(p.output_bytes), format_bytes(p.saved_bytes),
                     _ms_or_dash(p.fwd_time_s), _ms_or_dash(p.bwd_time_s)])
    print(tabulate(rows, headers=["node", "target", "fwd FLOPs", "bwd FLOPs", "output",
                                  "saved", "fwd ms", "bwd ms"], disable_numparse=True))
    pr = plan.prediction
    # Measure the real step (world size 1, SGD) the prediction describes.
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)

    def step() -> None:
        out = model(*inputs)
        (out if out.dim() == 0 else out.float().sum()).backward()
        opt.step()

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        opt.zero_grad(set_to_none=True)
    measured_peak = measure_step_peak_bytes(step, params, opt, warmup_steps=1,
                                            zero_grad=lambda: opt.zero_grad(set_to_none=True))
    measured_s = sorted(times)[len(times) // 2]
    print(f"\ntotals: {sum(osdp_meta(n).profile.fwd_flops for n in captured.gm.graph.nodes):.4g} "
          f"forward FLOPs, {sum(osdp_meta(n).profile.bwd_flops for n in captured.gm.graph.nodes):.4g}"
          " backward FLOPs")
    print(tabulate([
        ["step time (SGD, one process)", f"{pr.step_time_s * 1e3:.2f} ms",
         f"{measured_s * 1e3:.2f} ms", f"{pr.step_time_s / measured_s - 1:+.1%}"],
        ["peak memory", format_bytes(pr.peak_memory_bytes), format_bytes(measured_peak),
         f"{pr.peak_memory_bytes / measured_peak - 1:+.1%}"],
    ], headers=["", "predicted", "measured", "error"], disable_numparse=True))
    return 0


def _ms_or_dash(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osdp_fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="train a small GPT on a local 2-rank gloo world")
    p_demo.add_argument("--world-size", type=int, default=2)
    p_demo.add_argument("--steps", type=int, default=5)
    p_demo.add_argument("--plan", default=None,
                        help="replicate, full_shard, shard_grad_op or a plan JSON file "
                             "(default: searched under --memory)")
    p_demo.add_argument("--memory", default="12MiB",
                        help="memory limit per rank for the searched plan")
    p_demo.add_argument("--memory-plot", default=None, metavar="FILE.png",
                        help="draw the plan's predicted memory over one step (needs matplotlib)")
    p_demo.set_defaults(func=demo)

    p_plan = sub.add_parser("plan", help="plan a model offline for hardware you describe")
    p_plan.add_argument("factory", help="FILE.py:FACTORY returning (model, example_inputs)")
    p_plan.add_argument("--world-size", type=int, default=8)
    p_plan.add_argument("--ranks-per-node", type=int, default=None)
    p_plan.add_argument("--memory", default="8GiB", help="memory limit per rank, e.g. 8GiB")
    p_plan.add_argument("--devices", default=None, help="Devices JSON (Devices.to_json)")
    p_plan.add_argument("--optimizer", default="adamw",
                        choices=["sgd", "sgd_momentum", "adam", "adamw"])
    p_plan.add_argument("--fake", action="store_true",
                        help="profile without running (FLOPs and bytes; roofline time)")
    p_plan.add_argument("--batch-sizes", default=None,
                        help="candidate per-rank batch sizes searched jointly, e.g. 1,2,4,8")
    p_plan.add_argument("--mixed-precision", default=None, choices=["bf16", "fp16"],
                        help="gather and compute in bf16 or fp16 (fp32 shards and reduction)")
    p_plan.add_argument("--threads", type=int, default=1)
    p_plan.add_argument("--save", default=None, help="write the plan as JSON to this path")
    p_plan.add_argument("--memory-plot", default=None, metavar="FILE.png",
                        help="draw the predicted memory over one step, stacked by category, "
                             "with the limit (needs matplotlib: pip install 'osdp-fx[bench]')")
    p_plan.set_defaults(func=plan_command)

    p_prof = sub.add_parser("profile", help="per-node FLOPs, bytes and time of a model")
    p_prof.add_argument("factory", help="FILE.py:FACTORY returning (model, example_inputs)")
    p_prof.add_argument("--devices", default=None, help="Devices JSON (Devices.to_json)")
    p_prof.add_argument("--repeats", type=int, default=5)
    p_prof.add_argument("--threads", type=int, default=1)
    p_prof.set_defaults(func=profile_command)
    p_prof.set_defaults(world_size=1, ranks_per_node=None)
    args = parser.parse_args(argv)
    from .errors import OSDPError

    try:
        return args.func(args)
    except OSDPError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

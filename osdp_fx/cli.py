"""Command line: ``python -m osdp_fx demo | plan | profile | devices``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .core import progress
from .core.devices import DEFAULT_CPU_MEMORY_BYTES
from .units import format_bytes


def _demo_rank(rank: int, world_size: int, steps: int, plan: str | None,
               memory_limit: str, quiet: bool = False) -> dict[str, Any]:
    from . import compile_osdp
    from .examples import TinyGPT, lm_loss

    if quiet:
        progress.configure("off")
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
    results = run_world(args.world_size, _demo_rank, args.steps, args.plan, args.memory,
                        args.quiet)
    first = results[0]
    print("\n== plan ==\n" + first["plan"])
    print("\n== rewritten graph (rank 0) ==" + first["code"])
    print("== training (mean loss over ranks) ==")
    for step, loss in enumerate(first["losses"]):
        print(f"step {step}: loss {loss:.4f}")
    per_rank = ", ".join(f"rank {r}: {res['local_param_numel']:,}" for r, res in enumerate(results))
    print(f"parameter elements held per rank: {per_rank}")
    if args.memory_plot:
        from .plan.plot import plot_memory_timeline

        print(f"memory plot of the plan: {plot_memory_timeline(first['plan_obj'], args.memory_plot)}")
    return 0


def load_factory(spec: str) -> tuple[Any, tuple[Any, ...]]:
    """Call ``FACTORY`` from ``FILE.py:FACTORY``; it returns ``(model, example_inputs)``."""
    import importlib.util
    import os

    from .errors import InputError
    from .passes.capture import as_input_tuple

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
    """The Devices of ``--devices`` (a preset name or a Devices JSON file; the defaults when
    not given) for ``--world-size`` ranks, ``--ranks-per-node`` when given, under the limit of
    ``--memory`` when given (``devices_for``: else the devices', else the CPU's default)."""
    import os

    from .core.devices import Devices
    from .core.presets import PRESETS, unknown_preset_message
    from .errors import InputError
    from .planner.detect import devices_for
    from .units import parse_bytes

    if args.devices in PRESETS:
        devices = Devices.preset(args.devices, world_size=args.world_size)
    elif args.devices and not os.path.exists(args.devices):
        raise InputError(unknown_preset_message(args.devices, "--devices: neither a file nor a "
                                                "device preset:"))
    else:
        devices = Devices.from_json(args.devices) if args.devices else Devices()
    memory = getattr(args, "memory", None)
    return devices_for(devices, world_size=args.world_size, ranks_per_node=args.ranks_per_node,
                       memory_limit_bytes=parse_bytes(memory) if memory else None,
                       device=torch.device("cpu"))


def _describe_devices(devices: Any, given: str | None, roofline: bool) -> str:
    """Where the figures come from and what they are, in lines under 120 columns."""
    mesh = (f"{devices.num_nodes} nodes x {devices.ranks_per_node}" if devices.num_nodes > 1
            else "one node")
    flops = devices.compute_flops_per_s_by_dtype or {"float32": devices.compute_flops_per_s}
    compute = ", ".join(f"{f / 1e12:.3g} {d}" for d, f in flops.items())
    source = devices.source or (f"file {given}" if given else "Devices() defaults")
    return textwrap.fill(
        f"devices: {source}, {devices.world_size} ranks ({mesh}); per rank: TFLOP/s {compute}; "
        f"memory {devices.memory_bandwidth_bytes_per_s / 1e12:.3g} TB/s; links "
        f"{devices.intra_node_bandwidth_bytes_per_s / 1e9:.3g} GB/s in a node, "
        f"{devices.inter_node_bandwidth_bytes_per_s / 1e9:.3g} GB/s across; node times "
        + ("from these figures (roofline)" if roofline else "measured on this machine"),
        width=119, subsequent_indent="  ")


def plan_command(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from .core.precision import resolve_mixed_precision
    from .core.setting import StepSetting
    from .passes.capture import capture
    from .plan.folded import folded_table
    from .planner.make import SearchOptions, plan_model
    from .units import format_bytes

    start = time.perf_counter()
    devices = _devices_arg(args)  # a misspelt --devices fails before the model is built
    with progress.task("build model"):
        model, inputs = load_factory(args.factory)
    torch.set_num_threads(args.threads)
    limit = devices.memory_bytes
    # Figures of hardware one describes give node times by roofline, never this machine's clock.
    fake = args.fake or args.devices is not None
    if args.devices is None and not args.quiet:
        print("note: no --devices: planning for Devices() defaults (1e11 FLOP/s, CPU-like); "
              "describe the GPUs with --devices NAME (python -m osdp_fx devices) or a Devices "
              "JSON", file=sys.stderr)
    precision = resolve_mixed_precision(args.mixed_precision)
    with progress.task("capture"):
        captured = capture(model, inputs,
                           compute_dtype=precision.param_dtype if precision else None)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else None
    setting = StepSetting(devices, optimizer=args.optimizer, precision=precision)
    with progress.task("plan (profile, search)"):
        planned = plan_model(captured, inputs, None, setting, SearchOptions(
            fake=fake, batch_sizes=tuple(batch_sizes) if batch_sizes else None,
            recompute=not args.no_recompute))
        plan, analysis = planned.plan, planned.analysis
    batch = plan.prediction.batch_size
    print(_describe_devices(devices, args.devices, fake or any(
        p.device.type == "meta" for p in captured.gm.parameters())))
    print(plan.table() if args.full else folded_table(plan))
    rows = []
    from .core.strategies import MESH_STRATEGIES
    from .planner.make import predict_totals, uniform_plan
    labels = {"replicate": "DDP", "full_shard": "FSDP", "hybrid_shard": "FSDP HYBRID_SHARD",
              "hierarchical": "two-stage collectives"}

    def row(label: str, named: Any) -> tuple[list[str], bool]:
        step_s, peak = predict_totals(analysis, named, setting.at_batch(batch))
        return _totals_row(label, step_s, peak, batch, devices.world_size, limit), peak <= limit

    with progress.task("compare with uniform plans"):
        for name in ("replicate", "full_shard",
                     *(MESH_STRATEGIES if devices.num_nodes > 1 else ())):
            named = uniform_plan(analysis, name, setting)
            uniform, fits = row(f"all {name} ({labels[name]})", named)
            rows.append(uniform)
            regions = analysis.facts.regions
            if not fits and regions:
                # what its users run where it does not fit: every block checkpointed
                rows.append(row(f"all {name} ({labels[name]}) + checkpointing every block",
                                dataclasses.replace(named, recompute=tuple(
                                    (r, "full") for r in regions)))[0])
    rows.insert(0, _totals_row("searched (osdp-fx)", plan.prediction.step_time_s,
                               plan.prediction.peak_memory_bytes, batch, plan.world_size, limit))
    print(f"\nper rank, world size {devices.world_size}, limit {format_bytes(limit)}, "
          f"optimizer {args.optimizer}, batch {batch} per rank:")
    print(tabulate(rows, headers=["plan", "step ms", "samples/s", "peak memory", "fits"],
                   disable_numparse=True))
    print(f"built, profiled and planned in {time.perf_counter() - start:.2f} s")
    if args.save:
        plan.save(args.save)
        print(f"plan saved to {args.save}")
    if args.memory_plot:
        from .plan.plot import plot_memory_timeline

        print(f"memory plot: {plot_memory_timeline(plan, args.memory_plot)}")
    return 0


def _totals_row(label: str, step_s: float, peak_bytes: int, batch: int, world_size: int,
                limit: int) -> list[str]:
    from .units import format_bytes

    return [label, f"{step_s * 1e3:.1f}", f"{batch * world_size / step_s:.1f}",
            format_bytes(peak_bytes), "yes" if peak_bytes <= limit else "NO"]


def profile_command(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from .core.node_meta import osdp_meta
    from .core.setting import StepSetting
    from .passes.capture import capture
    from .planner.make import plan_model
    from .runtime.memory import measure_step_peak_bytes
    from .units import format_bytes

    with progress.task("build model"):
        model, inputs = load_factory(args.factory)
    torch.set_num_threads(args.threads)
    with progress.task("capture"):
        captured = capture(model, inputs)
    setting = StepSetting(_devices_arg(args), optimizer="sgd")  # world size 1
    with progress.task("plan (profile)"):
        plan = plan_model(captured, inputs, "replicate", setting).plan
    rows = []
    for node in captured.gm.graph.nodes:
        p = osdp_meta(node).profile
        if node.op in ("placeholder", "output") or (p.fwd_flops == 0 and not p.output_bytes):
            continue
        rows.append([node.name, _target_text(node.target)[:40], f"{p.fwd_flops:.3g}",
                     f"{p.bwd_flops:.3g}",
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


def _target_text(target: Any) -> str:
    """A node's target as the profile table names it: a method's or attribute's name, an
    operator overload as torch prints it (``aten.mm.default``), a function by its name
    (``cross_entropy``, not its ``repr`` with an address)."""
    if isinstance(target, (str, torch._ops.OpOverload)):
        return str(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def _ms_or_dash(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


PLAN_EXAMPLES = """examples:
  python -m osdp_fx plan osdp_fx/examples.py:hf_gpt2_xl_meta --devices h100-sxm-8x \\
      --world-size 1024 --memory 24GiB --mixed-precision bf16
    GPT-2 XL (1.56 B parameters) on 128 DGX H100 nodes, planned on a laptop from the
    preset's datasheet figures; python -m osdp_fx devices lists the presets
  python -m osdp_fx plan osdp_fx/examples.py:tiny_gpt --world-size 8 --memory 96MiB --full
    a small GPT, every parameter group on its own line

FACTORY is a function in FILE.py returning (model, example_inputs), the inputs of one rank's
step; a model built under torch.device("meta") is planned without allocating it.
"""


def devices_command(args: argparse.Namespace) -> int:
    """List the hardware presets, or show one (and write it as a Devices JSON to edit)."""
    from tabulate import tabulate

    from .core.devices import Devices
    from .core.presets import PRESETS, get_preset
    from .units import format_bytes

    if args.name is None:
        rows = []
        for p in PRESETS.values():
            peak = p.peak_flops_per_s
            half = {f"{peak[d] / 1e12:.4g}" for d in ("bfloat16", "float16")}
            rows.append([p.name, str(p.ranks_per_node), format_bytes(p.memory_bytes),
                         "|".join(sorted(half, key=float)), f"{peak['float32'] / 1e12:.4g}",
                         f"{p.memory_bandwidth_bytes_per_s / 1e12:.2f}",
                         f"{p.intra_node_link_bytes_per_s / 1e9:.0f}",
                         f"{p.inter_node_link_bytes_per_s / 1e9:.2f}",
                         f"{p.compute_efficiency:.2f}"])
        print(tabulate(rows, headers=["preset", "GPUs", "memory", "bf16|fp16 TF/s",
                                      "fp32 TF/s", "mem TB/s", "node GB/s", "net GB/s", "eff"],
                       disable_numparse=True))
        first = next(iter(PRESETS.values()))
        print(textwrap.fill(
            "Datasheet figures per GPU: dense peaks, link rates per direction inside a node "
            "(node) and of the network per GPU (net). Plans use them times efficiencies: "
            f"compute as listed (eff), memory {first.memory_efficiency}, links "
            f"{first.link_efficiency:.2f}. `python -m osdp_fx devices NAME` shows one preset "
            "with its sources; add --json FILE to write it as a Devices JSON to edit.",
            width=100))
        return 0
    preset = get_preset(args.name)
    devices = Devices.preset(args.name, world_size=args.world_size)
    def wrapped(text: str, indent: str = "") -> None:
        print(textwrap.fill(text, width=100, subsequent_indent=indent + "  "))

    wrapped(f"{preset.name}: {preset.summary}")
    wrapped(f"efficiencies: compute {preset.compute_efficiency:.3f}, memory "
            f"{preset.memory_efficiency:.2f}, links {preset.link_efficiency:.3f} (osdp_fx/"
            "core/presets.py, [Note: preset efficiencies]); fused attention at "
            f"{devices.attention_efficiency:.2f} of the matmul rate (fitted on five published "
            "runs, ATTENTION_EFFICIENCY)")
    if preset.notes:
        wrapped(f"notes: {preset.notes}")
    print("sources:")
    for source in preset.sources:
        wrapped(f"  - {source}", "  ")
    print(f"Devices.preset({preset.name!r}, world_size={devices.world_size}):")
    for field in dataclasses.fields(devices):
        value = getattr(devices, field.name)
        if value not in ({}, None, ""):
            print(f"  {field.name} = {value!r}")
    if args.json:
        devices.to_json(args.json)
        print(f"written to {args.json}: edit it and pass it with --devices {args.json}")
    return 0


@contextlib.contextmanager
def _output(quiet: bool) -> Iterator[None]:
    """Progress and log lines on stderr while a command runs: a bar on a terminal, INFO log
    lines otherwise, warnings only with ``quiet``; restored afterwards."""
    mode = "off" if quiet else ("bar" if sys.stderr.isatty() else "log")
    logger = logging.getLogger("osdp_fx")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[osdp-fx] %(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if mode == "log" else logging.WARNING)
    logger.propagate = False
    progress.configure(mode)
    try:
        yield
    finally:
        progress.configure("auto")
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar or log lines on stderr (only warnings and errors)")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every subcommand and option, each with its help text."""
    parser = argparse.ArgumentParser(prog="python -m osdp_fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="train a small GPT on a local 2-rank gloo world")
    p_demo.add_argument("--world-size", type=int, default=2,
                        help="local gloo ranks to start (default 2)")
    p_demo.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p_demo.add_argument("--plan", default=None,
                        help="replicate, shard_grad_op, full_shard, hybrid_shard, hierarchical or a plan JSON file "
                             "(default: searched under --memory)")
    p_demo.add_argument("--memory", default="12MiB",
                        help="memory limit per rank for the searched plan (default 12MiB)")
    p_demo.add_argument("--memory-plot", default=None, metavar="FILE.png",
                        help="draw the plan's predicted memory over one step (needs matplotlib)")
    _add_quiet(p_demo)
    p_demo.set_defaults(func=demo)

    p_plan = sub.add_parser(
        "plan", help="plan a model offline for hardware you describe",
        description="Search the per-parameter plan of a model for a cluster you describe,\n"
                    "print it (repeated blocks folded) and compare it with uniform plans.",
        epilog=PLAN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p_plan.add_argument("factory", metavar="FILE.py:FACTORY",
                        help="function returning (model, example_inputs) of one rank")
    p_plan.add_argument("--world-size", type=int, default=8,
                        help="ranks (GPUs) to plan for (default 8)")
    p_plan.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks sharing a node's fast links (default: the preset's, else "
                             "all on one node); enables hybrid_shard and hierarchical")
    p_plan.add_argument("--memory", default=None,
                        help="memory limit per rank, e.g. 24GiB (default: the preset's GPU "
                             f"memory, else {format_bytes(DEFAULT_CPU_MEMORY_BYTES)}, as "
                             "compile_osdp's on the CPU)")
    p_plan.add_argument("--devices", default=None, metavar="PRESET|FILE.json",
                        help="the hardware: a preset (python -m osdp_fx devices lists them, e.g. "
                             "h100-sxm-8x) or a Devices JSON (Devices.to_json); node times then "
                             "come from its figures (roofline). Default: Devices() defaults")
    p_plan.add_argument("--optimizer", default="adamw",
                        choices=["sgd", "sgd_momentum", "adam", "adamw"],
                        help="optimizer whose state and step time are predicted (default adamw)")
    p_plan.add_argument("--fake", action="store_true",
                        help="profile without running (FLOPs and bytes; roofline time)")
    p_plan.add_argument("--batch-sizes", default=None,
                        help="candidate per-rank batch sizes searched jointly, e.g. 1,2,4,8")
    p_plan.add_argument("--mixed-precision", default=None, choices=["bf16", "fp16"],
                        help="gather and compute in bf16 or fp16 (fp32 shards and reduction)")
    p_plan.add_argument("--no-recompute", action="store_true",
                        help="search strategies and schedule only, recomputing no activations")
    p_plan.add_argument("--threads", type=int, default=1,
                        help="CPU threads for profiling on this machine (default 1)")
    p_plan.add_argument("--full", action="store_true",
                        help="print every parameter group on its own line (default: repeated "
                             "blocks folded into one line per distinct pattern)")
    p_plan.add_argument("--save", default=None, metavar="PLAN.json",
                        help="write the plan as JSON to this path")
    p_plan.add_argument("--memory-plot", default=None, metavar="FILE.png",
                        help="draw the predicted memory over one step, stacked by category, "
                             "with the limit (needs matplotlib: pip install 'osdp-fx[bench]')")
    _add_quiet(p_plan)
    p_plan.set_defaults(func=plan_command)

    p_prof = sub.add_parser("profile", help="per-node FLOPs, bytes and time of a model")
    p_prof.add_argument("factory", metavar="FILE.py:FACTORY",
                        help="function returning (model, example_inputs)")
    p_prof.add_argument("--devices", default=None, metavar="PRESET|FILE.json",
                        help="figures the prediction uses besides the measured node times "
                             "(default: Devices() defaults)")
    p_prof.add_argument("--repeats", type=int, default=5,
                        help="measured steps; the median is compared (default 5)")
    p_prof.add_argument("--threads", type=int, default=1,
                        help="CPU threads for profiling and the measured steps (default 1)")
    _add_quiet(p_prof)
    p_prof.set_defaults(func=profile_command)
    p_prof.set_defaults(world_size=1, ranks_per_node=None)

    p_dev = sub.add_parser("devices", help="list the hardware presets --devices takes",
                           description="List the hardware presets, or show one with its "
                                       "sources and the Devices it gives.")
    p_dev.add_argument("name", nargs="?", default=None,
                       help="a preset to show (default: list them all)")
    p_dev.add_argument("--world-size", type=int, default=None,
                       help="ranks of the Devices shown (default: one node)")
    p_dev.add_argument("--json", default=None, metavar="FILE.json",
                       help="write the preset as a Devices JSON file, to edit and pass back")
    p_dev.set_defaults(func=devices_command, quiet=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .errors import OSDPError

    try:
        with _output(args.quiet):
            return args.func(args)
    except OSDPError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""osdp-fx against DDP and FSDP2: step time, throughput, peak memory and communication per step.

Starts one local world (gloo on CPU, NCCL on GPUs when ``torch.cuda.is_available()``), one
thread per rank on this 2-core machine, and on the same model, per-rank batch and world measures,
one system after the other:

- DDP: ``torch.nn.parallel.DistributedDataParallel`` (defaults: 25 MiB buckets, gradients not
  bucket views);
- FSDP2: ``torch.distributed.fsdp.fully_shard`` on every transformer block, then on the root,
  over ``init_device_mesh(device_type, (world,))``;
- osdp-fx with ``plan="replicate"``, ``"full_shard"``, ``"shard_grad_op"``, ``"full_shard"``
  with ``prefetch=0`` (what prefetching the all-gathers changes), and the searched
  plan (``plan=None``) at ``--limits`` memory limits evenly spaced strictly between FSDP2's and
  DDP's measured peaks (the middle one of the default 3 is the halfway limit of the targets).

The model is a GPT whose forward returns its LM loss (``osdp_fx.examples.GPTWithLoss(TinyGPT)``;
default vocab 2048, dim 512, depth 4, 8 heads, sequence 32, per-rank batch 8), trained with
AdamW. osdp-fx compiles with ``detect_devices()`` measured once, so its predictions use this
machine's figures.

    python benchmarks/compare.py [--world-size 2] [--dim 512] [--depth 4] [--vocab 2048]
        [--heads 8] [--batch 8] [--seq 32] [--steps 8] [--warmup 2] [--limits 3]

What is measured, per system:

- step time: each step (forward, backward, AdamW step, zero_grad) starts after a barrier and ends
  after a device synchronize; a step's time is the slowest rank's; the table shows the median
  over ``--steps`` steps after ``--warmup`` warm-up steps. Samples/s = world x batch / median.
- peak memory per rank: what exists before a steady-state step (parameters and optimizer state,
  counted by storage; DTensors by their ``_local_tensor``) plus the live-tensor tracker's peak
  during forward + backward + optimizer step (``osdp_fx.runtime.memory``; not RSS). osdp-fx
  uses ``measure_step_peak_bytes`` itself. The baselines use the same tracker, extended so that
  (a) DTensor outputs count their local storage, (b) FSDP2's in-place storage resizes of its
  unsharded parameters (``alloc_storage``/``free_storage``, which bypass the dispatcher) are
  counted, and (c) DDP's gradient buckets, which its C++ reducer allocates once outside any
  step, count as existing (their size from ``DDP._get_ddp_logging_data()['bucket_sizes']``).
  The table shows the largest rank.
- communication per step, as the bytes of the full buffer of each collective (all-gather: the
  gathered output; reduce-scatter: the unreduced input; all-reduce: the tensor), summed:
  osdp-fx from the plan (``Plan.collectives_of``), FSDP2 counted by wrapping the
  ``torch.distributed`` collectives during one step; DDP's all-reduces run inside its C++
  reducer, invisible from Python, so DDP's figure is the sum of its gradient bytes (what its
  buckets all-reduce). The "counted" column is the wrapped count for every system (osdp-fx's
  too, as a check of the plan's figure: equal for replicate and shard_grad_op; for full_shard
  the plan's figure is an upper bound, since the runtime re-gathers in backward only the
  parameters backward needs, not e.g. biases).

Targets (issue 7): replicate <= 1.10x DDP's step time; full_shard <= 1.0x FSDP2's step time and
peak memory; the searched plan under the limit halfway between FSDP2's and DDP's peaks stays
under that limit and steps in <= 0.8x FSDP2's time.

Prints a Markdown table and, last, one JSON line with the key ratios; writes the table to
``benchmarks/results/compare-world{N}.md`` and a plot (matplotlib, when installed) to
``benchmarks/results/compare-world{N}.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from osdp_fx import Devices, compile_osdp, detect_devices  # noqa: E402
from osdp_fx.errors import PlanError  # noqa: E402
from osdp_fx.examples import GPTWithLoss, TinyGPT  # noqa: E402
from osdp_fx.runtime import collectives as osdp_collectives  # noqa: E402
from osdp_fx.runtime.launch import local_device, run_world  # noqa: E402
from osdp_fx.runtime.memory import LiveTensorTracker, measure_step_peak_bytes  # noqa: E402
from osdp_fx.units import format_bytes  # noqa: E402

MiB = 2**20
RESULTS_DIR = Path(__file__).resolve().parent / "results"
UNIFORM_PLANS = ("replicate", "full_shard", "shard_grad_op")


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 2048
    dim: int = 512
    depth: int = 4
    heads: int = 8
    seq: int = 32
    batch: int = 8
    steps: int = 8
    warmup: int = 2
    limits: int = 3


# ---- the world ----------------------------------------------------------------------------

def _on_local_device(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(rank, world, local_device(rank, world), *args)


def start_world(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(rank, world, device, *args)`` on ``world`` local ranks: gloo on CPU, NCCL on GPUs."""
    return run_world(world, _on_local_device, fn, *args, timeout_s=1800.0,
                     collective_timeout_s=300.0)


# ---- measuring ----------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor itself."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


class BaselineTracker(LiveTensorTracker):
    """The live-tensor tracker, starting from ``existing`` storages, counting DTensor outputs by
    their local storage, and counting storages resized in place that it has not seen yet (FSDP2
    re-allocates its unsharded parameters with ``untyped_storage().resize_``)."""

    def __init__(self, existing: dict[int, int]) -> None:
        super().__init__()
        self._seen.update(existing)
        self.live_bytes = self.peak_bytes = sum(existing.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {
            _local(t).untyped_storage()._cdata for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = _local(t).untyped_storage()
                if storage._cdata not in inputs:
                    self._count(storage)
        return out

    def resized(self, storage: torch.UntypedStorage) -> None:
        with self._lock:
            known = storage._cdata in self._seen
        if known:
            super().resized(storage)
            with self._lock:
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        elif storage.nbytes():
            self._count(storage)


@contextlib.contextmanager
def fsdp2_resizes_reported() -> Iterator[None]:
    """Report FSDP2's in-place storage resizes to active trackers (they bypass the dispatcher)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    from osdp_fx.runtime.memory import note_resized

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(tensor: torch.Tensor) -> None:
        alloc(tensor)
        note_resized(tensor.untyped_storage())

    def free_storage(tensor: torch.Tensor) -> None:
        free(tensor)
        note_resized(tensor.untyped_storage())

    patched = [(_fsdp_param, "alloc_storage", alloc_storage),
               (_fsdp_param, "free_storage", free_storage),
               (_fsdp_param_group, "alloc_storage", alloc_storage)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patched if hasattr(mod, name)]
    for mod, name, new in patched:
        if hasattr(mod, name):
            setattr(mod, name, new)
    try:
        yield
    finally:
        for mod, name, old in saved:
            setattr(mod, name, old)


def storage_bytes(tensors: list[torch.Tensor]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        out[s._cdata] = s.nbytes()
    return out


def optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def baseline_peak_bytes(step: Callable[[], None], params: list[torch.Tensor],
                        opt: torch.optim.Optimizer, zero_grad: Callable[[], None],
                        extra_bytes: int = 0) -> int:
    """``measure_step_peak_bytes`` (after warm-up) for DDP/FSDP2: parameters + optimizer state
    + ``extra_bytes`` existing before the step, plus the tracker's peak during it."""
    existing = storage_bytes([*params, *optimizer_state(opt)])
    tracker = BaselineTracker(existing)
    with fsdp2_resizes_reported(), tracker:
        step()
    zero_grad()
    return tracker.peak_bytes + extra_bytes


class CommCounter:
    """Bytes of the collectives issued from Python while active (full buffer of each)."""

    # name -> (index of the tensor that is the full buffer, its keyword)
    WATCHED: ClassVar[dict[str, tuple[int, str]]] = {
        "all_reduce": (0, "tensor"),
        "all_gather_into_tensor": (0, "output_tensor"),
        "all_gather_single": (0, "output_tensor"),
        "reduce_scatter_tensor": (1, "input"),
        "reduce_scatter_single": (1, "input"),
        "broadcast": (0, "tensor"),
    }

    def __init__(self) -> None:
        self.bytes = 0
        self.calls: dict[str, int] = {}
        self._depth = threading.local()

    def _wrap(self, name: str, fn: Callable[..., Any], index: int, key: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._depth, "n", 0) == 0:
                t = args[index] if len(args) > index else kwargs.get(key)
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
                    self.calls[name] = self.calls.get(name, 0) + 1
            self._depth.n = getattr(self._depth, "n", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n -= 1
        return wrapper

    @contextlib.contextmanager
    def counting(self) -> Iterator[CommCounter]:
        saved: list[tuple[Any, str, Any]] = []
        for name, (index, key) in self.WATCHED.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                saved.append((dist, name, fn))
                setattr(dist, name, self._wrap(name, fn, index, key))
        # osdp-fx binds its all-gather / reduce-scatter implementations at import
        for attr, (index, key) in (("_all_gather_flat_impl", (0, "output_tensor")),
                                   ("_reduce_scatter_flat_impl", (1, "input"))):
            fn = getattr(osdp_collectives, attr, None)
            if fn is not None:
                saved.append((osdp_collectives, attr, fn))
                setattr(osdp_collectives, attr, self._wrap(fn.__name__, fn, index, key))
        try:
            yield self
        finally:
            for mod, name, fn in reversed(saved):
                setattr(mod, name, fn)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def every_rank(value: float, device: torch.device) -> list[float]:
    """Every rank's ``value`` (collective)."""
    out = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([float(value)], dtype=torch.float64, device=device))
    return [float(x.item()) for x in out]


# ---- the systems --------------------------------------------------------------------------

def build_model(cfg: Config, device: torch.device) -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(TinyGPT(vocab=cfg.vocab, dim=cfg.dim, depth=cfg.depth, heads=cfg.heads,
                               max_seq=cfg.seq)).to(device)


def local_batch(cfg: Config, rank: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen).to(device)


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients of the distinct trainable parameters (tied weights once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


PHASES = ("forward", "backward", "optimizer")


class System:
    """One system's model, AdamW optimizer and batch; measures its steps."""

    def __init__(self, system: str, plan: str, model: torch.nn.Module, x: torch.Tensor,
                 device: torch.device, **info: Any) -> None:
        self.system, self.plan, self.model, self.x, self.device = system, plan, model, x, device
        self.params = list(model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.info: dict[str, Any] = dict(info)
        self.phase_times: list[tuple[float, float, float]] = []

    def step(self) -> None:
        self.model(self.x).backward()
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def timed_step(self) -> tuple[float, float, float]:
        """Seconds of forward, backward and optimizer step + zero_grad (device-synchronized)."""
        def sync() -> None:
            synchronize(self.device)

        sync()
        t0 = time.perf_counter()
        loss = self.model(self.x)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        self.opt.step()
        self.zero_grad()
        sync()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    def measure_peak(self, *, warmup: int, osdp: bool, extra_bytes: int = 0) -> int:
        if osdp:
            return measure_step_peak_bytes(self.step, self.params, self.opt,
                                           zero_grad=self.zero_grad, warmup_steps=warmup)
        for _ in range(warmup):
            self.step()
            self.zero_grad()
        return baseline_peak_bytes(self.step, self.params, self.opt, self.zero_grad, extra_bytes)

    def count_comm(self) -> CommCounter:
        counter = CommCounter()
        with counter.counting():
            self.step()
        self.zero_grad()
        synchronize(self.device)
        return counter

    def row(self, world: int, batch: int) -> dict[str, Any]:
        """Collective: the step times are the slowest rank's."""
        t = torch.tensor(self.phase_times, dtype=torch.float64, device=self.device)
        t = torch.cat([t, t.sum(dim=1, keepdim=True)], dim=1)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        t = t.cpu()
        median = statistics.median(t[:, 3].tolist())
        return {
            "system": self.system, "plan": self.plan, "step_s": median,
            "step_s_all": t[:, 3].tolist(), "samples_per_s": batch * world / median,
            **{f"{name}_s": statistics.median(t[:, i].tolist()) for i, name in enumerate(PHASES)},
            **self.info,
        }


def time_round_robin(systems: list[System], steps: int, warmup: int) -> None:
    """``warmup`` steps of each system, then ``steps`` rounds of one step of every system, the
    order rotated each round, so that changes in the machine's load hit every system alike."""
    for s in systems:
        for _ in range(warmup):
            dist.barrier()
            s.timed_step()
    for r in range(steps):
        k = r % len(systems)
        for s in systems[k:] + systems[:k]:
            dist.barrier()
            s.phase_times.append(s.timed_step())


def make_ddp(cfg: Config, device: torch.device, x: torch.Tensor) -> System:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(cfg, device)
    grads = gradient_bytes(model)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    s = System("DDP", "-", ddp, x, device)
    # The reducer's bucket buffers exist from construction on (rebuilt after the first step),
    # allocated in C++ outside the tracked step: count them as existing memory.
    for _ in range(max(2, cfg.warmup)):
        s.step()
        s.zero_grad()
    try:
        sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
        buckets = sum(int(v) for v in sizes.replace(" ", "").split(",") if v)
    except Exception:  # noqa: BLE001 - private API; fall back to the gradient bytes
        buckets = 0
    buckets = buckets or grads
    peak = s.measure_peak(warmup=0, osdp=False, extra_bytes=buckets)
    counter = s.count_comm()
    s.info.update(peak_bytes_per_rank=every_rank(peak, device), bucket_bytes=buckets,
                  comm_bytes=grads, counted_comm_bytes=counter.bytes,
                  comm_note="sum of gradient bytes (C++ reducer all-reduces them in buckets)")
    return s


def fsdp2_model(cfg: Config, world: int, device: torch.device,
                wrap_block: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module:
    """The GPT under FSDP2: ``fully_shard`` on every transformer block (after ``wrap_block(block)``
    when given, e.g. activation checkpointing), then on the root, over a 1-D mesh of ``world``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(cfg, device)
    mesh = init_device_mesh(device.type, (world,))
    for block in model.model.blocks:
        if wrap_block is not None:
            wrap_block(block)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_fsdp2(cfg: Config, world: int, device: torch.device, x: torch.Tensor) -> System:
    s = System("FSDP2", "-", fsdp2_model(cfg, world, device), x, device)
    peak = s.measure_peak(warmup=max(2, cfg.warmup), osdp=False)
    counter = s.count_comm()
    s.info.update(peak_bytes_per_rank=every_rank(peak, device), comm_bytes=counter.bytes,
                  counted_comm_bytes=counter.bytes,
                  comm_note="counted: wrapped torch.distributed collectives")
    return s


def make_osdp(cfg: Config, world: int, device: torch.device, x: torch.Tensor,
              devices: Devices, plan: str | None, limit: int | None,
              prefetch: int | None = None) -> System | dict[str, Any]:
    """A compiled osdp-fx system, or the error row when no plan fits the limit."""
    model = build_model(cfg, device)
    label = plan if plan is not None else f"searched @ {format_bytes(limit)}"
    if prefetch is not None:
        label += f" (prefetch {prefetch})"
    start = time.perf_counter()
    try:
        compiled = compile_osdp(model, (x,), devices, plan=plan, memory_limit=limit,
                                optimizer="adamw", prefetch=prefetch)
    except PlanError as e:  # the same on every rank: the memory figures are shape-based
        return {"system": "osdp-fx", "plan": label, "limit_bytes": limit, "error": str(e)}
    compile_s = time.perf_counter() - start
    del model
    p = compiled.plan
    s = System("osdp-fx", label, compiled, x, device)
    peak = s.measure_peak(warmup=max(2, cfg.warmup), osdp=True)
    counter = s.count_comm()
    s.info.update(
        peak_bytes_per_rank=every_rank(peak, device), limit_bytes=limit,
        plan_counts=p.counts(), compile_s=compile_s,
        predicted_step_s=p.step_time_s, predicted_peak_bytes=p.peak_memory_bytes,
        predicted_phases_s={"compute": p.prediction.compute_s, "comm": p.prediction.comm_s,
                            "optimizer": p.prediction.optim_s} if p.prediction else None,
        comm_bytes=sum(stage.nbytes for pp in p.params for side in p.collectives_of(pp)
                       for stage in side),
        counted_comm_bytes=counter.bytes,
        comm_note="from the plan: full buffer of each collective",
    )
    return s


def measure(rank: int, world: int, device: torch.device, cfg: Config,
            sequential: bool) -> dict[str, Any]:
    """Every system on this rank; the rows (identical on every rank) come back from rank 0."""
    x = local_batch(cfg, rank, device)
    timings: dict[str, float] = {}
    pending: list[System] = []
    rows: list[dict[str, Any]] = []

    def add(name: str, make: Callable[[], System | dict[str, Any]]) -> Any:
        start = time.perf_counter()
        s = make()
        if isinstance(s, System):
            s.info["peak_bytes"] = max(s.info["peak_bytes_per_rank"])
            pending.append(s)
            if sequential:  # time it now and free it before the next system is built
                time_round_robin([s], cfg.steps, cfg.warmup)
                rows.append(s.row(world, cfg.batch))
                pending.remove(s)
        else:
            rows.append(s)
        timings[name] = time.perf_counter() - start
        return s

    high = add("DDP", lambda: make_ddp(cfg, device, x)).info["peak_bytes"]
    low = add("FSDP2", lambda: make_fsdp2(cfg, world, device, x)).info["peak_bytes"]
    limits = [int(low + (high - low) * (k + 1) / (cfg.limits + 1)) for k in range(cfg.limits)]
    start = time.perf_counter()
    devices = detect_devices()
    timings["detect_devices"] = time.perf_counter() - start
    for plan in UNIFORM_PLANS:
        add(plan, lambda plan=plan: make_osdp(cfg, world, device, x, devices, plan, None))
    # what prefetching changes: the same full_shard plan, each all-gather started at its use
    add("full_shard (prefetch 0)",
        lambda: make_osdp(cfg, world, device, x, devices, "full_shard", None, prefetch=0))
    for limit in limits:
        add(f"searched @ {format_bytes(limit)}",
            lambda limit=limit: make_osdp(cfg, world, device, x, devices, None, limit))
    if pending:
        start = time.perf_counter()
        time_round_robin(pending, cfg.steps, cfg.warmup)
        timings["timed rounds"] = time.perf_counter() - start
        rows.extend(s.row(world, cfg.batch) for s in pending)
    order = {id(r): i for i, r in enumerate(rows)}
    rank_of = {"DDP": 0, "FSDP2": 1}
    rows.sort(key=lambda r: (rank_of.get(r["system"], 2), r.get("limit_bytes") or 0,
                             UNIFORM_PLANS.index(r["plan"]) if r["plan"] in UNIFORM_PLANS else 9,
                             order[id(r)]))
    return {"rows": rows, "limits": limits, "timings_s": timings,
            "backend": dist.get_backend(), "device": str(device)}


# ---- reporting ----------------------------------------------------------------------------

def _mib(b: float | None) -> str:
    if b is None:
        return "-"
    return f"{b / MiB:.1f}" if b >= 10 * MiB else f"{b / MiB:.3f}"


def _load(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _s(t: float | None) -> str:
    return "-" if t is None else f"{t:.3f}"


def table(rows: list[dict]) -> str:
    head = ("| system | plan | step s (median) | fwd / bwd / opt s | samples/s | peak MiB "
            "(max rank) | predicted step s | predicted peak MiB | limit MiB | fits | "
            "comm MiB/step | counted MiB/step |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['plan']} | no plan fits | - | - | - | - | - | "
                         f"{_mib(r.get('limit_bytes'))} | - | - | - |")
            continue
        limit = r.get("limit_bytes")
        fits = "-" if limit is None else ("yes" if r["peak_bytes"] <= limit else "NO")
        counts = r.get("plan_counts")
        plan = r["plan"] + (
            " (" + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ")"
            if counts and r["plan"].startswith("searched") else "")
        phases = " / ".join(f"{r[f'{name}_s']:.3f}" for name in PHASES)
        lines.append(
            f"| {r['system']} | {plan} | {_s(r['step_s'])} | {phases} | "
            f"{r['samples_per_s']:.1f} | {_mib(r['peak_bytes'])} | "
            f"{_s(r.get('predicted_step_s'))} | {_mib(r.get('predicted_peak_bytes'))} | "
            f"{_mib(limit)} | {fits} | {_mib(r['comm_bytes'])} | "
            f"{'n/a (C++ reducer)' if r['system'] == 'DDP' else _mib(r['counted_comm_bytes'])} |")
    return "\n".join(lines)


def key_ratios(rows: list[dict], limits: list[int], world: int) -> dict[str, Any]:
    by = {(r["system"], r["plan"]): r for r in rows}
    ddp, fsdp = by[("DDP", "-")], by[("FSDP2", "-")]
    rep, full = by.get(("osdp-fx", "replicate")), by.get(("osdp-fx", "full_shard"))
    out: dict[str, Any] = {"world_size": world}

    def ok(r: dict | None) -> bool:
        return r is not None and "error" not in r

    out["replicate_over_ddp_step"] = (round(rep["step_s"] / ddp["step_s"], 3) if ok(rep) else None)
    out["full_shard_over_fsdp2_step"] = (round(full["step_s"] / fsdp["step_s"], 3)
                                         if ok(full) else None)
    out["full_shard_over_fsdp2_peak"] = (round(full["peak_bytes"] / fsdp["peak_bytes"], 3)
                                         if ok(full) else None)
    half = (fsdp["peak_bytes"] + ddp["peak_bytes"]) / 2
    mid = min(limits, key=lambda lim: abs(lim - half)) if limits else None
    searched = next((r for r in rows if r["system"] == "osdp-fx" and r.get("limit_bytes") == mid
                     and mid is not None), None)
    out["halfway_limit_mib"] = round(mid / MiB, 1) if mid else None
    out["searched_at_halfway_fits"] = (searched["peak_bytes"] <= mid) if ok(searched) else False
    out["searched_at_halfway_over_fsdp2_step"] = (round(searched["step_s"] / fsdp["step_s"], 3)
                                                  if ok(searched) else None)
    targets = {
        "replicate<=1.10xDDP_step": ok(rep) and out["replicate_over_ddp_step"] <= 1.10,
        "full_shard<=1.0xFSDP2_step": ok(full) and out["full_shard_over_fsdp2_step"] <= 1.0,
        "full_shard<=1.0xFSDP2_peak": ok(full) and out["full_shard_over_fsdp2_peak"] <= 1.0,
        "searched@halfway_fits": bool(out["searched_at_halfway_fits"]),
        "searched@halfway<=0.8xFSDP2_step": ok(searched)
        and out["searched_at_halfway_over_fsdp2_step"] <= 0.8,
    }
    out["targets_met"] = targets
    return out


def plot(rows: list[dict], path: Path, title: str) -> str | None:
    """The throughput / memory plot; returns why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): plot skipped"
    good = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)

    def spread(r: dict) -> list[list[float]]:
        """Error bar: the quartiles of the per-step throughput around the median's."""
        per_step = [r["samples_per_s"] * r["step_s"] / t for t in r["step_s_all"]]
        if len(per_step) < 2:
            return [[0.0], [0.0]]
        q1, _, q3 = statistics.quantiles(per_step, n=4, method="inclusive")
        return [[max(0.0, r["samples_per_s"] - q1)], [max(0.0, q3 - r["samples_per_s"])]]

    def point(r: dict, x: float, marker: str, color: str, label: str, size: float = 9) -> None:
        ax.errorbar([x], [r["samples_per_s"]], yerr=spread(r), fmt=marker, color=color,
                    markersize=size, capsize=3, label=label, zorder=3)

    styles = {"DDP": ("s", "tab:blue"), "FSDP2": ("D", "tab:orange")}
    for r in good:
        if r["system"] in styles:
            marker, color = styles[r["system"]]
            point(r, r["peak_bytes"] / MiB, marker, color, f"{r['system']} (at its peak)")
    uniform = {"replicate": ("^", "tab:green"), "full_shard": ("v", "tab:red"),
               "shard_grad_op": ("P", "tab:purple")}
    for r in good:
        if r["system"] == "osdp-fx" and r["plan"] in uniform:
            marker, color = uniform[r["plan"]]
            point(r, r["peak_bytes"] / MiB, marker, color, f"osdp-fx {r['plan']} (at its peak)")
    searched = sorted((r for r in good if r["plan"].startswith("searched")),
                      key=lambda r: r["limit_bytes"])
    if searched:
        ax.plot([r["limit_bytes"] / MiB for r in searched],
                [r["samples_per_s"] for r in searched], "-", color="black", zorder=2)
        for i, r in enumerate(searched):
            point(r, r["limit_bytes"] / MiB, "o", "black",
                  "osdp-fx searched (at its limit)" if i == 0 else "_", size=7)
        ax.scatter([r["peak_bytes"] / MiB for r in searched],
                   [r["samples_per_s"] for r in searched], marker="x", color="black", s=50,
                   label="osdp-fx searched (at its measured peak)", zorder=2)
    first = True
    for r in rows:
        if r.get("limit_bytes") is not None:
            ax.axvline(r["limit_bytes"] / MiB, color="grey", lw=0.7, ls=":", zorder=1,
                       label="memory limits of the search" if first else "_")
            first = False
    ax.set_ylim(bottom=0)
    ax.set_xlabel("memory per rank, MiB (memory limit for the searched plan, measured peak "
                  "otherwise)")
    ax.set_ylabel("throughput, samples/s (all ranks; bars: quartiles of the steps)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    defaults = Config()
    for field in dataclasses.fields(Config):
        parser.add_argument(f"--{field.name}", type=int, default=getattr(defaults, field.name))
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--sequential", action="store_true",
                        help="time each system right after building it and free it before the "
                             "next (less memory; default: all alive, timed round-robin)")
    args = parser.parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
    world = args.world_size
    wall = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = start_world(world, measure, cfg, args.sequential)[0]
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    rows, limits = result["rows"], result["limits"]

    title = (f"world {world} ({result['backend']}, {result['device']}): GPT vocab {cfg.vocab}, "
             f"dim {cfg.dim}, depth {cfg.depth}, seq {cfg.seq}, batch {cfg.batch}/rank, AdamW")
    text = table(rows)
    ratios = key_ratios(rows, limits, world)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png = args.out_dir / f"compare-world{world}.png"
    skipped = "plot skipped (--no-plot)" if args.no_plot else plot(rows, png, title)
    wall = time.perf_counter() - wall
    ratios["wall_s"] = round(wall, 1)
    ratios["load_avg_before_after"] = [None if v is None else round(v, 2)
                                       for v in (load_before, load_after)]
    timing = ", ".join(f"{k} {v:.1f} s" for k, v in result["timings_s"].items())
    how = ("each system timed alone, right after it was built" if args.sequential else
           "all systems alive, one step of each per round, order rotated every round")
    notes = [
        (f"Step time: median of {cfg.steps} steps after {cfg.warmup} warm-up steps (each step's "
         f"time is the slowest rank's; {how}); fwd / bwd / opt: medians of each phase, opt "
         "includes zero_grad. Samples/s: world x batch / median step time."),
        (f"Machine: {os.cpu_count()} cores, 1-min load average {_load(load_before)} before and "
         f"{_load(load_after)} after the run (other processes compete for the cores)."),
        ("Peak: parameters + optimizer state before a steady-state step + the live-tensor "
         "tracker's peak during forward/backward/AdamW step (DDP: + its gradient buckets; "
         "FSDP2: DTensor local storages and its unsharded-parameter resizes)."),
        ("comm MiB/step: full buffer of each collective, summed. osdp-fx: from the plan. FSDP2: "
         "counted by wrapping torch.distributed collectives. DDP: sum of gradient bytes (its "
         "C++ reducer's all-reduces are invisible from Python). counted: the wrapped count "
         "(for osdp-fx full_shard the plan's figure is an upper bound: it re-gathers every "
         "parameter for backward, the runtime only those backward needs, e.g. not biases)."),
        f"Per-system wall time (rank 0, incl. compile/profile): {timing}.",
    ]
    report = "\n".join([f"# osdp-fx vs DDP vs FSDP2: {title}", "", text, "",
                        *(f"- {n}" for n in notes), "", "```json", json.dumps(ratios), "```", ""])
    (args.out_dir / f"compare-world{world}.md").write_text(report)
    raw = {"config": dataclasses.asdict(cfg), "world_size": world, "backend": result["backend"],
           "device": result["device"], "limits_bytes": limits, "rows": rows, "ratios": ratios,
           "timings_s": result["timings_s"]}
    (args.out_dir / f"compare-world{world}.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(title)
    print()
    print(text)
    print()
    for n in notes:
        print(f"- {n}")
    print(f"- table: {args.out_dir / f'compare-world{world}.md'}; raw rows: "
          f"{args.out_dir / f'compare-world{world}.json'}")
    print(f"- {skipped}" if skipped else f"- plot: {png}")
    print(json.dumps(ratios), flush=True)
    return {"rows": rows, "ratios": ratios, "limits": limits}


if __name__ == "__main__":
    main()

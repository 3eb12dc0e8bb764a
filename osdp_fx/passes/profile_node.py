"""Profiling one compute node alone: its inputs copied, its forward and a local backward run
under FLOP counters, saved-tensor hooks and a live-tensor tracker, and both timed.

The profile pass (``passes/profile.py``) walks the graph and calls :func:`profile_compute_node`
for every node that computes; its docstring says what is measured and why.
"""

from __future__ import annotations

import dataclasses
import operator
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..core.node_meta import NodeProfile
from ..runtime.memory import LiveTensorTracker


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(value))


def differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


@dataclasses.dataclass
class PreparedInputs:
    """Fresh copies of one node's inputs, ready for a local forward and backward."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: list[torch.Tensor]
    """Leaf tensors requiring grad that the backward differentiates with respect to."""
    leaf_names: list[str | None]
    """The node each leaf came from (None: not an input node's tensor)."""
    storages: dict[int, str]
    """Storage key of each prepared input -> name of the node it came from."""


def prepare_inputs(profiler: Any, n: fx.Node, args: Any, kwargs: Any) -> PreparedInputs:
    """Copies of the node's inputs: parameters as detached leaves (their storage kept),
    activations as ``detach().requires_grad_().clone()`` so in-place ops stay legal."""
    names: dict[int, str] = {}
    for inp in n.all_input_nodes:
        for t in tensors(profiler.env.get(inp)):
            names.setdefault(id(t), inp.name)
    leaves: list[torch.Tensor] = []
    leaf_names: list[str | None] = []
    storages: dict[int, str] = {}
    memo: dict[int, torch.Tensor] = {}

    def prepare(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) in memo:
            return memo[id(t)]
        needs_grad = t.requires_grad and differentiable(t)
        if storage_key(t) in profiler.param_storages or t.is_contiguous():
            leaf = t.detach().requires_grad_(needs_grad)
            fresh = leaf if storage_key(t) in profiler.param_storages else leaf.clone()
        else:  # keep the exact strides: ops such as reshape copy only non-contiguous inputs
            # (an expanded one too: repeat_kv's reshape of an expanded key is a copy that
            # attention saves), so the whole storage is copied and viewed alike
            with torch.no_grad():
                whole = t.detach().as_strided((t.untyped_storage().nbytes() // t.element_size(),),
                                              (1,), 0)
                leaf = whole.clone().as_strided(t.size(), t.stride(), t.storage_offset())
            fresh = leaf.requires_grad_(needs_grad)
        if needs_grad:
            leaves.append(leaf)
            leaf_names.append(names.get(id(t)))
        if id(t) in names:
            storages[storage_key(fresh)] = names[id(t)]
        memo[id(t)] = fresh
        return fresh

    new_args, new_kwargs = pytree.tree_map(prepare, (tuple(args), dict(kwargs)))
    return PreparedInputs(new_args, new_kwargs, leaves, leaf_names, storages)


def outputs_to_differentiate(n: fx.Node, result: Any) -> list[torch.Tensor]:
    """Outputs the backward starts from: those requiring grad that a user reads."""
    if isinstance(result, (tuple, list)) and n.users and all(
        u.op == "call_function" and u.target is operator.getitem for u in n.users
    ):
        used = {u.args[1] for u in n.users}
        result = [r for i, r in enumerate(result) if i in used]
    return [t for t in tensors(result) if t.requires_grad]


def detached(result: Any) -> Any:
    """The node's value for its users: cut from the local autograd graph, same flags."""

    def detach(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().requires_grad_(t.requires_grad and differentiable(t))

    return pytree.tree_map(detach, result)


GPU_SLEEP_CYCLES = 400_000
"""GPU clock cycles of the busy kernel queued before a timed node on a GPU: more than the CPU
takes to dispatch one node, so that the GPU's clock times the node's kernels alone ([Note:
timing a node on a GPU])."""


def median_time_s(setup: Callable[[], Any], run: Callable[[Any], Any], *, warmup: int,
                  repeats: int, gpu: bool = False) -> float:
    """Median seconds of ``run(setup())`` over ``repeats`` runs after ``warmup`` (device work
    waited for; ``gpu``, where the node's tensors are on a CUDA device: its kernels' time,
    [Note: timing a node on a GPU])."""
    if gpu:
        return _median_gpu_time_s(setup, run, warmup=warmup, repeats=repeats)
    times: list[float] = []
    for i in range(warmup + repeats):
        state = setup()
        synchronize()
        start = time.perf_counter()
        out = run(state)
        synchronize()
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
        del out, state
    return statistics.median(times)


def _median_gpu_time_s(setup: Callable[[], Any], run: Callable[[Any], Any], *, warmup: int,
                       repeats: int) -> float:
    """[Note: timing a node on a GPU]

    A step on a GPU runs as a pipeline: the CPU dispatches each operator and goes on while the
    GPU runs the kernels queued before it. Timing a node by the wall clock between two
    synchronizes counts its dispatch, the synchronize's latency and the GPU going idle between
    them; and the profiler dispatches a node through an interpreter, around which it records
    what the node saves, at many times the cost of the compiled graph's direct call. Counted
    either way, a whole model's nodes added up to several times its measured forward and
    backward (``docs/benchmarks.md``, "On a GPU"). Here a busy kernel
    (``torch.cuda._sleep``) holds the GPU while the node is dispatched, and CUDA events around
    the node time its kernels alone: the node's time is its kernels' time. A step's dispatch is
    not counted, so a model whose kernels are shorter than their launches is predicted faster
    than it runs."""
    times: list[float] = []
    for i in range(warmup + repeats):
        state = setup()
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        start.record()
        out = run(state)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
        del out, state
    return statistics.median(times)


def profile_compute_node(profiler: Any, n: fx.Node) -> tuple[Any, NodeProfile]:
    """Run one compute node alone on copies of its inputs and measure it (``profile.py``'s
    docstring); ``profiler`` is the running ``NodeProfiler``. Returns the node's value for its
    users and its profile."""

    def timed(setup: Callable[[], Any], run: Callable[[Any], Any]) -> float:
        return median_time_s(setup, run, warmup=profiler.warmup, repeats=profiler.repeats,
                             gpu=on_gpu)

    args, kwargs = profiler.fetch_args_kwargs_from_env(n)
    inputs = prepare_inputs(profiler, n, args, kwargs)
    on_gpu = any(t.is_cuda for t in tensors((inputs.args, inputs.kwargs)))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(storage_key(t), t.untyped_storage().nbytes())
        # Detached: an op that saves its own output would otherwise hold it through its
        # grad_fn, a C++ reference cycle that retain_graph keeps alive for good.
        return t.detach()

    fwd_tracker = profiler.tracker()
    with profiler.flop_counter() as fwd_counter, fwd_tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = profiler.call(n, inputs)
    outputs = tensors(result)
    if not outputs:  # shape arithmetic, asserts: nothing worth timing
        profile = NodeProfile.zero(timed=profiler.fake_mode is None)
        return result, dataclasses.replace(profile, fwd_flops=fwd_counter.get_total_flops())
    input_storages = set(inputs.storages) | profiler.param_storages
    input_storages |= {storage_key(t) for t in tensors((inputs.args, inputs.kwargs))}

    grad_outputs = outputs_to_differentiate(n, result)
    seeds = [torch.ones_like(t) for t in grad_outputs]
    bwd_flops, grad_input_bytes, bwd_transient_bytes = 0, 0, 0
    passthrough: set[str] = set()
    has_backward = bool(grad_outputs and inputs.leaves)
    if has_backward:
        bwd_tracker = profiler.tracker()
        with profiler.flop_counter() as bwd_counter, bwd_tracker:
            grads = torch.autograd.grad(
                grad_outputs, inputs.leaves, seeds, allow_unused=True, retain_graph=True
            )
        bwd_transient_bytes = transient_bytes(bwd_tracker)
        bwd_flops = bwd_counter.get_total_flops()
        grad_input_bytes = tensor_bytes([g for g in grads if g is not None])
        seeded = {storage_key(t) for t in seeds}
        passthrough = {name for name, g in zip(inputs.leaf_names, grads)
                       if name is not None and g is not None and storage_key(g) in seeded}

    fwd_time_s: float | None = None
    bwd_time_s: float | None = None
    if profiler.fake_mode is None:
        fwd_time_s = timed(lambda: prepare_inputs(profiler, n, args, kwargs),
                           lambda prepared: profiler.call(n, prepared))
        bwd_time_s = 0.0
        if has_backward:
            bwd_time_s = timed(
                lambda: None,
                lambda _: torch.autograd.grad(
                    grad_outputs, inputs.leaves, seeds, allow_unused=True, retain_graph=True
                ),
            )

    saved_storages = {k: v for k, v in saved.items() if k not in profiler.param_storages}
    output_storages = {storage_key(t) for t in outputs}
    profile = NodeProfile(
        fwd_flops=fwd_counter.get_total_flops(),
        bwd_flops=bwd_flops,
        input_bytes=tensor_bytes((inputs.args, inputs.kwargs)),
        output_bytes=tensor_bytes(result),
        output_is_view=bool(outputs)
        and all(storage_key(t) in input_storages for t in outputs),
        saved_bytes=sum(saved_storages.values()),
        saved_inputs=tuple(sorted({inputs.storages[k] for k in saved_storages
                                   if k in inputs.storages})),
        grad_input_bytes=grad_input_bytes,
        param_bytes=0,
        fwd_time_s=fwd_time_s,
        bwd_time_s=bwd_time_s,
        saved_params=tuple(sorted({inputs.storages[k] for k in saved
                                   if k in profiler.param_storages and k in inputs.storages})),
        saved_output_bytes=sum(v for k, v in saved_storages.items()
                               if k in output_storages and k not in input_storages),
        saved_input_bytes=sum(v for k, v in saved_storages.items() if k in inputs.storages),
        fwd_transient_bytes=transient_bytes(fwd_tracker),
        bwd_transient_bytes=bwd_transient_bytes,
        grad_passthrough=tuple(sorted(passthrough)),
        compute_dtype=next((str(t.dtype).removeprefix("torch.") for t in tensors(
            (inputs.args, inputs.kwargs, outputs)) if t.dtype.is_floating_point), ""),
    )
    return detached(result), profile


def transient_bytes(tracker: Any) -> int:
    """Peak minus what stayed alive, for a LiveTensorTracker (0 for a null context)."""
    if not isinstance(tracker, LiveTensorTracker):
        return 0
    return max(0, tracker.peak_bytes - tracker.live_bytes)


def synchronize() -> None:
    """Wait for queued device work (CUDA runs asynchronously; CPU needs nothing)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# [Note: same work, one profile]
#
# Under fake tensors a node's profile (FLOPs, bytes, what it saves) is a function of its
# operator and of its inputs' metadata alone, and a transformer repeats the same block: the
# 48 decoder layers of GPT-2 XL are 48 copies of each of their nodes. The profiler profiles
# the first of a kind and gives the others its profile, renamed to their own inputs
# (``saved_inputs``, ``saved_params``, ``grad_passthrough`` name input nodes). The key holds
# everything ``profile_compute_node`` reads: the operator, the structure of the arguments, each
# tensor's shape, strides, offset, storage size, dtype, device, requires_grad, whether it is a
# parameter's storage, which arguments share a storage or are the same tensor, which input
# node each comes from, and which outputs a user reads. Measured profiles (real tensors) are
# not shared: each node is timed.

PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, type(...))


def same_work_key(profiler: Any, n: fx.Node, args: Any, kwargs: Any) -> tuple[Any, ...] | None:
    """What the profile of compute node ``n`` on ``args``/``kwargs`` depends on ([Note: same
    work, one profile]); None when an argument is of a kind the key cannot hold."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    source: dict[int, int] = {}
    for i, inp in enumerate(n.all_input_nodes):
        for t in tensors(profiler.env.get(inp)):
            source.setdefault(id(t), i)
    storages: dict[int, int] = {}
    same: dict[int, int] = {}
    parts: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key = storage_key(x)
            parts.append((tuple(x.shape), x.stride(), x.storage_offset(),
                          x.untyped_storage().nbytes(), x.dtype, x.device.type, x.requires_grad,
                          key in profiler.param_storages, storages.setdefault(key, len(storages)),
                          same.setdefault(id(x), len(same)), source.get(id(x))))
        elif isinstance(x, slice):
            parts.append(("slice", x.start, x.stop, x.step))
        elif isinstance(x, PLAIN):
            parts.append((type(x), x))
        else:
            return None
    key = (n.op, n.target, str(spec), tuple(parts), outputs_read(n))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def outputs_read(n: fx.Node) -> tuple[str, ...] | None:
    """Which items of ``n``'s tuple its users read, when they all read an item (the outputs
    the profile differentiates); None otherwise."""
    users = list(n.users)
    return (tuple(sorted({repr(u.args[1]) for u in users})) if users and all(
        u.op == "call_function" and u.target is operator.getitem for u in users) else None)


def renamed(profile: NodeProfile, first: fx.Node, n: fx.Node) -> NodeProfile:
    """The profile of node ``first`` for node ``n``, which does the same work on its own inputs
    (positionally alike)."""
    names = dict(zip((a.name for a in first.all_input_nodes),
                     (a.name for a in n.all_input_nodes)))

    def rename(found: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(sorted(names[x] for x in found))

    return dataclasses.replace(profile, saved_inputs=rename(profile.saved_inputs),
                               saved_params=rename(profile.saved_params),
                               grad_passthrough=rename(profile.grad_passthrough))


def run_compute_node(profiler: Any, n: fx.Node) -> Any:
    """Node ``n``'s value for its users, as :func:`profile_compute_node` computes it, without
    measuring anything: on its inputs themselves unless the operator writes into them (then
    on copies, as profiling does)."""
    args, kwargs = profiler.fetch_args_kwargs_from_env(n)
    if writes_inputs(n):
        prepared = prepare_inputs(profiler, n, args, kwargs)
        args, kwargs = prepared.args, prepared.kwargs
    with torch.enable_grad():
        result = getattr(profiler, n.op)(n.target, args, kwargs)
    return detached(result) if tensors(result) else result


def writes_inputs(n: fx.Node) -> bool:
    """Whether node ``n``'s operator may write into an argument (an in-place or out= operator,
    or one whose kind is not known)."""
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._schema.is_mutable
    if n.op == "call_method":
        return n.target.endswith("_")
    return n.target is not operator.getitem and getattr(n.target, "__name__", "_").endswith("_")

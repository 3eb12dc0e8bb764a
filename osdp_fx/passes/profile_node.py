"""Helpers for profiling one compute node alone: its inputs copied, its forward and a local
backward run under FLOP counters, saved-tensor hooks and a live-tensor tracker, and both timed.

The profile pass (``passes/profile.py``) walks the graph with a ``NodeProfiler``, whose
``profile_compute_node`` measures every node that computes with these; that module's docstring
says what is measured and why.
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


@dataclasses.dataclass(frozen=True)
class Timing:
    """A node's measured time: its device's, and on a GPU its host's apart."""

    time_s: float
    """Median seconds of the node's work (on a GPU, its kernels')."""
    host_s: float | None = None
    """Median seconds the host spends dispatching it, where that runs apart from the device
    (a GPU); None where the host computes (the CPU): there the two are one."""


def median_time_s(setup: Callable[[], Any], run: Callable[[Any], Any], *, warmup: int,
                  repeats: int, gpu: bool = False) -> Timing:
    """Median seconds of ``run(setup())`` over ``repeats`` runs after ``warmup`` (device work
    waited for; ``gpu``, where the node's tensors are on a CUDA device: its kernels' time and,
    apart, its dispatch's, [Note: timing a node on a GPU])."""
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
    return Timing(statistics.median(times))


def _median_gpu_time_s(setup: Callable[[], Any], run: Callable[[Any], Any], *, warmup: int,
                       repeats: int) -> Timing:
    """[Note: timing a node on a GPU]

    A step on a GPU runs as a pipeline: the CPU dispatches each operator and goes on while the
    GPU runs the kernels queued before it. Timing a node by the wall clock between two
    synchronizes counts its dispatch, the synchronize's latency and the GPU going idle between
    them; and the profiler dispatches a node through an interpreter, around which it records
    what the node saves, at many times the cost of the compiled graph's direct call. Counted
    either way, a whole model's nodes added up to several times its measured forward and
    backward (``docs/benchmarks.md``, "On a GPU"). Here a busy kernel
    (``torch.cuda._sleep``) holds the GPU while the node is dispatched, and CUDA events around
    the node time its kernels alone: the node's time is its kernels' time. The host's clock
    around the same call, while the GPU is held, times the node's dispatch alone: the host
    lane of the step model ([Note: the host lane] in ``cost_models/step.py``)."""
    times: list[float] = []
    host: list[float] = []
    for i in range(warmup + repeats):
        state = setup()
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        start.record()
        issued = time.perf_counter()
        out = run(state)
        dispatched = time.perf_counter() - issued
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1e3)
            host.append(dispatched)
        del out, state
    return Timing(statistics.median(times), statistics.median(host))


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
# (``saved_inputs``, ``saved_params``, ``grad_passthrough`` name input nodes). The key
# (``NodeProfiler.same_work_key`` in ``profile.py``) holds everything
# ``NodeProfiler.profile_compute_node`` reads: the operator, the structure of the arguments, each
# tensor's shape, strides, offset, storage size, dtype, device, requires_grad, whether it is a
# parameter's storage, which arguments share a storage or are the same tensor, which input
# node each comes from, and which outputs a user reads. Measured profiles (real tensors) are
# not shared: each node is timed.

PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, type(...))


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


def writes_inputs(n: fx.Node) -> bool:
    """Whether node ``n``'s operator may write into an argument (an in-place or out= operator,
    or one whose kind is not known)."""
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._schema.is_mutable
    if n.op == "call_method":
        return n.target.endswith("_")
    return n.target is not operator.getitem and getattr(n.target, "__name__", "_").endswith("_")

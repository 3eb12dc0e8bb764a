"""Profile pass: measure what every node of a graph costs, node by node.

Why it exists: the search needs, for every operator, its forward and backward FLOPs, the bytes
it allocates and keeps for backward, the bytes of the parameters it reads and how long it takes.
This pass runs the graph once with a :class:`torch.fx.Interpreter` subclass and, for each node,
runs that node alone on copies of its inputs:

- forward FLOPs under :class:`torch.utils.flop_counter.FlopCounterMode`;
- bytes saved for backward with :func:`torch.autograd.graph.saved_tensors_hooks` (distinct
  storages, parameters excluded: parameter memory is accounted by the memory cost model);
- backward FLOPs from a *local* ``torch.autograd.grad`` of the node's outputs with respect to its
  inputs that require grad (each input is ``detach().requires_grad_().clone()``'d, so the node
  never sees the rest of the graph and in-place operators stay legal);
- forward and backward time (median of ``repeats`` runs after ``warmup``), unless ``fake=True``.

Per-node FLOPs sum exactly to what ``FlopCounterMode`` counts for the whole model's forward and
backward (``tests/passes/test_profile.py`` checks it on an MLP, a small GPT and GPT-2).

It is an analysis pass: the graph is not changed. Each node gets ``osdp_meta(node).profile``::

    graph():                                    node      fwd_flops  bwd_flops  saved_bytes
        %x : [num_users=1] = placeholder[x]      x                 0          0            0
        %w : [num_users=1] = get_attr[w]         w                 0          0            0  (param_bytes=K*N*4)
        %linear = call_function[F.linear](x, w)  linear     2*M*N*K    4*M*N*K        M*K*4
        return linear

With ``fake=True`` the graph runs under :class:`~torch._subclasses.fake_tensor.FakeTensorMode`
(parameters and inputs may be real, fake or on the ``meta`` device; meta tensors are profiled as
tensors of ``meta_device``, the CPU by default): FLOPs and bytes are exact, times are None and
the compute cost model uses a roofline instead (at the throughput of the dtype each node computes
in, ``NodeProfile.compute_dtype``). Long profiles report progress node by node
(``osdp_fx.core.progress``, [Note: progress]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils import _pytree as pytree
from torch.utils import flop_counter

from ..core import progress
from ..core.node_meta import NodeProfile, osdp_meta, set_osdp_meta
from ..errors import InputError, PlanMismatchError
from ..runtime.memory import LiveTensorTracker
from .profile_node import (
    PreparedInputs,
    profile_compute_node,
    renamed,
    run_compute_node,
    same_work_key,
    storage_key,
    tensor_bytes,
)
from .profile_node import tensors as _tensor_list
from .repeated import Block, inputs_key, outputs_like, remake, repeated_blocks

log = logging.getLogger(__name__)

__all__ = [
    "NodeProfile",
    "ProfileSummary",
    "profile_graph_pass",
    "slowest_rank_times_pass",
    "summarize_profile",
]

_aten = torch.ops.aten

# Nodes whose cost is zero by construction: export's input guards.
_ZERO_COST_MODULES = frozenset({"_guards_fn"})


def _register_cpu_sdpa_flop_formulas() -> None:
    """Count CPU flash attention like the CUDA kernels (torch counts it as 0 FLOPs).

    Idempotent: a formula already in torch's registry (ours from an earlier import, or one a
    newer torch ships) is left alone, since ``register_flop_formula`` refuses duplicates.
    """
    forward = _aten._scaled_dot_product_flash_attention_for_cpu
    backward = _aten._scaled_dot_product_flash_attention_for_cpu_backward
    if forward not in flop_counter.flop_registry:

        @flop_counter.register_flop_formula(forward)
        def _cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
            return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    if backward not in flop_counter.flop_registry:

        @flop_counter.register_flop_formula(backward)
        def _cpu_sdpa_backward_flop(
            grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
        ):
            return flop_counter.sdpa_backward_flop_count(
                grad_out_shape, query_shape, key_shape, value_shape
            )


_register_cpu_sdpa_flop_formulas()


@dataclasses.dataclass(frozen=True)
class ProfileSummary:
    """Totals of the node profiles of one graph."""

    fwd_flops: int
    """Sum of the nodes' forward FLOPs."""
    bwd_flops: int
    """Sum of the nodes' backward FLOPs."""
    fwd_time_s: float | None
    """Sum of the nodes' measured forward times; None if any node was not timed (fake mode)."""
    bwd_time_s: float | None
    """Sum of the nodes' measured backward times; None if any node was not timed."""
    param_bytes: int
    """Bytes of the distinct parameters the graph reads (tied parameters counted once)."""
    saved_bytes: int
    """Sum of the nodes' saved bytes (an upper bound: an activation saved by two nodes counts twice)."""
    num_nodes: int
    """Number of profiled nodes."""

    @property
    def step_flops(self) -> int:
        """Forward plus backward FLOPs of one training step."""
        return self.fwd_flops + self.bwd_flops


def summarize_profile(gm: fx.GraphModule) -> ProfileSummary:
    """Totals of the profiles written by :func:`profile_graph_pass` on ``gm``'s nodes."""
    profiles: list[NodeProfile] = []
    params: dict[int, int] = {}
    for node in gm.graph.nodes:
        profile = osdp_meta(node).profile
        if profile is None:
            raise InputError(
                f"node {node.format_node()} has no profile: run profile_graph_pass(gm, "
                f"example_inputs) on this graph before summarizing it"
            )
        profiles.append(profile)
        if profile.param_bytes:
            params[id(gm.get_parameter(node.target))] = profile.param_bytes

    def total_time(field: str) -> float | None:
        times = [getattr(p, field) for p in profiles]
        return None if any(t is None for t in times) else float(sum(times))

    return ProfileSummary(
        fwd_flops=sum(p.fwd_flops for p in profiles),
        bwd_flops=sum(p.bwd_flops for p in profiles),
        fwd_time_s=total_time("fwd_time_s"),
        bwd_time_s=total_time("bwd_time_s"),
        param_bytes=sum(params.values()),
        saved_bytes=sum(p.saved_bytes for p in profiles),
        num_nodes=len(profiles),
    )


def profile_graph_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    warmup: int = 2,
    repeats: int = 5,
    fake: bool = False,
    meta_device: torch.device | str = "cpu",
    share_repeats: bool = True,
) -> PassResult:
    """Write a :class:`NodeProfile` into ``osdp_meta(node).profile`` for every node of ``gm``.

    ``example_inputs`` are the positional inputs of ``gm`` (flattened as for ``gm(*inputs)``).
    Inputs keep their ``requires_grad``; parameters require grad as they do in ``gm``. With
    ``fake=True`` nothing is computed for real: FLOPs and bytes are exact, times are None;
    meta tensors become fake tensors of ``meta_device`` (where a meta model will be
    materialised: a graph captured by export names it in its tensor factories), and a block that
    repeats an earlier one takes its profiles without running (``share_repeats``, [Note:
    repeated blocks]). Returns ``PassResult(gm, False)``: the graph is not changed.
    """
    if warmup < 0 or repeats < 1:
        raise InputError(
            f"profile_graph_pass needs warmup >= 0 and repeats >= 1, got warmup={warmup}, "
            f"repeats={repeats}"
        )
    tensors = _tensor_list(list(example_inputs)) + list(gm.parameters())
    if not fake and any(_is_fake_or_meta(t) for t in tensors):
        raise InputError(
            "profile_graph_pass got fake or meta tensors among the example inputs or parameters; "
            "pass fake=True to profile without running, or give real tensors to measure times"
        )
    profiler = NodeProfiler(gm, warmup=warmup, repeats=repeats, fake=fake,
                             meta_device=torch.device(meta_device), share_repeats=share_repeats)
    profiler.profile(list(example_inputs))
    summary = summarize_profile(gm)
    log.info(
        "profiled %d nodes (%d of them as a repeated block's): %.3g forward FLOPs, %.3g "
        "backward FLOPs, %s forward / %s backward", summary.num_nodes, profiler.shared,
        summary.fwd_flops, summary.bwd_flops,
        _format_time(summary.fwd_time_s), _format_time(summary.bwd_time_s),
    )
    return PassResult(gm, False)


def slowest_rank_times_pass(gm: fx.GraphModule) -> PassResult:
    """Make every rank's measured node times the same: per node the mean over the ranks of the
    default process group, scaled so that their sum is the slowest rank's total (nothing to do
    on one rank, or for nodes profiled without timing).

    A data-parallel step runs in lock-step, so it goes at the pace of its slowest rank; taking
    each node's maximum instead would add up every rank's measurement noise. Identical profiles
    also make every rank's predictions identical. Collective: every rank calls it on the same
    graph.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return PassResult(gm, False)
    timed = [n for n in gm.graph.nodes
             if (p := osdp_meta(n).profile) is not None and p.fwd_time_s is not None]
    count = torch.tensor([len(timed), -len(timed)], dtype=torch.float64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if count.tolist() != [len(timed), -len(timed)]:
        raise PlanMismatchError(
            f"this rank profiled {len(timed)} timed nodes, others {int(count[0])} or "
            f"{int(-count[1])}: every rank must compile the same model with inputs of the same "
            "shapes"
        )
    times = torch.tensor([[osdp_meta(n).profile.fwd_time_s, osdp_meta(n).profile.bwd_time_s]
                          for n in timed], dtype=torch.float64).reshape(-1, 2)
    slowest = times.sum().reshape(1)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(times)
    total = times.sum()
    if total > 0:
        times *= slowest / total
    for n, (fwd_s, bwd_s) in zip(timed, times.tolist()):
        osdp_meta(n).profile = dataclasses.replace(osdp_meta(n).profile, fwd_time_s=fwd_s,
                                                   bwd_time_s=bwd_s)
    return PassResult(gm, False)


def _format_time(time_s: float | None) -> str:
    return "untimed" if time_s is None else f"{time_s * 1e3:.3f} ms"


def _is_fake_or_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or is_fake(t)


def fake_of(value: torch.Tensor, fake_mode: FakeTensorMode,
            meta_device: torch.device) -> torch.Tensor:
    """A fake tensor of ``fake_mode`` like ``value``; a meta tensor becomes one of
    ``meta_device``, with the same shape, strides, dtype and ``requires_grad``."""
    if value.device.type != "meta":
        return fake_mode.from_tensor(value)
    with fake_mode:
        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=meta_device)
    return fake.requires_grad_(value.requires_grad)


class NodeProfiler(fx.Interpreter):
    """Runs the graph and profiles each node in isolation (see the module docstring).

    The profile pass runs it; ``passes/sequence.py`` extends it (under fake tensors, measuring
    elements at other sequence lengths without writing the graph's profile)."""

    def __init__(self, gm: fx.GraphModule, *, warmup: int, repeats: int, fake: bool,
                 meta_device: torch.device, share_repeats: bool = True) -> None:
        super().__init__(gm)
        self.meta_device = meta_device
        self.warmup = warmup
        self.repeats = repeats
        self.fake_mode: FakeTensorMode | None = None
        if fake:
            self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._fake_attrs: dict[int, Any] = {}
        self._param_names = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        self.param_storages: set[int] = set()
        self._task: progress.Task | None = None
        self._profiled: dict[tuple[Any, ...], tuple[fx.Node, NodeProfile]] = {}
        """Under fake tensors: the first node of each kind of work and its profile ([Note:
        same work, one profile] in ``profile_node.py``)."""
        self._blocks = repeated_blocks(gm) if fake and share_repeats else {}
        """Under fake tensors: the blocks of a kind that repeats, by their first node ([Note:
        repeated blocks] in ``repeated.py``)."""
        self._ends = {b.nodes[-1]: b for b in self._blocks.values()}
        self._open: dict[str, tuple[Hashable, list[Any]]] = {}
        """A block being run: its kind and inputs' key, and its inputs."""
        self._run: dict[Hashable, tuple[Block, list[Any] | None]] = {}
        """By kind and inputs' key, the first block run and its outputs' metadata
        (``outputs_like``)."""
        self._twin: dict[fx.Node, fx.Node] = {}
        """The nodes of the block being given an earlier block's profiles, and their twins."""
        self._like: dict[fx.Node, Any] = {}
        """The outputs of that block, and the metadata of their fresh values."""
        self.shared = 0
        """How many nodes took a repeated block's profile without running."""

    # -- running ---------------------------------------------------------------------------

    def _mode(self) -> contextlib.AbstractContextManager[Any]:
        return self.fake_mode if self.fake_mode is not None else contextlib.nullcontext()

    def _to_fake(self, value: Any) -> Any:
        assert self.fake_mode is not None
        if not isinstance(value, torch.Tensor):
            return value
        if is_fake(value):
            return value
        key = id(value)
        if key not in self._fake_attrs:
            fake = fake_of(value, self.fake_mode, self.meta_device)
            self._fake_attrs[key] = (value, fake)  # keep value alive so its id stays unique
        return self._fake_attrs[key][1]

    def profile(self, example_inputs: list[Any], label: str = "profile") -> None:
        """Run the graph on ``example_inputs`` node by node, reporting progress as ``label``."""
        if self.fake_mode is not None:
            example_inputs = pytree.tree_map(self._to_fake, example_inputs)
            params = [self._to_fake(p) for p in self.module.parameters()]
        else:
            params = list(self.module.parameters())
        self.param_storages = {storage_key(p) for p in params}
        num_placeholders = sum(1 for n in self.graph.nodes if n.op == "placeholder")
        flat_inputs = self.graph.process_inputs(*example_inputs)
        if len(flat_inputs) != num_placeholders:
            raise InputError(
                f"profile_graph_pass got {len(flat_inputs)} example inputs for a graph with "
                f"{num_placeholders} placeholders; pass the positional inputs of the model's forward"
            )
        with progress.task(label, total=len(self.graph.nodes), unit="nodes") as task:
            self._task = task
            self.run(*flat_inputs, enable_io_processing=False)

    def get_attr(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = super().get_attr(target, args, kwargs)
        return self._to_fake(value) if self.fake_mode is not None else value

    def run_node(self, n: fx.Node) -> Any:
        with self._mode():
            self._enter_block(n)
            twin = self._twin.pop(n, None)
            result = self._run_node(n) if twin is None else self._repeat_node(n, twin)
            self._leave_block(n, result)
        if self._task is not None:
            self._task.advance()
        return result

    def _run_node(self, n: fx.Node) -> Any:
        """Run and profile one node (inside the fake mode, if any)."""
        try:
            result, profile = self._run_and_profile(n)
        except InputError:
            raise
        except Exception as e:
            raise InputError(
                f"profiling node {n.format_node()} failed with {type(e).__name__}: {e}. Check that "
                f"example_inputs are what the model's forward takes and that the graph runs "
                f"as gm(*example_inputs)"
            ) from e
        set_osdp_meta(n, profile=profile)
        return result

    # -- repeated blocks ([Note: repeated blocks]) --------------------------------------------

    def _enter_block(self, n: fx.Node) -> None:
        """At a block's start: when a block of its kind ran on inputs like its own, mark its
        nodes to take that block's profiles; else note its inputs, to be run."""
        block = self._blocks.get(n)
        if block is None:
            return
        values = [self.env[a] for a in block.inputs]
        key = inputs_key(values, self.param_storages)
        if key is None:
            return
        done = self._run.get((block.kind, key))
        if done is None:
            self._open[block.name] = ((block.kind, key), values)
        elif done[1] is not None:
            self._twin.update((m, t) for m, t in zip(block.nodes, done[0].nodes)
                              if m.op != "get_attr")
            self._like.update(zip(block.outputs, done[1]))

    def _leave_block(self, n: fx.Node, result: Any) -> None:
        """At the last node of a block that ran, note its outputs' metadata."""
        block = self._ends.get(n)
        if block is None or block.name not in self._open:
            return
        key, inputs = self._open.pop(block.name)
        values = [result if o is n else self.env[o] for o in block.outputs]
        taken = {storage_key(t) for t in _tensor_list(inputs)} | self.param_storages
        self._run.setdefault(key, (block, outputs_like(values, taken)))

    def _repeat_node(self, n: fx.Node, twin: fx.Node) -> Any:
        """Node ``n`` of a repeat: its twin's profile, and a fresh value if a later node reads it."""
        self._take_profile(n, twin)
        self.shared += 1
        like = self._like.pop(n, None)
        return None if like is None else remake(like)

    def _take_profile(self, n: fx.Node, twin: fx.Node) -> None:
        set_osdp_meta(n, profile=renamed(osdp_meta(twin).profile, twin, n))

    def _run_and_profile(self, n: fx.Node) -> tuple[Any, NodeProfile]:
        timed = self.fake_mode is None
        if n.op == "placeholder":
            result = super().run_node(n)
            return result, NodeProfile.zero(output_bytes=tensor_bytes(result), timed=timed)
        if n.op == "get_attr":
            result = super().run_node(n)
            is_param = n.target in self._param_names
            return result, NodeProfile.zero(
                output_bytes=tensor_bytes(result),
                param_bytes=tensor_bytes(result) if is_param else 0,
                output_is_view=True,
                timed=timed,
            )
        if n.op == "output" or (n.op == "call_module" and n.target in _ZERO_COST_MODULES):
            return super().run_node(n), NodeProfile.zero(timed=timed)
        if n.op == "call_module" and any(True for _ in self.fetch_attr(n.target).parameters()):
            raise InputError(
                f"node {n.format_node()} calls module {n.target!r} which owns parameters; the "
                f"profile pass expects every parameter to be read by a get_attr node: capture the "
                f"model with osdp_fx.passes.capture (which normalizes modules into functional calls) first"
            )
        return self._profile_compute(n)

    def _profile_compute(self, n: fx.Node) -> tuple[Any, NodeProfile]:
        if self.fake_mode is None:
            return profile_compute_node(self, n)
        key = same_work_key(self, n, *self.fetch_args_kwargs_from_env(n))
        if key is not None and key in self._profiled:
            first, profile = self._profiled[key]
            return run_compute_node(self, n), renamed(profile, first, n)
        result, profile = profile_compute_node(self, n)
        if key is not None:
            self._profiled[key] = (n, profile)
        return result, profile

    # -- one compute node --------------------------------------------------------------------

    def tracker(self) -> Any:
        """A live-tensor tracker for real runs (nothing to count under fake mode)."""
        return LiveTensorTracker() if self.fake_mode is None else contextlib.nullcontext()

    def flop_counter(self) -> Any:
        """What counts a node's FLOPs (``get_total_flops()``)."""
        return flop_counter.FlopCounterMode(display=False)

    def call(self, n: fx.Node, inputs: PreparedInputs) -> Any:
        with torch.enable_grad():
            return getattr(self, n.op)(n.target, inputs.args, inputs.kwargs)


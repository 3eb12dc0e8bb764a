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
the compute cost model uses a roofline instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils import _pytree as pytree
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from ..errors import InputError, PlanMismatchError
from ..meta import osdp_meta, set_osdp_meta
from ..runtime.memory import LiveTensorTracker

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
class NodeProfile:
    """Measured costs of one node, for one training step at the profiled batch size."""

    fwd_flops: int
    """FLOPs of the node's forward (FlopCounterMode: matmuls, convolutions, attention)."""
    bwd_flops: int
    """FLOPs of the node's backward: gradients of its inputs that require grad."""
    input_bytes: int
    """Bytes of the tensors the node reads (arguments, parameters included)."""
    output_bytes: int
    """Bytes of the tensors the node returns (numel x element size, summed over outputs)."""
    output_is_view: bool
    """True when every tensor output shares storage with an input or parameter (no new memory)."""
    saved_bytes: int
    """Bytes of the distinct storages autograd keeps for backward, parameters' storages excluded."""
    saved_inputs: tuple[str, ...]
    """Names of the argument nodes whose tensors are among those saved (shared activations)."""
    grad_input_bytes: int
    """Bytes of the gradients the backward produces (0 when no input requires grad)."""
    param_bytes: int
    """For a parameter's get_attr node: numel x element size of the parameter; else 0."""
    fwd_time_s: float | None
    """Median measured forward time (autograd recording on); None when profiled with fake=True."""
    bwd_time_s: float | None
    """Median measured backward time; None when profiled with fake=True."""
    saved_params: tuple[str, ...] = ()
    """Names of the parameter (get_attr) argument nodes whose tensors autograd saves."""
    saved_output_bytes: int = 0
    """Bytes of the node's own outputs among the saved storages (counted in saved_bytes too)."""
    saved_input_bytes: int = 0
    """Bytes of the saved storages that are the node's (non-parameter) inputs."""
    fwd_transient_bytes: int = 0
    """Peak bytes the forward allocates beyond what it leaves alive (workspaces); 0 if fake."""
    bwd_transient_bytes: int = 0
    """Peak bytes the backward allocates beyond the gradients it returns; 0 if fake."""

    @classmethod
    def zero(cls, *, output_bytes: int = 0, param_bytes: int = 0, output_is_view: bool = False,
             timed: bool = True) -> NodeProfile:
        """A node that costs nothing to run (placeholder, output, guards, non-tensor ops)."""
        time_s = 0.0 if timed else None
        return cls(
            fwd_flops=0, bwd_flops=0, input_bytes=0, output_bytes=output_bytes,
            output_is_view=output_is_view, saved_bytes=0, saved_inputs=(), grad_input_bytes=0,
            param_bytes=param_bytes, fwd_time_s=time_s, bwd_time_s=time_s,
        )


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
) -> PassResult:
    """Write a :class:`NodeProfile` into ``osdp_meta(node).profile`` for every node of ``gm``.

    ``example_inputs`` are the positional inputs of ``gm`` (flattened as for ``gm(*inputs)``).
    Inputs keep their ``requires_grad``; parameters require grad as they do in ``gm``. With
    ``fake=True`` nothing is computed for real: FLOPs and bytes are exact, times are None;
    meta tensors become fake tensors of ``meta_device`` (where a meta model will be
    materialised: a graph captured by export names it in its tensor factories).
    Returns ``PassResult(gm, False)``: the graph is not changed.
    """
    if warmup < 0 or repeats < 1:
        raise InputError(
            f"profile_graph_pass needs warmup >= 0 and repeats >= 1, got warmup={warmup}, "
            f"repeats={repeats}"
        )
    tensors = _tensors(list(example_inputs)) + list(gm.parameters())
    if not fake and any(_is_fake_or_meta(t) for t in tensors):
        raise InputError(
            "profile_graph_pass got fake or meta tensors among the example inputs or parameters; "
            "pass fake=True to profile without running, or give real tensors to measure times"
        )
    profiler = _NodeProfiler(gm, warmup=warmup, repeats=repeats, fake=fake,
                             meta_device=torch.device(meta_device))
    profiler.profile(list(example_inputs))
    summary = summarize_profile(gm)
    log.info(
        "profiled %d nodes: %.3g forward FLOPs, %.3g backward FLOPs, %s forward / %s backward",
        summary.num_nodes, summary.fwd_flops, summary.bwd_flops,
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


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


@dataclasses.dataclass
class _PreparedInputs:
    """Fresh copies of one node's inputs, ready for a local forward and backward."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    leaves: list[torch.Tensor]
    """Leaf tensors requiring grad that the backward differentiates with respect to."""
    storages: dict[int, str]
    """Storage key of each prepared input -> name of the node it came from."""


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


class _NodeProfiler(fx.Interpreter):
    """Runs the graph and profiles each node in isolation (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, *, warmup: int, repeats: int, fake: bool,
                 meta_device: torch.device) -> None:
        super().__init__(gm)
        self.meta_device = meta_device
        self.warmup = warmup
        self.repeats = repeats
        self.fake_mode: FakeTensorMode | None = None
        if fake:
            self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self._fake_attrs: dict[int, Any] = {}
        self._param_names = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        self._param_storages: set[int] = set()

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

    def profile(self, example_inputs: list[Any]) -> None:
        if self.fake_mode is not None:
            example_inputs = pytree.tree_map(self._to_fake, example_inputs)
            params = [self._to_fake(p) for p in self.module.parameters()]
        else:
            params = list(self.module.parameters())
        self._param_storages = {_storage_key(p) for p in params}
        num_placeholders = sum(1 for n in self.graph.nodes if n.op == "placeholder")
        flat_inputs = self.graph.process_inputs(*example_inputs)
        if len(flat_inputs) != num_placeholders:
            raise InputError(
                f"profile_graph_pass got {len(flat_inputs)} example inputs for a graph with "
                f"{num_placeholders} placeholders; pass the positional inputs of the model's forward"
            )
        self.run(*flat_inputs, enable_io_processing=False)

    def get_attr(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = super().get_attr(target, args, kwargs)
        return self._to_fake(value) if self.fake_mode is not None else value

    def run_node(self, n: fx.Node) -> Any:
        try:
            with self._mode():
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

    def _run_and_profile(self, n: fx.Node) -> tuple[Any, NodeProfile]:
        timed = self.fake_mode is None
        if n.op == "placeholder":
            result = super().run_node(n)
            return result, NodeProfile.zero(output_bytes=_tensor_bytes(result), timed=timed)
        if n.op == "get_attr":
            result = super().run_node(n)
            is_param = n.target in self._param_names
            return result, NodeProfile.zero(
                output_bytes=_tensor_bytes(result),
                param_bytes=_tensor_bytes(result) if is_param else 0,
                output_is_view=True,
                timed=timed,
            )
        if n.op == "output" or (n.op == "call_module" and n.target in _ZERO_COST_MODULES):
            return super().run_node(n), NodeProfile.zero(timed=timed)
        if n.op == "call_module" and any(True for _ in self.fetch_attr(n.target).parameters()):
            raise InputError(
                f"node {n.format_node()} calls module {n.target!r} which owns parameters; the "
                f"profile pass expects every parameter to be read by a get_attr node: capture the "
                f"model with osdp_fx.capture (which normalizes modules into functional calls) first"
            )
        return self._profile_compute_node(n)

    # -- one compute node --------------------------------------------------------------------

    def _prepare(self, n: fx.Node, args: Any, kwargs: Any) -> _PreparedInputs:
        """Copies of the node's inputs: parameters as detached leaves (their storage kept),
        activations as ``detach().requires_grad_().clone()`` so in-place ops stay legal."""
        names: dict[int, str] = {}
        for inp in n.all_input_nodes:
            for t in _tensors(self.env.get(inp)):
                names.setdefault(id(t), inp.name)
        leaves: list[torch.Tensor] = []
        storages: dict[int, str] = {}
        memo: dict[int, torch.Tensor] = {}

        def prepare(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in memo:
                return memo[id(t)]
            needs_grad = t.requires_grad and _differentiable(t)
            overlaps = any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.size()))
            if _storage_key(t) in self._param_storages or t.is_contiguous() or overlaps:
                leaf = t.detach().requires_grad_(needs_grad)
                fresh = leaf if _storage_key(t) in self._param_storages else leaf.clone()
            else:  # keep the exact strides: ops such as reshape copy only non-contiguous inputs
                with torch.no_grad():
                    buffer = torch.empty(t.untyped_storage().nbytes() // t.element_size(),
                                         dtype=t.dtype, device=t.device)
                    leaf = buffer.as_strided(t.size(), t.stride(), t.storage_offset()).copy_(t)
                fresh = leaf.requires_grad_(needs_grad)
            if needs_grad:
                leaves.append(leaf)
            if id(t) in names:
                storages[_storage_key(fresh)] = names[id(t)]
            memo[id(t)] = fresh
            return fresh

        new_args, new_kwargs = pytree.tree_map(prepare, (tuple(args), dict(kwargs)))
        return _PreparedInputs(new_args, new_kwargs, leaves, storages)

    def _tracker(self) -> Any:
        """A live-tensor tracker for real runs (nothing to count under fake mode)."""
        return LiveTensorTracker() if self.fake_mode is None else contextlib.nullcontext()

    def _call(self, n: fx.Node, inputs: _PreparedInputs) -> Any:
        with torch.enable_grad():
            return getattr(self, n.op)(n.target, inputs.args, inputs.kwargs)

    def _grad_outputs(self, n: fx.Node, result: Any) -> list[torch.Tensor]:
        """Outputs the backward starts from: those requiring grad that a user reads."""
        if isinstance(result, (tuple, list)) and n.users and all(
            u.op == "call_function" and u.target is operator.getitem for u in n.users
        ):
            used = {u.args[1] for u in n.users}
            result = [r for i, r in enumerate(result) if i in used]
        return [t for t in _tensors(result) if t.requires_grad]

    def _profile_compute_node(self, n: fx.Node) -> tuple[Any, NodeProfile]:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs = self._prepare(n, args, kwargs)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.setdefault(_storage_key(t), t.untyped_storage().nbytes())
            # Detached: an op that saves its own output would otherwise hold it through its
            # grad_fn, a C++ reference cycle that retain_graph keeps alive for good.
            return t.detach()

        fwd_tracker = self._tracker()
        with FlopCounterMode(display=False) as fwd_counter, fwd_tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                result = self._call(n, inputs)
        outputs = _tensors(result)
        if not outputs:  # shape arithmetic, asserts: nothing worth timing
            profile = NodeProfile.zero(timed=self.fake_mode is None)
            return result, dataclasses.replace(profile, fwd_flops=fwd_counter.get_total_flops())
        input_storages = set(inputs.storages) | self._param_storages
        input_storages |= {_storage_key(t) for t in _tensors((inputs.args, inputs.kwargs))}

        grad_outputs = self._grad_outputs(n, result)
        seeds = [torch.ones_like(t) for t in grad_outputs]
        bwd_flops, grad_input_bytes, bwd_transient_bytes = 0, 0, 0
        has_backward = bool(grad_outputs and inputs.leaves)
        if has_backward:
            bwd_tracker = self._tracker()
            with FlopCounterMode(display=False) as bwd_counter, bwd_tracker:
                grads = torch.autograd.grad(
                    grad_outputs, inputs.leaves, seeds, allow_unused=True, retain_graph=True
                )
            bwd_transient_bytes = _transient_bytes(bwd_tracker)
            bwd_flops = bwd_counter.get_total_flops()
            grad_input_bytes = _tensor_bytes([g for g in grads if g is not None])

        fwd_time_s: float | None = None
        bwd_time_s: float | None = None
        if self.fake_mode is None:
            fwd_time_s = self._median_time_s(lambda: self._prepare(n, args, kwargs),
                                             lambda prepared: self._call(n, prepared))
            bwd_time_s = 0.0
            if has_backward:
                bwd_time_s = self._median_time_s(
                    lambda: None,
                    lambda _: torch.autograd.grad(
                        grad_outputs, inputs.leaves, seeds, allow_unused=True, retain_graph=True
                    ),
                )

        saved_storages = {k: v for k, v in saved.items() if k not in self._param_storages}
        output_storages = {_storage_key(t) for t in outputs}
        profile = NodeProfile(
            fwd_flops=fwd_counter.get_total_flops(),
            bwd_flops=bwd_flops,
            input_bytes=_tensor_bytes((inputs.args, inputs.kwargs)),
            output_bytes=_tensor_bytes(result),
            output_is_view=bool(outputs)
            and all(_storage_key(t) in input_storages for t in outputs),
            saved_bytes=sum(saved_storages.values()),
            saved_inputs=tuple(sorted({inputs.storages[k] for k in saved_storages
                                       if k in inputs.storages})),
            grad_input_bytes=grad_input_bytes,
            param_bytes=0,
            fwd_time_s=fwd_time_s,
            bwd_time_s=bwd_time_s,
            saved_params=tuple(sorted({inputs.storages[k] for k in saved
                                       if k in self._param_storages and k in inputs.storages})),
            saved_output_bytes=sum(v for k, v in saved_storages.items()
                                   if k in output_storages and k not in input_storages),
            saved_input_bytes=sum(v for k, v in saved_storages.items() if k in inputs.storages),
            fwd_transient_bytes=_transient_bytes(fwd_tracker),
            bwd_transient_bytes=bwd_transient_bytes,
        )
        return self._detached(result), profile

    @staticmethod
    def _detached(result: Any) -> Any:
        """The node's value for its users: cut from the local autograd graph, same flags."""

        def detach(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            return t.detach().requires_grad_(t.requires_grad and _differentiable(t))

        return pytree.tree_map(detach, result)

    def _median_time_s(self, setup: Callable[[], Any], run: Callable[[Any], Any]) -> float:
        times: list[float] = []
        for i in range(self.warmup + self.repeats):
            state = setup()
            _synchronize()
            start = time.perf_counter()
            out = run(state)
            _synchronize()
            elapsed = time.perf_counter() - start
            if i >= self.warmup:
                times.append(elapsed)
            del out, state
        return statistics.median(times)


def _transient_bytes(tracker: Any) -> int:
    """Peak minus what stayed alive, for a LiveTensorTracker (0 for a null context)."""
    if not isinstance(tracker, LiveTensorTracker):
        return 0
    return max(0, tracker.peak_bytes - tracker.live_bytes)


def _synchronize() -> None:
    """Wait for queued device work (CUDA runs asynchronously; CPU needs nothing)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()

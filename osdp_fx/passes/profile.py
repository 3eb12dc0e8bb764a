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
import math
import statistics
import time
from collections.abc import Callable, Hashable, Sequence
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
from ..runtime.memory import LiveTensorTracker, storage_key
from .profile_node import (
    PLAIN,
    PreparedInputs,
    detached,
    differentiable,
    Timing,
    median_time_s,
    outputs_read,
    outputs_to_differentiate,
    renamed,
    tensor_bytes,
    transient_bytes,
    writes_inputs,
)
from .pipeline import GraphPass
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


_ATTENTION_OPS = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "flex_attention")
"""Names of torch's fused attention operators (the functional one, the aten kernels export
leaves, and flex attention)."""


def is_attention(n: fx.Node) -> bool:
    """Whether ``n`` calls a fused attention operator (``NodeProfile.attention``)."""
    name = getattr(n.target, "__name__", None) or str(n.target)
    return n.op == "call_function" and name.split(".")[0] in _ATTENTION_OPS


def profile_graph_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    warmup: int = 2,
    repeats: int = 5,
    fake: bool = False,
    meta_device: torch.device | str = "cpu",
    share_repeats: bool = True,
    whole_graph: bool = False,
) -> PassResult:
    """Write a :class:`NodeProfile` into ``osdp_meta(node).profile`` for every node of ``gm``.

    ``example_inputs`` are the positional inputs of ``gm`` (flattened as for ``gm(*inputs)``).
    Inputs keep their ``requires_grad``; parameters require grad as they do in ``gm``. With
    ``fake=True`` nothing is computed for real: FLOPs and bytes are exact, times are None;
    meta tensors become fake tensors of ``meta_device`` (where a meta model will be
    materialised: a graph captured by export names it in its tensor factories), and a block that
    repeats an earlier one takes its profiles without running (``share_repeats``, [Note:
    repeated blocks]). ``whole_graph``: on the CPU, the measured node times are then scaled to
    the whole graph's forward and backward, timed as a step runs them
    (:func:`scale_to_whole_graph`, :func:`whole_graph_runs` runs); in a process group
    this is collective (the ranks run each timed run of their graphs at once, a barrier
    before each). Returns
    ``PassResult(gm, False)``: the graph is not changed.
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
    if whole_graph and times_whole_graph(gm, example_inputs, fake=fake):
        import torch.distributed as dist

        runs = whole_graph_runs(gm, least=max(repeats, WHOLE_GRAPH_REPEATS))
        together = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            count = torch.tensor([runs])  # every rank times as many runs, together
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            runs = int(count.item())
            together = dist.barrier  # every rank runs each at once, as its steps run
        scale_to_whole_graph(gm, example_inputs, warmup=warmup, repeats=runs, before=together)
    summary = summarize_profile(gm)
    log.info(
        "profiled %d nodes (%d of them as a repeated block's): %.3g forward FLOPs, %.3g "
        "backward FLOPs, %s forward / %s backward", summary.num_nodes, profiler.shared,
        summary.fwd_flops, summary.bwd_flops,
        _format_time(summary.fwd_time_s), _format_time(summary.bwd_time_s),
    )
    return PassResult(gm, False)


# [Note: the whole graph's time]
# A node profiled alone runs on fresh copies of its inputs, through an interpreter, between
# synchronizations; the step runs the compiled graph's code straight through, its autograd
# engine walking the backward, and on a CPU whose cores the other ranks' steps share. The sum
# of the nodes' medians missed a step's computation both ways: a few per cent to 15 % short on
# one rank per core, and half of it where four ranks shared two cores, the medians being the
# runs no other rank interrupted (``CHANGELOG.md``, "Prediction-accuracy runs of earlier code").
# So on the CPU the profile also times the whole graph, forward and then backward over the
# parameters that train, as a step runs it (every rank at once, a barrier before each run:
# after one barrier only, the ranks drifted apart over the runs, and where four ranks shared
# two cores a rank timed its runs with one, two or three others beside it: one model's
# replicated steps were then predicted a third too slow and another's 30 % too fast,
# ``CHANGELOG.md``),
# and scales the nodes' forward times, and apart their backward times, so that each adds up to
# its share of the whole's. The whole is the median of the runs' forward-and-backward sums, as
# a step is timed, not the sum of the two medians: where four ranks shared two cores, a rank's
# forward and backward were not slowed alike within a run (one ran while another rank
# waited), and the sum of the medians fell short of the median sum, which is what the plain
# model's step measured (``CHANGELOG.md``, "Prediction-accuracy runs of earlier code"); with a rank
# per core the two agreed. The whole is shared between forward and backward as their
# medians are. The nodes keep their shares, which is what the schedule and overlap models
# read; the step model reads the sums. On a GPU a node's time is its kernels' (CUDA events,
# [Note: timing a node on a GPU]), which the wall clock of the whole graph would mix with the
# host's dispatch, so the scaling is not done there.


WHOLE_GRAPH_REPEATS = 5
"""The least number of timed runs of the whole graph (their median is kept): with the
profile's 3, a run the other ranks slowed could set a small model's computation
(``CHANGELOG.md``, "Prediction-accuracy runs of earlier code")."""
WHOLE_GRAPH_SECONDS = 2.0
"""Seconds of whole-graph runs the profile aims at, by its nodes' summed times, between
:data:`WHOLE_GRAPH_REPEATS` and :data:`WHOLE_GRAPH_MAX_REPEATS` runs. Where ranks share a
machine's cores its speed moves from one second to the next, and the whole graph's time sets
the computation of every plan made from the profile: the median of runs spread over seconds
lies nearer a step's than that of the runs of a fraction of one (``CHANGELOG.md``,
"Prediction-accuracy runs of earlier code")."""
WHOLE_GRAPH_MAX_REPEATS = 40
"""The most timed runs of the whole graph."""


def whole_graph_runs(gm: fx.GraphModule, *, least: int) -> int:
    """How many runs :func:`scale_to_whole_graph` times: :data:`WHOLE_GRAPH_SECONDS` over the
    nodes' measured forward and backward times, at least ``least``, at most
    :data:`WHOLE_GRAPH_MAX_REPEATS` (or ``least`` where that is more)."""
    total = sum((p.fwd_time_s or 0.0) + (p.bwd_time_s or 0.0) for n in gm.graph.nodes
                if (p := osdp_meta(n).profile) is not None)
    if total <= 0:
        return least
    return max(least, min(WHOLE_GRAPH_MAX_REPEATS, math.ceil(WHOLE_GRAPH_SECONDS / total)))


def scale_to_whole_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], *, warmup: int,
                         repeats: int, before: Callable[[], object] | None = None,
                         ) -> tuple[float, float] | None:
    """Scale the measured node times of ``gm`` so that the forward and backward times add up to
    the whole graph's: the median over ``repeats`` runs (after ``warmup``) of
    ``gm(*example_inputs)`` and a backward from its floating outputs to the parameters that
    require grad, each run after ``before`` (a barrier: the ranks run each at once), shared
    between forward and backward as their medians are ([Note: the whole graph's time]).
    Returns the two factors, or None where nothing was scaled (no timed node, or the graph did
    not run straight through: logged)."""
    timed = _timed_nodes(gm)
    if not timed or sum(osdp_meta(n).profile.fwd_time_s for n in timed) <= 0:
        return None
    leaves = [p for p in gm.parameters() if p.requires_grad]
    forward, backward = [], []
    try:
        for i in range(warmup + repeats):
            if before is not None:
                before()
            start = time.perf_counter()
            with torch.enable_grad():
                outputs = [t for t in _tensor_list(gm(*example_inputs))
                           if t.requires_grad and differentiable(t)]
            middle = time.perf_counter()
            if outputs and leaves:
                torch.autograd.grad(outputs, leaves, [torch.ones_like(t) for t in outputs],
                                    allow_unused=True)
            end = time.perf_counter()
            if i >= warmup:
                forward.append(middle - start)
                backward.append(end - middle)
            del outputs
    except Exception as e:  # the nodes' own times stand
        log.warning("the profile keeps its node times: running the whole graph failed with "
                    "%s: %s", type(e).__name__, e)
        return None
    # a step runs its forward and then its backward: the median of the runs' sums, shared
    # between the two by their medians ([Note: the whole graph's time])
    whole = statistics.median(f + b for f, b in zip(forward, backward))
    fwd_median, bwd_median = statistics.median(forward), statistics.median(backward)
    fwd_share = fwd_median / (fwd_median + bwd_median) if fwd_median + bwd_median > 0 else 0.5
    scales = scale_to_times(gm, whole * fwd_share, whole * (1 - fwd_share))
    log.info("profile scaled to the whole graph: forward x%.3f, backward x%.3f", *scales)
    return scales


def _timed_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` with measured times."""
    return [n for n in gm.graph.nodes
            if (p := osdp_meta(n).profile) is not None and p.fwd_time_s is not None]


def times_whole_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], *,
                      fake: bool) -> bool:
    """Whether :func:`profile_graph_pass` with ``whole_graph`` times the whole graph of ``gm`` on
    ``example_inputs``: real tensors on the CPU ([Note: the whole graph's time])."""
    tensors = _tensor_list(list(example_inputs)) + list(gm.parameters())
    return not fake and not any(_is_fake_or_meta(t) or t.is_cuda for t in tensors)


def scale_to_times(gm: fx.GraphModule, fwd_s: float, bwd_s: float) -> tuple[float, float]:
    """Scale the measured node times of ``gm`` so that the forward times add up to ``fwd_s``
    and the backward times to ``bwd_s``, each node keeping its share. Returns the two factors
    (1.0 where the nodes' times add up to nothing)."""
    timed = _timed_nodes(gm)
    node_fwd = sum(osdp_meta(n).profile.fwd_time_s for n in timed)
    node_bwd = sum(osdp_meta(n).profile.bwd_time_s for n in timed)
    fwd_scale = fwd_s / node_fwd if node_fwd > 0 else 1.0
    bwd_scale = bwd_s / node_bwd if node_bwd > 0 else 1.0
    for n in timed:
        profile = osdp_meta(n).profile
        osdp_meta(n).profile = dataclasses.replace(
            profile, fwd_time_s=profile.fwd_time_s * fwd_scale,
            bwd_time_s=profile.bwd_time_s * bwd_scale)
    return fwd_scale, bwd_scale


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
    timed = _timed_nodes(gm)
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


class ProfileGraph(GraphPass, name="profile", requires={"normalized"}, ensures={"profiled"},
                   invalidates={"slowest_rank_times"}):
    """The pipeline's ``profile`` (``passes/pipeline.py``): :func:`profile_graph_pass` on
    ``example_inputs`` with its keyword ``options`` (``warmup``, ``repeats``, ``fake``,
    ``meta_device``, ``share_repeats``, ``whole_graph``)."""

    def __init__(self, example_inputs: Sequence[Any], **options: Any) -> None:
        self.example_inputs, self.options = example_inputs, options

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        return profile_graph_pass(graph_module, self.example_inputs, **self.options)


class SlowestRankTimes(GraphPass, name="slowest_rank_times", requires={"profiled"},
                       ensures={"slowest_rank_times"}):
    """The pipeline's ``slowest_rank_times`` (``passes/pipeline.py``):
    :func:`slowest_rank_times_pass` (collective)."""

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        return slowest_rank_times_pass(graph_module)


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
            return self.profile_compute_node(n)
        key = self.same_work_key(n, *self.fetch_args_kwargs_from_env(n))
        if key is not None and key in self._profiled:
            first, profile = self._profiled[key]
            return self.run_compute_node(n), renamed(profile, first, n)
        result, profile = self.profile_compute_node(n)
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

    def prepare_inputs(self, n: fx.Node, args: Any, kwargs: Any) -> PreparedInputs:
        """Copies of the node's inputs: parameters as detached leaves (their storage kept),
        activations as ``detach().requires_grad_().clone()`` so in-place ops stay legal."""
        names: dict[int, str] = {}
        for inp in n.all_input_nodes:
            for t in _tensor_list(self.env.get(inp)):
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
            if storage_key(t) in self.param_storages or t.is_contiguous():
                leaf = t.detach().requires_grad_(needs_grad)
                fresh = leaf if storage_key(t) in self.param_storages else leaf.clone()
            else:  # keep the exact strides: ops such as reshape copy only non-contiguous inputs
                # (an expanded one too: repeat_kv's reshape of an expanded key is a copy that
                # attention saves), so the whole storage is copied and viewed alike
                with torch.no_grad():
                    numel = t.untyped_storage().nbytes() // t.element_size()
                    whole = t.detach().as_strided((numel,), (1,), 0)
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

    def profile_compute_node(self, n: fx.Node) -> tuple[Any, NodeProfile]:
        """Run one compute node alone on copies of its inputs and measure it (the module
        docstring). Returns the node's value for its users and its profile."""

        def timed(setup: Callable[[], Any], run: Callable[[Any], Any]) -> Timing:
            return median_time_s(setup, run, warmup=self.warmup, repeats=self.repeats,
                                 gpu=on_gpu)

        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs = self.prepare_inputs(n, args, kwargs)
        on_gpu = any(t.is_cuda for t in _tensor_list((inputs.args, inputs.kwargs)))
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.setdefault(storage_key(t), t.untyped_storage().nbytes())
            # Detached: an op that saves its own output would otherwise hold it through its
            # grad_fn, a C++ reference cycle that retain_graph keeps alive for good.
            return t.detach()

        fwd_tracker = self.tracker()
        with self.flop_counter() as fwd_counter, fwd_tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                result = self.call(n, inputs)
        outputs = _tensor_list(result)
        if not outputs:  # shape arithmetic, asserts: nothing worth timing
            profile = NodeProfile.zero(timed=self.fake_mode is None)
            return result, dataclasses.replace(profile, fwd_flops=fwd_counter.get_total_flops())
        input_storages = set(inputs.storages) | self.param_storages
        input_storages |= {storage_key(t) for t in _tensor_list((inputs.args, inputs.kwargs))}

        grad_outputs = outputs_to_differentiate(n, result)
        seeds = [torch.ones_like(t) for t in grad_outputs]
        bwd_flops, grad_input_bytes, bwd_transient_bytes = 0, 0, 0
        passthrough: set[str] = set()
        has_backward = bool(grad_outputs and inputs.leaves)
        if has_backward:
            bwd_tracker = self.tracker()
            with self.flop_counter() as bwd_counter, bwd_tracker:
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
        host_time_s: float | None = None
        if self.fake_mode is None:
            fwd = timed(lambda: self.prepare_inputs(n, args, kwargs),
                        lambda prepared: self.call(n, prepared))
            bwd = Timing(0.0, None if fwd.host_s is None else 0.0)
            if has_backward:
                bwd = timed(
                    lambda: None,
                    lambda _: torch.autograd.grad(
                        grad_outputs, inputs.leaves, seeds, allow_unused=True, retain_graph=True
                    ),
                )
            fwd_time_s, bwd_time_s = fwd.time_s, bwd.time_s
            if fwd.host_s is not None and bwd.host_s is not None:
                host_time_s = fwd.host_s + bwd.host_s

        saved_storages = {k: v for k, v in saved.items() if k not in self.param_storages}
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
            host_time_s=host_time_s,
            saved_params=tuple(sorted({inputs.storages[k] for k in saved
                                       if k in self.param_storages and k in inputs.storages})),
            saved_output_bytes=sum(v for k, v in saved_storages.items()
                                   if k in output_storages and k not in input_storages),
            saved_input_bytes=sum(v for k, v in saved_storages.items() if k in inputs.storages),
            fwd_transient_bytes=transient_bytes(fwd_tracker),
            bwd_transient_bytes=bwd_transient_bytes,
            grad_passthrough=tuple(sorted(passthrough)),
            compute_dtype=next((str(t.dtype).removeprefix("torch.") for t in _tensor_list(
                (inputs.args, inputs.kwargs, outputs)) if t.dtype.is_floating_point), ""),
            attention=is_attention(n),
        )
        return detached(result), profile

    def same_work_key(self, n: fx.Node, args: Any, kwargs: Any) -> tuple[Any, ...] | None:
        """What the profile of compute node ``n`` on ``args``/``kwargs`` depends on ([Note: same
        work, one profile]); None when an argument is of a kind the key cannot hold."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        source: dict[int, int] = {}
        for i, inp in enumerate(n.all_input_nodes):
            for t in _tensor_list(self.env.get(inp)):
                source.setdefault(id(t), i)
        storages: dict[int, int] = {}
        same: dict[int, int] = {}
        parts: list[Any] = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key = storage_key(x)
                parts.append((tuple(x.shape), x.stride(), x.storage_offset(),
                              x.untyped_storage().nbytes(), x.dtype, x.device.type,
                              x.requires_grad, key in self.param_storages,
                              storages.setdefault(key, len(storages)),
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

    def run_compute_node(self, n: fx.Node) -> Any:
        """Node ``n``'s value for its users, as :meth:`profile_compute_node` computes it, without
        measuring anything: on its inputs themselves unless the operator writes into them (then
        on copies, as profiling does)."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if writes_inputs(n):
            prepared = self.prepare_inputs(n, args, kwargs)
            args, kwargs = prepared.args, prepared.kwargs
        with torch.enable_grad():
            result = getattr(self, n.op)(n.target, args, kwargs)
        return detached(result) if _tensor_list(result) else result

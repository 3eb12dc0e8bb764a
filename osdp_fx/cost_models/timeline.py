"""Peak memory of one training step, predicted by walking the step's timeline.

The peak of a step is not the sum of each part's maximum: parameters gathered for one operator
are freed before the next is gathered, activations pile up in forward and drain in backward,
gradients appear in backward and stay until the optimizer step. This module replays one
steady-state step (optimizer state already allocated, gradients set to None by the previous
``zero_grad``) over a profiled, normalised graph (``profile_graph_pass``) under a plan, and
reports the largest live total.

Time points: forward of node ``i`` is ``t = i``; backward of node ``i`` is ``t = 2N - 1 - i``
(reverse order), a replicated gradient it completes ``t + 0.375`` (its ``AccumulateGrad``
runs first: ``live_bytes.READY_BEFORE_SCATTERS``), and a reduce-scatter that follows it
``t + 0.5``; the second stage of a two-stage (hierarchical) gather before a forward or
backward at ``t`` is ``t - 0.25``; the end-of-backward gradient all-reduce is ``t = 2N``
(split weights' gradients joined just after); the optimizer step is ``t = 2N + 1``. At each
point allocations happen first (the peak is read), then frees.

What is alive, per rank (N ranks, R per node, P bytes of a parameter, Pp = N * ceil(rows / N)
rows padded; for hybrid_shard read R for N throughout):

* always: local parameters (shard Pp/N or full P), the module's buffers and tensor constants
  (:func:`constant_bytes`, counted with the parameters) and optimizer state (by optimizer
  kind, Adam's step counters too);
* the graph's outputs (the loss, a model output's logits): until after the optimizer step, as
  ``out = model(x); out.loss.backward(); opt.step()`` holds them;
* activations: a node's new output from its forward until its last forward use or, when autograd
  saves it (or a view of it), until the backward of the earliest node in graph order that saves
  it; tensors a node saves that are not its inputs or outputs (e.g. LayerNorm statistics) from
  its forward to its backward;
* gathered parameters (sharded): Pp from the first forward use, or with prefetch d from the
  first use of the sharded parameter gathered d places earlier; small parameters bucketed into
  one all-gather (``gather_buckets``) from their bucket's first use (its flat buffer from the
  bucket's allocation until then), their gradients until the bucket's reduce-scatter; ``full_shard`` (and
  ``hybrid_shard``, ``hierarchical``) frees after the last forward use of the parameter or a view
  of it and re-gathers Pp for the backward of each node that saved it (the first re-gather from
  the first re-gather of any of the d parameters saved after it, which prefetches it);
  ``shard_grad_op`` keeps it until the backward of the earliest saver; ``hierarchical`` gathers
  in two stages: the Pp / R block of the first (inter-node) stage is alive from the (prefetched)
  start until the second (intra-node) stage runs, a quarter step before the use, which
  allocates Pp;
* gradients of activations: from the backward of the last node that reads a node's output or a
  view of it to the node's own backward; a storage several operators read directly gets its
  gradient summed out of place: each reader's contribution (but the first's) from its backward,
  and the sum a quarter step later (``graph_facts.activation_grad_intervals``);
* parameter gradients: replicated, P from the first backward use to the end of the step; sharded,
  the full gradient P until the backward of the first use in graph order, then the asynchronous
  reduce-scatter holds it (or its padded copy Pp when Pp != numel; on gloo a copy it makes at
  the launch, when the gradient is alive too) until it completes: when the
  reduce-scatter ``schedule.scatters_in_flight`` later starts (those starting at one time point
  in the order autograd runs their all-gathers' backward: the one issued last first; a
  recomputed region's all-gathers, issued before it, after the region's backward unless read
  through ``grad_ready``), or at the end of backward; the Pp/N
  shard gradient from the start of the reduce-scatter to the end (``hierarchical``: its first,
  intra-node stage also holds a Pp / R block until the reduce-scatter completes);
* a split weight's gradient (its parts' in one tensor, as the compiled module shows the weight
  as one parameter): from the accumulation of its first replicated part's gradient, else from
  the end of backward (between ``t = 2N`` and the optimizer step, one weight after another),
  until the optimizer step; a sharded part's Pp/N shard gradient from its reduce-scatter's
  launch until it completes, or until that gradient exists; the replicated part's gradient a
  backward computes is a new tensor at its backward, added into it (:class:`_SplitGrads`);
* gradient all-reduce: flat buckets of the replicated gradients (``GradReducer``'s buckets), each
  from when its last gradient is ready until the bucket ``schedule.scatters_in_flight`` later
  starts or backward ends;
* optimizer step: Adam/AdamW's ``sqrt`` and division temporaries, 2x the largest local parameter,
  and the previous parameter's division result, which torch's single-tensor loop still holds
  (its ``denom``, until the next is assigned): at most the second largest, whatever the order.

Gradient accumulation (``grad_accumulation`` k > 1, the first k - 1 micro-batches of a step inside
``no_sync()``): a no_sync micro-batch runs no collective (no reduce-scatter or all-reduce buffers,
no shard gradients) and adds each sharded gradient into a held buffer (Pp in the reduce dtype,
alive from the start of the micro-batch when k > 2, from its first backward when k = 2); the last
micro-batch starts with those buffers and reduce-scatters each after adding its gradient;
replicated gradients are alive from the start of every micro-batch but the first. The peak is
the larger of a no_sync micro-batch's and the last one's.

Every activation-related term scales with the batch size; parameter terms do not. The prediction
is therefore also returned as a function of the batch size (``peak_bytes_expr``: a sympy ``Max``
of lines in ``b``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import fx

from ..core.buckets import Schedule
from ..core.devices import Devices
from ..core.layout import shard_count, split_weights
from ..core.node_meta import NodeRole, osdp_meta
from ..core.setting import StepSetting
from ..core.strategies import traits
from .envelope import BATCH  # noqa: F401  (BATCH re-exported)
from .envelope import envelope as _envelope
from .graph_facts import (
    PREFETCH_BEFORE,
    SPLIT_BEFORE,
    GraphFacts,
    ParamState,
    Regather,
    activation_grad_intervals,
    graph_facts,
    prefetched_regathers,
    regathered_together,
    sharded_gather_buckets,
)
from .live_bytes import (
    LOCAL,
    READY_BEFORE_SCATTERS,
    SYNC,
    Category,
    MemoryPoint,
    MemoryPrediction,
    Timeline,
    describe_time,
    replicated_buckets,
)
from .memory import (
    OPTIMIZER_STATES,
    gathered_param_bytes,
    optimizer_state_bytes,
    shard_numel,
)
from .recompute import (
    RegionSpan,
    internal_interval,
    recompute_workspace,
    region_spans,
    root_intervals,
)
from .shapes import rescaled


def constant_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the tensors ``gm`` holds that are not parameters: its buffers (a rotary
    embedding's frequencies, a causal mask) and the constants its graph reads (``get_attr``),
    each storage once. Every rank holds them whole, whatever the plan."""
    tensors = dict(gm.named_buffers())
    for n in gm.graph.nodes:  # parameters' get_attr nodes name their group: not resolved here
        if n.op == "get_attr" and not osdp_meta(n).param and n.target not in tensors:
            value: object = gm
            for part in str(n.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                tensors[str(n.target)] = value
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors.values()}
    return sum(storages.values())


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every part of one step's timeline reads: the graph's facts (profile rescaled to
    the sequence length), the plan, the devices and the step's time points."""

    facts: GraphFacts
    """Storage roots, savers and gradient flow of the graph."""
    params: Mapping[str, ParamState]
    """Each parameter group's size and strategy."""
    devices: Devices
    """World size, ranks per node, whether a reduce-scatter copies its input."""
    schedule: Schedule
    """Prefetch distance, bucket sizes, gradient collectives in flight."""
    optimizer: str
    """The optimizer kind (its state and temporaries)."""
    grad_accumulation: int
    """Micro-batches per optimizer step."""
    spans: dict[fx.Node, RegionSpan]
    """The recomputed region each operator is in (``recompute.region_spans``)."""

    @property
    def accumulating(self) -> bool:
        return self.grad_accumulation > 1

    @property
    def grad_sync(self) -> int:
        """The end of backward: the gradient all-reduce."""
        return 2 * len(self.facts.nodes)

    @property
    def optim_t(self) -> int:
        """The optimizer step."""
        return 2 * len(self.facts.nodes) + 1

    def bwd(self, i: int) -> int:
        """The time point of the backward of the node at position ``i``."""
        return 2 * len(self.facts.nodes) - 1 - i


@dataclasses.dataclass(frozen=True)
class _Gathers:
    """When the sharded parameters' forward all-gathers and backward re-gathers run."""

    uses_of: dict[fx.Node, list[fx.Node]]
    """The operators reading each parameter node (``GraphFacts.param_uses``)."""
    at: dict[fx.Node, tuple[int, int]]
    """Per operator, the positions it reads its parameters from and until: a recomputed
    region's operators from before its first to after its last operator."""
    buckets: list[list[fx.Node]]
    """The forward all-gathers in issue order (``graph_facts.sharded_gather_buckets``)."""
    bucket_of: dict[fx.Node, int]
    """The bucket of each sharded parameter node."""
    by: list[int]
    """Per bucket, the bucket whose first use starts its all-gather (itself without prefetch)."""
    split_at: list[float]
    """Per bucket, when it is waited for and split into its members' copies."""
    bucket_alloc: list[float]
    """Per bucket, when its all-gather starts (allocating its flat buffer)."""
    gather_at: dict[fx.Node, float]
    """Per sharded parameter node, when its gathered copy is allocated."""
    regather_at: dict[tuple[fx.Node, fx.Node], Regather]
    """Backward's re-gathers of the full_shard parameters, by (parameter, saver)
    (``graph_facts.prefetched_regathers``)."""
    together: frozenset[fx.Node]
    """The members of buckets backward re-gathers in one all-gather
    (``graph_facts.regathered_together``)."""


@dataclasses.dataclass(frozen=True)
class _ParamSizes:
    """The bytes one parameter group takes on a rank under its strategy."""

    full: int
    """The whole parameter in its own dtype."""
    chunks: int
    """Ranks it is sharded over (``layout.shard_count``)."""
    padded: int
    """The padded whole in its own dtype (a multiple of ``chunks`` elements)."""
    gathered: int
    """The padded whole in the compute dtype: a gathered copy."""
    local_numel: int
    """Elements of this rank's shard (or the whole, replicated)."""
    local: int
    """Bytes this rank holds throughout."""
    staged: bool
    """Whether it is gathered in two stages (``hierarchical`` across nodes)."""
    block: int
    """``hierarchical`` across nodes: the first stage's block of a gathered copy; else 0."""


@dataclasses.dataclass(frozen=True)
class _GradPiece:
    """One sharded gradient of a gather bucket, as its reduce-scatter sees it."""

    start: float
    """When backward allocates the gradient."""
    done: float
    """When the gradient is complete (the backward of its last use)."""
    grad_bytes: int
    """The gradient in the compute dtype."""
    held_bytes: int
    """What the reduce-scatter holds of it: the padded gradient in the reduce dtype."""
    shard_bytes: int
    """The shard gradient the reduce-scatter leaves on this rank."""
    block_bytes: int
    """``hierarchical``: the intra-node stage's block held until the reduce-scatter completes."""
    split: str | None = None
    """The split weight it is a part of: its shard gradient lands in the weight's gradient
    (:class:`_SplitGrads`), not in one of its own."""


@dataclasses.dataclass
class _SplitGrads:
    """The gradient of one split weight ([Note: split parameters], ``runtime/sharded.py``): one
    tensor holding every part's (a replicated part's whole, a sharded part's shard) until the
    optimizer step, allocated when autograd accumulates its first replicated part's gradient,
    else once backward has reduced every sharded part (the end of backward); a sharded part's
    shard is its own tensor from its reduce-scatter's launch until it is added into it."""

    nbytes: int = 0
    """Its bytes: every trainable part's local gradient."""
    starts: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    """(micro-batch, when) a replicated part's gradient is accumulated."""
    shards: list[tuple[int, float, int]] = dataclasses.field(default_factory=list)
    """(gather bucket, reduce-scatter launch, bytes) of each sharded part's shard gradient
    (synchronised micro-batches only)."""


@dataclasses.dataclass(frozen=True)
class _Scatter:
    """One reduce-scatter (of a gather bucket's gradients) on the timeline."""

    launch: float
    """When it starts."""
    since: float
    """When the gradient it is handed was allocated (``launch`` for a bucket's flat copy)."""
    held_bytes: int
    """What it holds from its launch until it completes."""
    block_bytes: int
    """``hierarchical``: the staged block it holds as well."""
    bucket: int
    """The gather bucket it reduces (those launched at one time point start in reverse)."""


def _rescaled_facts(facts: GraphFacts, seq_scale: Mapping[str, tuple[float, ...]]) -> GraphFacts:
    return dataclasses.replace(facts, profile=rescaled(facts.profile, seq_scale))


def _region_spans(facts: GraphFacts,
                  recompute: tuple[tuple[str, str], ...]) -> dict[fx.Node, RegionSpan]:
    return region_spans(facts, dict(recompute))


def _activations(facts: GraphFacts, recompute: tuple[tuple[str, str], ...]) -> Timeline:
    """The activations' part of a step's timeline (:func:`_add_activations`), which depends on
    the recomputed regions alone: made once per set of them, copied for each plan."""
    tl = Timeline()
    _add_activations(tl, facts, facts.derive(_region_spans, recompute))
    return tl


def _add_activations(tl: Timeline, facts: GraphFacts,
                     spans: Mapping[fx.Node, RegionSpan]) -> None:
    """Activations and what nodes save for backward (recomputed regions:
    ``cost_models/recompute.py``), operator temporaries, gradients of activations (summed out
    of place where several operators read a storage) and the step's inputs, which the caller
    holds for the whole step."""
    nodes, pos, prof = facts.nodes, facts.pos, facts.profile
    optim_t = 2 * len(nodes) + 1  # _Step.optim_t

    def bwd(i: int) -> int:  # _Step.bwd
        return 2 * len(nodes) - 1 - i

    users_of_root = {r: [u for m in ms for u in m.users] for r, ms in facts.members.items()}
    intervals = [iv for r in users_of_root if r.op not in ("placeholder", "get_attr")
                 and not prof[r].output_is_view
                 for iv in root_intervals(r, facts, spans, bwd, optim_t)]
    intervals += [internal_interval(j, facts, spans, bwd) for j in nodes]
    for start, end, nbytes, again in intervals + recompute_workspace(spans, facts, bwd):
        tl.alive(start, end, nbytes, Category.RECOMPUTED if again else Category.ACTIVATIONS,
                 scaled=True)
    for j in nodes:
        p = prof[j]
        tl.alive(pos[j], pos[j], p.fwd_transient_bytes, Category.TEMPORARIES, scaled=True)
        tl.alive(bwd(pos[j]), bwd(pos[j]), p.bwd_transient_bytes, Category.TEMPORARIES, scaled=True)
    for start, end, nbytes in activation_grad_intervals(facts, bwd):
        tl.alive(start, end, nbytes, Category.ACTIVATION_GRADIENTS, scaled=True)
    for n in nodes:
        if n.op == "placeholder":
            tl.alive(0, optim_t, prof[n].output_bytes, Category.INPUTS, scaled=True)


def _gathers(step: _Step) -> _Gathers:
    """When each sharded parameter is gathered in forward and re-gathered in backward.

    A bucket's all-gather is waited for (a bucket of several parameters is gathered into one
    flat buffer and split into copies, both alive until the flat is freed) before the
    prefetches it starts, which start before its first user runs: with prefetching a bucket
    allocates at the first use of the bucket ``prefetch`` before it."""
    facts, params, spans = step.facts, step.params, step.spans
    world_size, prefetch = step.devices.world_size, step.schedule.prefetch
    gather_bucket_bytes = step.schedule.gather_bucket_bytes
    pos, param_of = facts.pos, facts.param_of
    uses_of = {node: facts.param_uses(node) for node in param_of}
    sharded = [node for node in param_of if traits(params[param_of[node]].strategy).sharded
               and uses_of[node]]
    buckets = sharded_gather_buckets(facts, params, world_size, gather_bucket_bytes,
                                     {u: span.first for u, span in spans.items()})
    at = {u: (spans[u].first, spans[u].last) if u in spans else (pos[u], pos[u])
          for u in facts.nodes}
    first_use = {n: min(at[u][0] for u in uses_of[n]) for n in sharded}
    by = [max(0, i - prefetch) for i in range(len(buckets))]
    split_at = [first_use[bucket[0]] - SPLIT_BEFORE for bucket in buckets]
    bucket_alloc = [split_at[i] if by[i] == i else first_use[buckets[by[i]][0]] - PREFETCH_BEFORE
                    for i in range(len(buckets))]
    bucket_of = {n: i for i, bucket in enumerate(buckets) for n in bucket}
    gather_at = {n: bucket_alloc[bucket_of[n]] if len(buckets[bucket_of[n]]) == 1
                 else split_at[bucket_of[n]] for n in sharded}
    # saved by operators outside recomputed regions (a region's parameters are re-gathered
    # when it is recomputed, and prefetching passes them by)
    saved_outside = {node: [j for j in facts.savers.get(node, []) if j not in spans]
                     for node in sharded}
    together = regathered_together(facts, params, buckets, world_size, gather_bucket_bytes)
    regather_at = prefetched_regathers(
        [node for node in sharded if traits(params[param_of[node]].strategy).freed_after_forward
         and saved_outside[node]], saved_outside, pos, step.bwd, prefetch, together,
        {n: gathered_param_bytes(params[param_of[n]].numel, world_size=world_size,
                                 element_size=params[param_of[n]].compute_size,
                                 row=params[param_of[n]].row) for n in sharded})
    return _Gathers(uses_of, at, buckets, bucket_of, by, split_at, bucket_alloc, gather_at,
                    regather_at, frozenset(n for b in together for n in b))


def _scattered_when_ready(node: fx.Node, step: _Step, gathers: _Gathers) -> bool:
    """Whether a sharded parameter's reduce-scatter starts when its gradient is complete.
    Not when a recomputed region reads it through an all-gather that runs before the region
    (a bucket's, or read outside the region too): then after the region's backward
    ([Note: reduce-scatter in recomputed regions] in ``passes/recompute.py``)."""
    spans = step.spans
    regions = {spans[u].name if u in spans else None for u in gathers.uses_of[node]}
    if regions == {None}:
        return True
    outside = [m for m in step.facts.members[node] if m not in spans]
    casts = [m for m in outside if osdp_meta(m).role == NodeRole.CAST]
    return (len(regions) == 1 and None not in regions
            and len(gathers.buckets[gathers.bucket_of[node]]) == 1
            and set(outside) <= {node, *casts}
            and all(set(m.users) <= spans.keys() for m in casts)
            and set(node.users) <= (set(casts) if casts else spans.keys()))


@functools.lru_cache(maxsize=1 << 16)  # [Note: cost caches]
def _param_sizes(state: ParamState, devices: Devices) -> _ParamSizes:
    """What one parameter group takes on a rank under its strategy."""
    world_size, ranks_per_node = devices.world_size, devices.ranks_per_node
    full = state.numel * state.element_size
    chunks = shard_count(state.strategy, world_size, ranks_per_node)
    padded = gathered_param_bytes(state.numel, element_size=state.element_size,
                                  world_size=chunks, row=state.row)
    gathered = padded // state.element_size * state.compute_size
    t = traits(state.strategy)
    # hierarchical: the block of the first stage (1/R of the buffer) while the second runs
    nodes_in_mesh = world_size // (ranks_per_node or world_size)
    staged = (len(t.gather_stages) > 1 and ranks_per_node is not None
              and 1 < ranks_per_node and nodes_in_mesh > 1)
    return _ParamSizes(
        full=full, chunks=chunks, padded=padded, gathered=gathered,
        local_numel=shard_numel(state.numel, chunks, state.row),
        local=padded // chunks if t.sharded else full, staged=staged,
        block=gathered // ranks_per_node if staged and ranks_per_node else 0)


def _add_gathered(tl: Timeline, step: _Step, gathers: _Gathers, node: fx.Node,
                  state: ParamState, size: _ParamSizes) -> None:
    """The gathered (or cast) copies of one parameter node: ``full_shard`` (and the mesh
    strategies) from its gather to its last forward use and again for the backward of each
    saver (re-gathered once to recompute a region), ``shard_grad_op`` until the backward of
    its earliest saver, a mixed-precision replicated parameter its cast copy."""
    facts, spans, bwd = step.facts, step.spans, step.bwd
    pos, at = facts.pos, gathers.at
    uses = gathers.uses_of[node]
    t = traits(state.strategy)
    gathered, block = size.gathered, size.block
    last = max(at[u][1] for u in uses)
    redo = {spans[u].name: spans[u] for u in uses if u in spans}
    saved_by = [j for j in facts.savers.get(node, []) if j not in spans]
    kept_until = max([bwd(pos[j]) for j in saved_by] + [bwd(r.first) for r in redo.values()]
                     + [last])
    if t.freed_after_forward:
        for r in redo.values():  # re-gathered once to recompute, until its first backward
            done = [bwd(pos[j]) for j in facts.savers.get(node, []) if spans.get(j) is r]
            tl.alive(r.recompute_at(bwd), max(done, default=r.recompute_at(bwd)), gathered,
                     Category.GATHERED, scaled=False)
        # A two-stage gather's second stage runs (allocating the buffer) a quarter step
        # before the use, when it is waited for; its first stage's block is alive from its
        # start. A bucket's first stage brings 1/R of its flat buffer, which is charged from
        # the bucket's all-gather to its split (``_add_buckets``, and below for a re-gather
        # together) and freed after the second stage, before the split: the flat covers it.
        gather_at = gathers.gather_at[node]
        alone = len(gathers.buckets[gathers.bucket_of[node]]) == 1
        wait = min(pos[u] for u in uses) - 0.25 if block and alone else gather_at
        tl.alive(min(gather_at, wait), wait, block if alone else 0, Category.COMMUNICATION,
                 scaled=False)
        tl.alive(wait, last, gathered, Category.GATHERED, scaled=False)
        for j in saved_by:  # re-gathered alone, or with its bucket (split at its first unpack)
            r = gathers.regather_at.get((node, j))
            start, split = (r.start, r.split) if r else (bwd(pos[j]), bwd(pos[j]))
            alone = node not in gathers.together
            wait = bwd(pos[j]) - 0.25 if block and alone else split
            tl.alive(min(start, wait), wait, block if alone else 0, Category.COMMUNICATION,
                     scaled=False)
            tl.alive(wait, bwd(pos[j]), gathered, Category.GATHERED, scaled=False)
            if r and r.flat_bytes:
                tl.alive(start, split, r.flat_bytes, Category.COMMUNICATION, scaled=False)
                if start < split:  # prefetched: its send buffer until it is waited for
                    tl.alive(start, split, r.flat_bytes // size.chunks, Category.COMMUNICATION,
                             scaled=False)
    elif t.keeps_gathered:
        tl.alive(gathers.gather_at[node], kept_until, gathered, Category.GATHERED, scaled=False)
    elif state.compute_size != state.element_size:  # replicate: the cast copy
        tl.alive(min(pos[u] for u in uses), kept_until, state.numel * state.compute_size,
                 Category.GATHERED, scaled=False)


def _add_param_gradient(tl: Timeline, step: _Step, gathers: _Gathers, node: fx.Node,
                        state: ParamState, size: _ParamSizes,
                        split: tuple[str, _SplitGrads] | None = None,
                        ) -> tuple[float, _GradPiece | None]:
    """The gradient of one trainable parameter node until its collective: a replicated one's
    in ``.grad`` (from the start of a micro-batch where earlier ones accumulated it), summed
    out of place where several operators read the parameter. Returns when it is complete
    (-1: it gets none) and, when sharded, what its reduce-scatter holds of it (the caller
    charges those per gather bucket). A part of a split weight (``split``: the weight and its
    gradient) has its gradient in the weight's: a replicated part's this backward computes is
    added into it, a new tensor until then; the caller charges the weight's."""
    facts, bwd, pos, at = step.facts, step.bwd, step.facts.pos, gathers.at
    t = traits(state.strategy)
    grad_uses = [u for u in gathers.uses_of[node] if facts.requires_grad[u]]
    if not grad_uses:
        return -1, None
    grad_start, grad_done = bwd(max(pos[u] for u in grad_uses)), bwd(min(pos[u] for u in grad_uses))
    if t.sharded and not _scattered_when_ready(node, step, gathers):  # after its regions' backward
        grad_done = bwd(min(at[u][0] for u in grad_uses))
    # A parameter read by several operators (tied weights) gets its gradient summed out of
    # place (autograd's input buffer): the backward of every use but the first to run
    # allocates its contribution and the sum while the gradient so far is alive.
    grad_bytes = state.numel * state.compute_size if t.sharded else size.full
    for u in grad_uses:
        if bwd(pos[u]) != grad_start:
            tl.alive(bwd(pos[u]), bwd(pos[u]), 2 * grad_bytes, Category.GRADIENTS,
                     scaled=False)
    if t.sharded:
        held = size.padded // state.element_size * state.reduce_size
        ranks_per_node = step.devices.ranks_per_node
        if split is not None:
            split[1].nbytes += size.padded // size.chunks
        return grad_done, _GradPiece(grad_start, grad_done, state.numel * state.compute_size,
                                     held, size.padded // size.chunks,
                                     held // ranks_per_node if size.staged and ranks_per_node
                                     else 0, split[0] if split is not None else None)
    if split is not None:
        split[1].nbytes += size.full
        tl.alive(grad_start, grad_done, size.full, Category.GRADIENTS, scaled=False)
        for micro, since in ((SYNC, 0 if step.accumulating else grad_start),
                             (LOCAL, 0 if step.grad_accumulation > 2 else grad_start)):
            split[1].starts.append((micro, since))
        return grad_done, None
    # accumulated by earlier micro-batches: alive from the start, and this backward's
    # gradient is a new tensor until autograd adds it to ``.grad``
    for micro, since in ((SYNC, 0 if step.accumulating else grad_start),
                         (LOCAL, 0 if step.grad_accumulation > 2 else grad_start)):
        tl.alive(since, step.optim_t, size.full, Category.GRADIENTS, scaled=False, only=micro)
        if since == 0:
            tl.alive(grad_start, grad_done, size.full, Category.GRADIENTS, scaled=False,
                     only=micro)
    return grad_done, None


def _add_params(tl: Timeline, step: _Step, gathers: _Gathers, base: dict[Category, int],
                splits: dict[str, _SplitGrads],
                ) -> tuple[list[int], dict[str, float], dict[int, list[_GradPiece]]]:
    """Every parameter node's local bytes and optimizer state (added to ``base``), gathered
    copies and gradients (a split weight's gathered into ``splits``). Returns the trainable
    parameters' local bytes (a split weight's one parameter's), when each replicated gradient
    is ready for its all-reduce, and the sharded gradients by gather bucket."""
    local_bytes: list[int] = []
    split_bytes: dict[str, int] = defaultdict(int)
    replicated_ready: dict[str, float] = {}
    bucket_grads: dict[int, list[_GradPiece]] = defaultdict(list)
    weight_of = _split_weights(tuple(step.params))
    for node, name in step.facts.param_of.items():
        state = step.params[name]
        size = _param_sizes(state, step.devices)
        base[Category.PARAMETERS] += size.local
        weight = weight_of.get(name)
        if state.trainable:
            base[Category.OPTIMIZER_STATE] += optimizer_state_bytes(size.local_numel,
                                                                    optimizer=step.optimizer)
            if weight is None:
                local_bytes.append(size.local)
            else:
                split_bytes[weight] += size.local
        if not gathers.uses_of[node]:
            continue
        _add_gathered(tl, step, gathers, node, state, size)
        if not state.trainable:
            continue
        split = (weight, splits.setdefault(weight, _SplitGrads())) if weight else None
        done, piece = _add_param_gradient(tl, step, gathers, node, state, size, split)
        if piece is not None:
            bucket_grads[gathers.bucket_of[node]].append(piece)
        elif done >= 0:  # its leaf's hook runs before the gathers' backward at this point
            replicated_ready[name] = done + READY_BEFORE_SCATTERS
    return local_bytes + list(split_bytes.values()), replicated_ready, bucket_grads


@functools.lru_cache(maxsize=256)
def _split_weights(names: tuple[str, ...]) -> dict[str, str]:
    """``core.layout.split_weights`` of a plan's group names (the same for every candidate
    plan of a search)."""
    return split_weights(names)


def _add_split_grads(tl: Timeline, step: _Step, splits: Mapping[str, _SplitGrads],
                     completed: Mapping[int, float]) -> None:
    """Each split weight's gradient until the optimizer step, from its first replicated part's
    accumulation, else from the end of backward (the weights one after another, in the order
    their first shard completed), and its sharded parts' shards from their reduce-scatter's
    launch until then, or until it completes (``completed``: per gather bucket) where the
    gradient exists by then."""
    def first_done(grads: _SplitGrads) -> float:
        return min((completed[b] for b, _, _ in grads.shards), default=step.grad_sync)

    joined = [g for g in sorted(splits.values(), key=first_done) if g.shards]
    for grads in splits.values():
        replicated = [t for m, t in grads.starts if m == SYNC]
        if replicated:
            since = min(replicated)
        else:  # joined at the end of backward, one weight after another
            since = step.grad_sync + (joined.index(grads) + 1) / (len(joined) + 1)
        for bucket, launch, nbytes in grads.shards:
            until = max(completed[bucket], since) if replicated else since
            tl.alive(launch, until, nbytes, Category.GRADIENTS, scaled=False, only=SYNC)
        if replicated or grads.shards:
            tl.alive(since, step.optim_t, grads.nbytes, Category.GRADIENTS, scaled=False,
                     only=SYNC)
        local = [t for m, t in grads.starts if m == LOCAL]
        if local:  # a no_sync micro-batch: a replicated part's accumulation allocates it
            tl.alive(min(local), step.optim_t, grads.nbytes, Category.GRADIENTS, scaled=False,
                     only=LOCAL)


def _add_buckets(tl: Timeline, step: _Step, gathers: _Gathers,
                 bucket_grads: Mapping[int, list[_GradPiece]],
                 splits: Mapping[str, _SplitGrads]) -> list[_Scatter]:
    """Per gather bucket: the flat buffer of a bucket of several parameters until it is split,
    its gradients until their reduce-scatter, the shard gradients it leaves (a split weight's
    part's: in the weight's gradient, allocated by the launch at the latest), and,
    accumulating, the buffer the micro-batches add their gradients into. Returns the
    reduce-scatters, in bucket order."""
    params, world_size = step.params, step.devices.world_size
    param_of, optim_t = step.facts.param_of, step.optim_t
    scatters: list[_Scatter] = []
    for i, bucket in enumerate(gathers.buckets):
        if len(bucket) > 1:  # the flat buffer of the gather, until it is split
            state = params[param_of[bucket[0]]]
            chunks = shard_count(state.strategy, world_size, step.devices.ranks_per_node)
            flat = sum(gathered_param_bytes(params[param_of[n]].numel,
                                            element_size=params[param_of[n]].compute_size,
                                            world_size=chunks, row=params[param_of[n]].row)
                       for n in bucket)
            alloc, split = gathers.bucket_alloc[i], gathers.split_at[i]
            tl.alive(alloc, split, flat, Category.COMMUNICATION, scaled=False)
            if gathers.by[i] != i:  # prefetched: its send buffer until it is waited for
                tl.alive(alloc, split, flat // chunks, Category.COMMUNICATION, scaled=False)
        grads = bucket_grads.get(i)
        if not grads:
            continue
        # The reduce-scatter starts after the backward of the bucket's last gradient has
        # released what it unpacked (half a step later) and holds the gradient (its padded copy
        # in the reduce dtype; a bucket's flat concatenation) until it completes.
        launch = max(g.done for g in grads) + 0.5
        held = sum(g.held_bytes for g in grads)
        held_block = sum(g.block_bytes for g in grads)
        if len(grads) == 1 and len(bucket) == 1 and held == grads[0].grad_bytes:
            scatters.append(_Scatter(launch, grads[0].start, held, held_block, i))
        else:
            for g in grads:
                tl.alive(g.start, launch, g.grad_bytes, Category.GRADIENTS, scaled=False,
                         only=SYNC)
            scatters.append(_Scatter(launch, launch, held, held_block, i))
        for g in grads:
            if g.split is not None:
                splits[g.split].shards.append((i, launch, g.shard_bytes))
            else:
                tl.alive(launch, optim_t, g.shard_bytes, Category.GRADIENTS, scaled=False,
                         only=SYNC)
        # Accumulating: the synchronised backward adds into the held buffer and reduce-scatters
        # it; a no_sync backward adds its gradients into it (the first allocates it).
        if step.accumulating:
            tl.alive(0, launch - 0.125, held, Category.GRADIENTS, scaled=False, only=SYNC)
            tl.alive(0 if step.grad_accumulation > 2 else launch, step.grad_sync, held,
                     Category.GRADIENTS, scaled=False, only=LOCAL)
            for g in grads:
                tl.alive(g.start, launch, g.grad_bytes, Category.GRADIENTS, scaled=False,
                         only=LOCAL)
    return scatters


def _add_scatters(tl: Timeline, step: _Step, scatters: list[_Scatter]) -> dict[int, float]:
    """The reduce-scatters in flight. At most ``schedule.scatters_in_flight`` run at once:
    starting one more completes the oldest; the rest complete at the end of backward. Those
    launched at one time point start in the order autograd runs their all-gathers' backward:
    the all-gather issued last first. Returns when each completes, by gather bucket."""
    in_flight = step.schedule.scatters_in_flight
    ordered = sorted(scatters, key=lambda s: (s.launch, -s.bucket))
    completed: dict[int, float] = {}
    for i, s in enumerate(ordered):
        later = i + in_flight
        # completed (and its buffer freed) before the later one starts
        done = ordered[later].launch - 0.0625 if later < len(ordered) else step.grad_sync
        completed[s.bucket] = done
        if s.since < s.launch:  # the gradient itself, handed to the reduce-scatter at its
            # launch (gloo: copied then, so both are alive at the launch)
            copies = step.devices.reduce_scatter_copies_input
            tl.alive(s.since, s.launch - (0 if copies else 0.125), s.held_bytes,
                     Category.GRADIENTS, scaled=False, only=SYNC)
        tl.alive(s.launch, done, s.held_bytes, Category.COMMUNICATION, scaled=False, only=SYNC)
        tl.alive(s.launch, done, s.block_bytes, Category.COMMUNICATION, scaled=False, only=SYNC)
    return completed


def _add_optimizer_step(tl: Timeline, step: _Step, local_bytes: list[int]) -> None:
    """Adam/AdamW's ``sqrt`` and division temporaries, 2x the largest local parameter, and
    the previous parameter's division result (at most the second largest)."""
    if OPTIMIZER_STATES[step.optimizer] == 2 and local_bytes:
        largest, second = ([*sorted(local_bytes, reverse=True), 0])[:2]
        tl.alive(step.optim_t, step.optim_t, 2 * largest + second,
                 Category.OPTIMIZER_TEMPORARIES, scaled=False, only=SYNC)


def _step_timeline(
    gm: fx.GraphModule,
    params: Mapping[str, ParamState],
    facts: GraphFacts | None,
    setting: StepSetting,
    *,
    recompute: Mapping[str, str] | None,
    seq_scale: Mapping[str, tuple[float, ...]] | None,
) -> tuple[Timeline, dict[Category, int], tuple[tuple[float, str], ...], list[fx.Node], int]:
    """The allocations of one step (:func:`predict_step_memory`'s arguments): the timeline, the
    bytes held throughout by category, the micro-batches as (time shift, which), the nodes and
    the optimizer step's time point."""
    if facts is None:
        facts = graph_facts(gm, {name: p.trainable for name, p in params.items()})
    if seq_scale:  # every reader of the profile (recompute.py too) sees the scaled bytes
        facts = facts.derive(_rescaled_facts, seq_scale)
    regions = tuple(sorted((recompute or {}).items()))
    step = _Step(facts, params, setting.devices, setting.schedule, setting.optimizer,
                 setting.grad_accumulation, facts.derive(_region_spans, regions))
    tl = facts.derive(_activations, regions).copy()
    base = {Category.PARAMETERS: constant_bytes(gm), Category.OPTIMIZER_STATE: 0}
    gathers = _gathers(step)
    splits: dict[str, _SplitGrads] = {}
    local_bytes, replicated_ready, bucket_grads = _add_params(tl, step, gathers, base, splits)
    completed = _add_scatters(tl, step, _add_buckets(tl, step, gathers, bucket_grads, splits))
    _add_split_grads(tl, step, splits, completed)
    if step.devices.world_size > 1:
        schedule = step.schedule
        replicated_buckets(tl, params, replicated_ready, bucket_bytes=schedule.reduce_bucket_bytes,
                           in_flight=schedule.scatters_in_flight, end=step.grad_sync)
    _add_optimizer_step(tl, step, local_bytes)
    # Accumulating, a no_sync micro-batch comes first on the timeline (shifted before t = 0).
    micros = ((-(step.optim_t + 1), LOCAL), (0, SYNC)) if step.accumulating else ((0, SYNC),)
    return tl, base, micros, facts.nodes, step.optim_t


def predict_step_memory(
    gm: fx.GraphModule,
    params: Mapping[str, ParamState],
    facts: GraphFacts | None = None,
    *,
    setting: StepSetting,
    profiled_batch: int = 1,
    recompute: Mapping[str, str] | None = None,
    seq_scale: Mapping[str, tuple[float, ...]] | None = None,
) -> MemoryPrediction:
    """Predict the peak memory of one training step of ``gm`` under the given strategies.

    ``gm`` is the normalised graph (parameters as ``get_attr`` nodes whose ``osdp_meta.param``
    names the group), profiled by ``profile_graph_pass`` at ``profiled_batch``; ``params`` maps
    each parameter group to its size and strategy; ``facts``: ``graph_facts`` of ``gm`` (an
    ``Analysis`` holds them; None: derived here, once per call). ``setting``: the step; its
    ``batch_size`` (None: ``profiled_batch``) scales activations; its devices give the world
    size, the ranks per node (None: one node; they size hybrid_shard's shards and
    hierarchical's stages) and whether a reduce-scatter copies a gradient it is handed at its
    launch (``Devices.reduce_scatter_copies_input``); its schedule the prefetch distance, the
    two bucket sizes and the gradient collectives in flight; its ``grad_accumulation`` k > 1: a
    step is k micro-batches, the first k - 1 run inside ``no_sync()`` (see "Gradient
    accumulation" in the module docstring), the peak that of the micro-batch that holds the
    most. ``recompute``: the regions recomputed, by policy;
    ``seq_scale``: activations at another sequence length (``shapes.py``).
    """
    tl, base, micros, nodes, optim_t = _step_timeline(gm, params, facts, setting,
                                                      recompute=recompute, seq_scale=seq_scale)
    batch = setting.batch_size or profiled_batch
    steady = _steady(tl, base, micros)
    # The first step: the optimizer allocates its state in its first step() (torch.optim's
    # lazy ``_init_group``), after backward, while the gradients are alive.
    tl.alive(optim_t, optim_t + 1, base[Category.OPTIMIZER_STATE], Category.OPTIMIZER_STATE,
             scaled=False, only=SYNC)
    first = [p for _, micro in micros
             for p in tl.sweep({Category.PARAMETERS: base[Category.PARAMETERS]}, micro)]

    def total(point: tuple[float, dict[Category, tuple[int, int]]]) -> int:
        return sum(sc * batch // profiled_batch + fx_ for sc, fx_ in point[1].values())

    def where(t: float) -> str:
        if t < 0:
            return f"{describe_time(t + optim_t + 1, nodes)} (a no_sync micro-batch)"
        return describe_time(t, nodes) if t <= optim_t else "after the step"

    # the earliest of equal peaks
    t_peak, at_peak = max(steady, key=lambda p: (total(p), -p[0]))
    lines = _lines(steady)
    return MemoryPrediction(
        peak_bytes=total((t_peak, at_peak)),
        peak_at=where(t_peak),
        persistent_bytes=sum(base.values()),
        peak_bytes_expr=_envelope(lines, profiled_batch),
        profiled_batch=profiled_batch,
        first_step_peak_bytes=max(total(p) for p in first),
        peak_by_category=tuple((str(c), sc * batch // profiled_batch + fx_)
                               for c, (sc, fx_) in at_peak.items()),
        timeline=tuple(
            MemoryPoint(t, where(t), tuple((str(c), sc * batch // profiled_batch + fx_)
                              for c, (sc, fx_) in by.items()))
            for t, by in steady),
        lines=tuple(lines),
    )


def _steady(tl: Timeline, base: dict[Category, int],
            micros: tuple[tuple[float, str], ...]) -> list[tuple[float, dict[Category, tuple[int, int]]]]:
    """Every time point of a steady step and its (scaled, fixed) bytes by category."""
    return [(t + shift, by) for shift, micro in micros for t, by in tl.sweep(base, micro)]


def _lines(steady: list[tuple[float, dict[Category, tuple[int, int]]]]) -> list[tuple[int, int]]:
    """Each time point's (scaled, fixed) bytes: its line in the batch size."""
    return [(sum(sc for sc, _ in by.values()), sum(fx_ for _, fx_ in by.values()))
            for _, by in steady]


def predict_memory_lines(gm: fx.GraphModule, params: Mapping[str, ParamState],
                         facts: GraphFacts | None = None, *, setting: StepSetting,
                         recompute: Mapping[str, str] | None = None,
                         seq_scale: Mapping[str, tuple[float, ...]] | None = None,
                         ) -> tuple[tuple[int, int], ...]:
    """``predict_step_memory(...).lines`` (the same arguments) without the rest of the
    prediction: what the peak over shapes is fitted from (``shapes.peak_in_seq``)."""
    tl, base, micros, _, _ = _step_timeline(gm, params, facts, setting, recompute=recompute,
                                            seq_scale=seq_scale)
    return tuple(_lines(_steady(tl, base, micros)))


def predict_peak_bytes(gm: fx.GraphModule, params: Mapping[str, ParamState],
                       facts: GraphFacts | None = None, *, setting: StepSetting,
                       profiled_batch: int = 1, recompute: Mapping[str, str] | None = None,
                       seq_scale: Mapping[str, tuple[float, ...]] | None = None) -> int:
    """``predict_step_memory(...).peak_bytes`` (the same arguments) without the rest of the
    prediction: what the searches check a candidate plan with."""
    tl, base, micros, _, _ = _step_timeline(gm, params, facts, setting, recompute=recompute,
                                            seq_scale=seq_scale)
    batch = setting.batch_size or profiled_batch
    return max(tl.peak(base, micro, batch, profiled_batch) for _, micro in micros)

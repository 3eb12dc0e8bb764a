"""Peak memory of one training step, predicted by walking the step's timeline.

The peak of a step is not the sum of each part's maximum: parameters gathered for one operator
are freed before the next is gathered, activations pile up in forward and drain in backward,
gradients appear in backward and stay until the optimizer step. This module replays one
steady-state step (optimizer state already allocated, gradients set to None by the previous
``zero_grad``) over a profiled, normalised graph (``profile_graph_pass``) under a plan, and
reports the largest live total.

Time points: forward of node ``i`` is ``t = i``; backward of node ``i`` is ``t = 2N - 1 - i``
(reverse order), and a reduce-scatter that follows it ``t + 0.5``; the second stage of a
two-stage (hierarchical) gather before a forward or backward at ``t`` is ``t - 0.25``; the
end-of-backward gradient all-reduce is ``t = 2N``; the optimizer step is ``t = 2N + 1``. At each point allocations happen first (the peak is read), then frees.

What is alive, per rank (N ranks, R per node, P bytes of a parameter, Pp = N * ceil(numel / N)
elements padded; for hybrid_shard read R for N throughout):

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
  reduce-scatter ``reduce_scatters_in_flight`` later starts (those starting at one time point
  in the order autograd runs their all-gathers' backward: the one issued last first; a
  recomputed region's all-gathers, issued before it, after the region's backward unless read
  through ``grad_ready``), or at the end of backward; the Pp/N
  shard gradient from the start of the reduce-scatter to the end (``hierarchical``: its first,
  intra-node stage also holds a Pp / R block until the reduce-scatter completes);
* gradient all-reduce: flat buckets of the replicated gradients (``GradReducer``'s buckets), each
  from when its last gradient is ready until the bucket ``reduce_scatters_in_flight`` later
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

from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import fx

from ..core.buckets import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_PREFETCH,
    MAX_IN_FLIGHT,
    SMALL_PARAM_BYTES,
)
from ..core.layout import shard_count
from ..core.node_meta import NodeRole, osdp_meta
from ..core.strategies import traits
from .envelope import BATCH  # noqa: F401  (BATCH re-exported)
from .envelope import envelope as _envelope
from .graph_facts import (
    PREFETCH_BEFORE,
    SPLIT_BEFORE,
    ParamState,
    activation_grad_intervals,
    graph_facts,
    prefetched_regathers,
    regathered_together,
    sharded_gather_buckets,
)
from .live_bytes import (  # noqa: F401
    LOCAL,
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


def _step_timeline(
    gm: fx.GraphModule,
    params: Mapping[str, ParamState],
    *,
    world_size: int,
    ranks_per_node: int | None,
    optimizer: str,
    bucket_bytes: int,
    prefetch: int,
    reduce_scatters_in_flight: int,
    grad_accumulation: int,
    recompute: Mapping[str, str] | None,
    gather_bucket_bytes: int,
    seq_scale: Mapping[str, tuple[float, ...]] | None,
    scatter_copies_input: bool = False,
) -> tuple[Timeline, dict[Category, int], tuple[tuple[float, str], ...], list[fx.Node], int]:
    """The allocations of one step (:func:`predict_step_memory`'s arguments): the timeline, the
    bytes held throughout by category, the micro-batches as (time shift, which), the nodes and
    the optimizer step's time point."""
    facts = graph_facts(gm, {name: p.trainable for name, p in params.items()})
    if seq_scale:  # every reader of the profile (recompute.py too) sees the scaled bytes
        facts.profile = rescaled(facts.profile, seq_scale)
    nodes, pos, prof = facts.nodes, facts.pos, facts.profile
    n_nodes = len(nodes)
    requires_grad, members, savers = facts.requires_grad, facts.members, facts.savers
    param_of = facts.param_of
    users_of_root = {r: [u for m in ms for u in m.users] for r, ms in members.items()}

    def bwd(i: int) -> int:
        return 2 * n_nodes - 1 - i

    grad_sync, optim_t = 2 * n_nodes, 2 * n_nodes + 1
    acc = grad_accumulation > 1

    tl = Timeline()

    # Activations and what nodes save for backward; recomputed regions: cost_models/recompute.py
    spans = region_spans(facts, recompute or {})
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

    # Gradients of activations, summed out of place where several operators read a storage
    for start, end, nbytes in activation_grad_intervals(facts, bwd):
        tl.alive(start, end, nbytes, Category.ACTIVATION_GRADIENTS, scaled=True)

    # The step's inputs: held by the caller for the whole step.
    for n in nodes:
        if n.op == "placeholder":
            tl.alive(0, optim_t, prof[n].output_bytes, Category.INPUTS, scaled=True)

    # Parameters: gathered copies and gradients.
    base = {Category.PARAMETERS: constant_bytes(gm), Category.OPTIMIZER_STATE: 0}
    local_bytes: list[int] = []
    replicated_ready: dict[str, float] = {}  # when each replicated gradient is complete
    uses_of = {node: facts.param_uses(node) for node in param_of}
    sharded = [node for node in param_of if traits(params[param_of[node]].strategy).sharded
               and uses_of[node]]
    buckets = sharded_gather_buckets(facts, params, world_size, gather_bucket_bytes,
                                     {u: span.first for u, span in spans.items()})
    # a recomputed region reads its parameters from before its first to after its last operator
    at = {u: (spans[u].first, spans[u].last) if u in spans else (pos[u], pos[u]) for u in nodes}
    first_use = {n: min(at[u][0] for u in uses_of[n]) for n in sharded}
    # A bucket's all-gather is waited for (a bucket of several parameters is gathered into one
    # flat buffer and split into copies, both alive until the flat is freed) before the
    # prefetches it starts, which start before its first user runs: with prefetching a bucket
    # allocates at the first use of the bucket ``prefetch`` before it.
    by = [max(0, i - prefetch) for i in range(len(buckets))]
    split_at = [first_use[bucket[0]] - SPLIT_BEFORE for bucket in buckets]
    bucket_alloc = [split_at[i] if by[i] == i else first_use[buckets[by[i]][0]] - PREFETCH_BEFORE
                    for i in range(len(buckets))]
    bucket_of = {n: i for i, bucket in enumerate(buckets) for n in bucket}
    gather_at = {n: bucket_alloc[bucket_of[n]] if len(buckets[bucket_of[n]]) == 1
                 else split_at[bucket_of[n]] for n in sharded}
    # per bucket: (gradient from, done, its bytes, bytes reduced, shard bytes, staged block)
    bucket_grads: dict[int, list[tuple[float, float, int, int, int, int]]] = defaultdict(list)
    # saved by operators outside recomputed regions (a region's parameters are re-gathered
    # when it is recomputed, and prefetching passes them by)
    saved_outside = {node: [j for j in savers.get(node, []) if j not in spans] for node in sharded}
    regather_at = prefetched_regathers(
        [node for node in sharded if traits(params[param_of[node]].strategy).freed_after_forward
         and saved_outside[node]], saved_outside, pos, bwd, prefetch,
        regathered_together(facts, params, buckets, world_size, gather_bucket_bytes),
        {n: gathered_param_bytes(params[param_of[n]].numel, world_size=world_size,
                                 element_size=params[param_of[n]].compute_size) for n in sharded})
    def scattered_when_ready(node: fx.Node) -> bool:
        """Whether a sharded parameter's reduce-scatter starts when its gradient is complete.
        Not when a recomputed region reads it through an all-gather that runs before the region
        (a bucket's, or read outside the region too): then after the region's backward
        ([Note: reduce-scatter in recomputed regions] in ``passes/recompute.py``)."""
        regions = {spans[u].name if u in spans else None for u in uses_of[node]}
        if regions == {None}:
            return True
        outside = [m for m in members[node] if m not in spans]
        casts = [m for m in outside if osdp_meta(m).role == NodeRole.CAST]
        return (len(regions) == 1 and None not in regions and len(buckets[bucket_of[node]]) == 1
                and set(outside) <= {node, *casts}
                and all(set(m.users) <= spans.keys() for m in casts)
                and set(node.users) <= (set(casts) if casts else spans.keys()))

    # (launch time, since, bytes held from then until it completes, staged block from launch)
    scatters: list[tuple[float, float, int, int]] = []
    scatter_bucket: list[int] = []  # the gather bucket of each
    nodes_in_mesh = world_size // (ranks_per_node or world_size)
    for node, name in param_of.items():
        state = params[name]
        full = state.numel * state.element_size
        chunks = shard_count(state.strategy, world_size, ranks_per_node)
        padded = gathered_param_bytes(state.numel, element_size=state.element_size,
                                      world_size=chunks)
        gathered = padded // state.element_size * state.compute_size
        local_numel = shard_numel(state.numel, chunks)
        t = traits(state.strategy)
        local = padded // chunks if t.sharded else full
        # hierarchical: the block of the first stage (1/R of the buffer) while the second runs
        staged = (len(t.gather_stages) > 1 and ranks_per_node is not None
                  and 1 < ranks_per_node and nodes_in_mesh > 1)
        block = gathered // ranks_per_node if staged and ranks_per_node else 0
        base[Category.PARAMETERS] += local
        if state.trainable:
            base[Category.OPTIMIZER_STATE] += optimizer_state_bytes(local_numel, optimizer=optimizer)
            local_bytes.append(local)
        uses = uses_of[node]
        if not uses:
            continue
        last = max(at[u][1] for u in uses)
        redo = {spans[u].name: spans[u] for u in uses if u in spans}
        saved_by = [j for j in savers.get(node, []) if j not in spans]
        kept_until = max([bwd(pos[j]) for j in saved_by] + [bwd(r.first) for r in redo.values()]
                         + [last])
        if t.freed_after_forward:
            for r in redo.values():  # re-gathered once to recompute, until its first backward
                done = [bwd(pos[j]) for j in savers.get(node, []) if spans.get(j) is r]
                tl.alive(r.recompute_at(bwd), max(done, default=r.recompute_at(bwd)), gathered,
                         Category.GATHERED, scaled=False)
            # A two-stage gather's second stage runs (allocating the buffer) a quarter step
            # before the use, when it is waited for; its first stage's block is alive from its
            # start.
            wait = min(pos[u] for u in uses) - 0.25 if block else gather_at[node]
            tl.alive(min(gather_at[node], wait), wait, block, Category.COMMUNICATION, scaled=False)
            tl.alive(wait, last, gathered, Category.GATHERED, scaled=False)
            for j in saved_by:  # re-gathered alone, or with its bucket (split at its first unpack)
                r = regather_at.get((node, j))
                start, split = (r.start, r.split) if r else (bwd(pos[j]), bwd(pos[j]))
                wait = bwd(pos[j]) - 0.25 if block else split
                tl.alive(min(start, wait), wait, block, Category.COMMUNICATION, scaled=False)
                tl.alive(wait, bwd(pos[j]), gathered, Category.GATHERED, scaled=False)
                if r and r.flat_bytes:
                    tl.alive(start, split, r.flat_bytes, Category.COMMUNICATION, scaled=False)
                    if start < split:  # prefetched: its send buffer until it is waited for
                        tl.alive(start, split, r.flat_bytes // chunks, Category.COMMUNICATION,
                                 scaled=False)
        elif t.keeps_gathered:
            tl.alive(gather_at[node], kept_until, gathered, Category.GATHERED, scaled=False)
        elif state.compute_size != state.element_size:  # replicate: the cast copy
            tl.alive(min(pos[u] for u in uses), kept_until, state.numel * state.compute_size,
                     Category.GATHERED, scaled=False)
        if not state.trainable:
            continue
        grad_uses = [u for u in uses if requires_grad[u]]
        if not grad_uses:
            continue
        grad_start, grad_done = bwd(max(pos[u] for u in grad_uses)), bwd(min(pos[u] for u in grad_uses))
        if t.sharded and not scattered_when_ready(node):  # after its regions' backward
            grad_done = bwd(min(at[u][0] for u in grad_uses))
        # A parameter read by several operators (tied weights) gets its gradient summed out of
        # place (autograd's input buffer): the backward of every use but the first to run
        # allocates its contribution and the sum while the gradient so far is alive.
        grad_bytes = state.numel * state.compute_size if t.sharded else full
        for u in grad_uses:
            if bwd(pos[u]) != grad_start:
                tl.alive(bwd(pos[u]), bwd(pos[u]), 2 * grad_bytes, Category.GRADIENTS,
                         scaled=False)
        if not t.sharded:  # accumulated by earlier micro-batches: alive from the start, and
            # this backward's gradient is a new tensor until autograd adds it to ``.grad``
            for micro, since in ((SYNC, 0 if acc else grad_start),
                                 (LOCAL, 0 if grad_accumulation > 2 else grad_start)):
                tl.alive(since, optim_t, full, Category.GRADIENTS, scaled=False, only=micro)
                if since == 0:
                    tl.alive(grad_start, grad_done, full, Category.GRADIENTS, scaled=False,
                             only=micro)
            replicated_ready[name] = grad_done + 0.5
        else:
            held = padded // state.element_size * state.reduce_size
            bucket_grads[bucket_of[node]].append((
                grad_start, grad_done, state.numel * state.compute_size, held,
                padded // chunks, held // ranks_per_node if staged and ranks_per_node else 0))
    for i, bucket in enumerate(buckets):
        if len(bucket) > 1:  # the flat buffer of the gather, until it is split
            state = params[param_of[bucket[0]]]
            chunks = shard_count(state.strategy, world_size, ranks_per_node)
            flat = sum(gathered_param_bytes(params[param_of[n]].numel,
                                            element_size=params[param_of[n]].compute_size,
                                            world_size=chunks) for n in bucket)
            tl.alive(bucket_alloc[i], split_at[i], flat, Category.COMMUNICATION, scaled=False)
            if by[i] != i:  # prefetched: its send buffer until it is waited for
                tl.alive(bucket_alloc[i], split_at[i], flat // chunks, Category.COMMUNICATION,
                         scaled=False)
        grads = bucket_grads.get(i)
        if not grads:
            continue
        # The reduce-scatter starts after the backward of the bucket's last gradient has
        # released what it unpacked (half a step later) and holds the gradient (its padded copy
        # in the reduce dtype; a bucket's flat concatenation) until it completes.
        scatter = max(g[1] for g in grads) + 0.5
        held, held_block = sum(g[3] for g in grads), sum(g[5] for g in grads)
        if len(grads) == 1 and len(bucket) == 1 and held == grads[0][2]:
            scatters.append((scatter, grads[0][0], held, held_block))
            scatter_bucket.append(i)
        else:
            for start, _, grad, *_ in grads:
                tl.alive(start, scatter, grad, Category.GRADIENTS, scaled=False, only=SYNC)
            scatters.append((scatter, scatter, held, held_block))
            scatter_bucket.append(i)
        for *_, shard, _ in grads:
            tl.alive(scatter, optim_t, shard, Category.GRADIENTS, scaled=False, only=SYNC)
        # Accumulating: the synchronised backward adds into the held buffer and reduce-scatters
        # it; a no_sync backward adds its gradients into it (the first allocates it).
        if acc:
            tl.alive(0, scatter - 0.125, held, Category.GRADIENTS, scaled=False, only=SYNC)
            tl.alive(0 if grad_accumulation > 2 else scatter, grad_sync, held,
                     Category.GRADIENTS, scaled=False, only=LOCAL)
            for start, _, grad, *_ in grads:
                tl.alive(start, scatter, grad, Category.GRADIENTS, scaled=False, only=LOCAL)
    # At most ``reduce_scatters_in_flight`` run at once: starting one more completes the oldest;
    # the rest complete at the end of backward.
    # Those launched at one time point start in the order autograd runs their all-gathers'
    # backward: the all-gather issued last first.
    scatters = [scatters[k] for k in sorted(range(len(scatters)),
                                            key=lambda k: (scatters[k][0], -scatter_bucket[k]))]
    for i, (launch, since, held, held_block) in enumerate(scatters):
        later = i + reduce_scatters_in_flight
        # completed (and its buffer freed) before the later one starts
        done = scatters[later][0] - 0.0625 if later < len(scatters) else grad_sync
        if since < launch:  # the gradient itself, handed to the reduce-scatter at its launch
            # (gloo: copied then, so both are alive at the launch)
            tl.alive(since, launch - (0 if scatter_copies_input else 0.125), held,
                     Category.GRADIENTS, scaled=False, only=SYNC)
        tl.alive(launch, done, held, Category.COMMUNICATION, scaled=False, only=SYNC)
        tl.alive(launch, done, held_block, Category.COMMUNICATION, scaled=False, only=SYNC)

    if world_size > 1:
        replicated_buckets(tl, params, replicated_ready, bucket_bytes=bucket_bytes,
                            in_flight=reduce_scatters_in_flight, end=grad_sync)
    if OPTIMIZER_STATES[optimizer] == 2 and local_bytes:
        largest, second = ([*sorted(local_bytes, reverse=True), 0])[:2]
        tl.alive(optim_t, optim_t, 2 * largest + second, Category.OPTIMIZER_TEMPORARIES,
                 scaled=False, only=SYNC)

    # Accumulating, a no_sync micro-batch comes first on the timeline (shifted before t = 0).
    micros = ((-(optim_t + 1), LOCAL), (0, SYNC)) if acc else ((0, SYNC),)
    return tl, base, micros, nodes, optim_t


def predict_step_memory(
    gm: fx.GraphModule,
    params: Mapping[str, ParamState],
    *,
    world_size: int,
    ranks_per_node: int | None = None,
    optimizer: str = "adamw",
    profiled_batch: int = 1,
    batch_size: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    prefetch: int = DEFAULT_PREFETCH,
    reduce_scatters_in_flight: int = MAX_IN_FLIGHT,
    grad_accumulation: int = 1,
    recompute: Mapping[str, str] | None = None,
    gather_bucket_bytes: int = SMALL_PARAM_BYTES,
    seq_scale: Mapping[str, tuple[float, ...]] | None = None,
    scatter_copies_input: bool = False,
) -> MemoryPrediction:
    """Predict the peak memory of one training step of ``gm`` under the given strategies.

    ``gm`` is the normalised graph (parameters as ``get_attr`` nodes whose ``osdp_meta.param``
    names the group), profiled by ``profile_graph_pass`` at ``profiled_batch``; ``params`` maps
    each parameter group to its size and strategy; ``batch_size`` scales activations;
    ``ranks_per_node`` (None: one node) sizes hybrid_shard's shards and hierarchical's stages.
    ``grad_accumulation`` k > 1: a step is k micro-batches, the first k - 1 run inside
    ``no_sync()`` (see "Gradient accumulation" in the module docstring); the peak is that of
    the micro-batch that holds the most. ``recompute``: the regions recomputed, by policy;
    ``seq_scale``: activations at another sequence length (``shapes.py``);
    ``scatter_copies_input``: a reduce-scatter copies a gradient it is handed at its launch
    (gloo, :func:`~osdp_fx.runtime.collectives.scatter_copies_input`).
    """
    tl, base, micros, nodes, optim_t = _step_timeline(
        gm, params, world_size=world_size, ranks_per_node=ranks_per_node, optimizer=optimizer,
        bucket_bytes=bucket_bytes, prefetch=prefetch,
        reduce_scatters_in_flight=reduce_scatters_in_flight,
        grad_accumulation=grad_accumulation, recompute=recompute,
        gather_bucket_bytes=gather_bucket_bytes, seq_scale=seq_scale,
        scatter_copies_input=scatter_copies_input)
    batch = batch_size or profiled_batch
    steady = [(t + shift, by) for shift, micro in micros for t, by in tl.sweep(base, micro)]
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
    lines = [(sum(sc for sc, _ in by.values()), sum(fx_ for _, fx_ in by.values()))
             for _, by in steady]
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


def predict_peak_bytes(gm: fx.GraphModule, params: Mapping[str, ParamState], *,
                       world_size: int, ranks_per_node: int | None = None,
                       optimizer: str = "adamw", profiled_batch: int = 1,
                       batch_size: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       prefetch: int = DEFAULT_PREFETCH,
                       reduce_scatters_in_flight: int = MAX_IN_FLIGHT,
                       grad_accumulation: int = 1, recompute: Mapping[str, str] | None = None,
                       gather_bucket_bytes: int = SMALL_PARAM_BYTES,
                       seq_scale: Mapping[str, tuple[float, ...]] | None = None,
                       scatter_copies_input: bool = False) -> int:
    """``predict_step_memory(...).peak_bytes`` (the same arguments) without the rest of the
    prediction: what the searches check a candidate plan with."""
    tl, base, micros, _, _ = _step_timeline(
        gm, params, world_size=world_size, ranks_per_node=ranks_per_node, optimizer=optimizer,
        bucket_bytes=bucket_bytes, prefetch=prefetch,
        reduce_scatters_in_flight=reduce_scatters_in_flight,
        grad_accumulation=grad_accumulation, recompute=recompute,
        gather_bucket_bytes=gather_bucket_bytes, seq_scale=seq_scale,
        scatter_copies_input=scatter_copies_input)
    batch = batch_size or profiled_batch
    return max(tl.peak(base, micro, batch, profiled_batch) for _, micro in micros)

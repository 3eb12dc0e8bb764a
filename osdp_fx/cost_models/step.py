"""Step cost model: time and memory of every strategy of every parameter group, and of a plan.

Per parameter group ``g`` with ``P`` bytes (``Pp`` padded to its number of shards: the world
size ``N``, or the ranks per node ``R`` for hybrid_shard) and strategy ``s``, on one rank:

* communication time ``comm_s(g, s)``: replicate: all-reduce of ``P`` (its latency shared with
  the other gradients of its all-reduce bucket: in the search, by its share of a full bucket of
  the schedule's size; for a plan, by its share of the bucket it is in) plus the reducer's
  passes over it (packing it into the bucket, averaging it and copying it back: 6 P bytes of
  memory traffic); shard_grad_op: all-gather and reduce-scatter of ``Pp``; full_shard: the
  same plus a second all-gather when backward re-gathers the parameter (some operator saved
  it); hybrid_shard and hierarchical: their
  collectives stage by stage (``plan.collective_stages``), each at the intra-node figures of
  ``Devices`` when it runs inside a node and at the inter-node figures when it crosses nodes;
  a sharded gradient reduced alone also pays its copy into the collective's buffer where the
  runtime makes one (:func:`scatter_input_copy_s`: gloo's in-place reduction, a padded or
  cast gradient); a part of a split weight also pays its share of assembling the weight's one
  gradient (:func:`split_gradient_s`: 4 bytes of memory traffic per byte of its local
  gradient);
* optimizer time ``optim_s(g, s)``: the measured per-tensor time plus the measured per-element
  time of the optimizer kind times the local numel (``detect_devices``); without measurements
  memory-bound, ``bytes_per_element(optimizer) * local numel / memory bandwidth``;
* host time ``host_s(g, s)``: what the runtime spends on the host per step for a group under
  ``s`` beyond its collectives and operators, measured (``Devices.param_host_time_s``, and
  ``Devices.bucket_host_time_s`` once per gather bucket; a sharded group's optimizer step at
  the per-tensor time measured over DTensors); [Note: the host lane];
* compute time (forward + backward of the operators that read the group; the same for every
  strategy, attributed to the largest group an operator reads, for display); a recomputed
  region adds the forward of the operators it recomputes (:mod:`.recompute`);
* search memory: ``persistent`` = local parameter + local gradient + local optimizer state (plus
  the gathered ``Pp`` for shard_grad_op, which is alive from forward to backward); ``transient``
  = ``2 Pp`` for full_shard, hybrid_shard and hierarchical (a re-gathered parameter and its full
  gradient in backward), ``Pp`` for shard_grad_op (the full gradient before its reduce-scatter).

A plan's predicted step time is total compute + the communication of every group + the
optimizer + the runtime's host time (``Devices.param_host_time_s`` per group; where the host
runs ahead of the device, a GPU, the longer of the host's and the device's lanes: [Note: the
host lane]) + what its blocking collectives wait for the ranks to arrive after a stretch of
computation ([Note: the wait after a stretch of computation] in :mod:`.overlap`) - the
collective time the computation hides (:mod:`.overlap`: the all-gathers its
prefetching starts early, and the gradient reduce-scatters and all-reduces backward runs
asynchronously, within the schedule's window of collectives in flight). The plan's schedule
(``buckets.Schedule``) sets the prefetch distance, which small parameters share a gather
bucket and the all-reduce bucket size that shares latency. Its peak memory comes from
:mod:`.timeline`. Both are also given as functions of the per-rank batch size ``b`` (compute
and activations scale with ``b``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import sympy
from torch import fx

from ..core.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from ..core.devices import Devices
from ..core.setting import StepSetting
from ..core.layout import shard_count, split_weights
from ..core.strategies import traits
from ..plan.plan import collective_stages
from .communication import all_reduce_parts_s, collective_time_s
from .graph_facts import (
    GraphFacts,
    ParamState,
    node_times,
    regathered_together,
    sharded_gather_buckets,
)
from .memory import gathered_param_bytes, optimizer_state_bytes, shard_numel
from .overlap import (
    TimedReduce,
    at_wait_ranks,
    hidden_comm_s,
    reduce_at_wait_s,
    reduce_s,
    reduced_bytes,
    sync_wait_s,
    timed_gathers,
)
from .recompute import recompute_time_s, recomputed_params, region_spans
from .timeline import BATCH

REDUCER_PASSES = 3
"""Passes the gradient reducer (``runtime/reducer.py``) makes over a replicated gradient's
bytes in a step, each reading and writing them: packing it into its all-reduce bucket,
dividing the sum by the world size, copying the average back."""

SPLIT_GRADIENT_PASSES = 4
"""Bytes of memory traffic per byte of a split weight's part's local gradient in a step beyond
what the weight unsplit moves (``runtime/sharded.py``'s ``SplitGrads``): the weight's gradient
is allocated zero-filled (one write) and every part's gradient is added into its view of it
(two reads and a write), where an unsplit parameter's gradient becomes ``.grad`` as it is."""

OPTIMIZER_BYTES_PER_ELEMENT = {"sgd": 12, "sgd_momentum": 20, "adam": 44, "adamw": 44}
"""Bytes one optimizer step moves per fp32 element: reads and writes of the parameter, gradient
and state, plus Adam's sqrt/div temporaries."""


@dataclasses.dataclass(frozen=True)
class GroupCost:
    """Predicted per-step costs of one parameter group under one strategy, on one rank."""

    strategy: str
    """The strategy these costs are for."""
    compute_s: float
    """Forward + backward time of the operators attributed to the group."""
    comm_s: float
    """Time of the group's collectives (the model credits no overlap with computation)."""
    comm_bytes: int
    """Bytes of the buffers the group's collectives move (sum over collectives)."""
    optim_s: float
    """Optimizer step time for this rank's part of the group."""
    persistent_bytes: int
    """Search memory held for the whole step (see module docstring)."""
    transient_bytes: int
    """Search memory held while the group's operators run."""
    host_s: float = 0.0
    """Host time the runtime spends on the group in a step beyond its collectives and
    operators (``Devices.param_host_time_s``; in a plan's prediction, also
    ``Devices.bucket_host_time_s`` where the group leads its gather bucket; [Note: the host
    lane])."""

    @property
    def strategy_s(self) -> float:
        """What the group's strategy costs in a step besides its computation: collectives,
        optimizer and the runtime's host time (the search's per-group time)."""
        return self.comm_s + self.optim_s + self.host_s


def optimizer_time_s(optimizer: str, numel: int, devices: Devices, *,
                     sharded: bool = False) -> float:
    """One optimizer step over one parameter tensor of ``numel`` elements: the measured
    per-tensor and per-element times of ``devices`` where known, else memory-bound
    (``OPTIMIZER_BYTES_PER_ELEMENT`` over the memory bandwidth); ``sharded``: the tensor is a
    sharded parameter (a DTensor), at the per-tensor time measured over those where known."""
    per_element = devices.optimizer_element_time_s.get(optimizer)
    if per_element is None:
        per_element = OPTIMIZER_BYTES_PER_ELEMENT[optimizer] / devices.memory_bandwidth_bytes_per_s
    per_tensor = devices.optimizer_tensor_time_s.get(optimizer, 0.0)
    if sharded:
        per_tensor = devices.optimizer_sharded_tensor_time_s.get(optimizer, per_tensor)
    return per_tensor + numel * per_element


def regathered_params(facts: GraphFacts) -> set[str]:
    """Groups some operator saves for backward, so full_shard re-gathers them."""
    return {name for node, name in facts.param_of.items() if facts.savers.get(node)}


def attributed_compute_s(facts: GraphFacts, devices: Devices) -> tuple[dict[str, float], float]:
    """(compute seconds per group, seconds of operators that read no parameter); derived once
    per facts and devices (``GraphFacts.derive``)."""
    per_group, other = facts.derive(_attributed_compute_s, devices)
    return dict(per_group), other


def _attributed_compute_s(facts: GraphFacts,
                          devices: Devices) -> tuple[dict[str, float], float]:
    per_group: dict[str, float] = {}
    sizes = {name: facts.profile[node].param_bytes for node, name in facts.param_of.items()}
    other = 0.0
    times = node_times(facts, devices)
    for n in facts.nodes:
        if times[n] is None:
            continue
        t = times[n].step_s
        groups = {facts.param_of[facts.root[a]] for a in n.all_input_nodes
                  if facts.root[a] in facts.param_of}
        if groups:
            owner = max(sorted(groups), key=lambda g: sizes[g])
            per_group[owner] = per_group.get(owner, 0.0) + t
        else:
            other += t
    return per_group, other


# [Note: cost caches]
# A search predicts hundreds of plans, and each prediction asks every parameter group's costs
# under its strategy: ``group_cost`` here, ``overlap.gather_s`` and ``timeline._param_sizes``.
# Each is a pure function of a frozen ``ParamState``, a ``Devices`` (frozen; hashed by its
# figures, ``Devices.__hash__``) and plain values, so its results are kept in a bounded
# ``functools.lru_cache`` for the process: the same arguments give the same figures, a new
# Devices or state simply misses. ``docs/architecture.md`` lists them with the other
# process-wide state.
@functools.lru_cache(maxsize=1 << 16)
def group_cost(
    state: ParamState, *, regathered: bool, compute_s: float, devices: Devices, optimizer: str,
    grad_accumulation: int = 1, reduce_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    among_sharded: bool = False, split_part: bool = False,
) -> GroupCost:
    """Costs of one group under ``state.strategy`` (see the module docstring; replicated
    gradients in all-reduce buckets of ``reduce_bucket_bytes``; ``split_part``: the group is
    a part of a split weight, :func:`split_gradient_s`); accumulating
    over ``grad_accumulation`` > 1 micro-batches with ``no_sync()``, a sharded group also holds
    its padded full gradient in the reduce dtype for the whole step. ``among_sharded``: the
    plan shards other groups, so a replicated one is a ``Replicate()`` DTensor too: the
    optimizer steps it at the per-tensor time over DTensors, and the runtime spends
    ``Devices.replica_host_time_s`` more on it ([Note: the host lane])."""
    world = devices.world_size
    full = state.numel * state.reduce_size  # the gradient, as reduced
    chunks = shard_count(state.strategy, world, devices.ranks_per_node)
    padded_numel = gathered_param_bytes(state.numel, element_size=1, world_size=chunks,
                                        row=state.row)
    padded = padded_numel * state.compute_size  # the gathered parameter
    local_numel = shard_numel(state.numel, chunks, state.row)
    local = local_numel * state.element_size
    forward, backward = collective_stages(
        state.strategy, state.numel, state.element_size, world_size=world,
        ranks_per_node=devices.ranks_per_node, regathered=regathered, trainable=state.trainable,
        gather_element_size=state.compute_size, reduce_element_size=state.reduce_size,
        row=state.row)
    stages = forward + backward
    comm_s = sum(collective_time_s(st.collective, st.nbytes, devices, group_size=st.ranks,
                                   spans_nodes=st.spans_nodes(devices.num_nodes))
                 for st in stages)
    t = traits(state.strategy)
    if t.sharded:
        comm_s += scatter_input_copy_s(state, devices)
    if not t.sharded and stages:
        # Replicated gradients share bucketed all-reduces: latency is paid per bucket, not per
        # parameter, so a parameter bears its byte share of it.
        per_byte, latency = all_reduce_parts_s(max(full, reduce_bucket_bytes), devices)
        comm_s = per_byte * full + latency * min(1.0, full / reduce_bucket_bytes)
        # the reducer packs the gradient into its bucket, divides the sum by the world size
        # in place and copies the average back: each a read and a write of P bytes
        comm_s += REDUCER_PASSES * 2 * full / devices.memory_bandwidth_bytes_per_s
    if split_part:
        comm_s += split_gradient_s(state, devices)
    persistent, transient, optim_s = local, 0, 0.0
    if state.trainable:
        persistent += local + optimizer_state_bytes(local_numel, optimizer=optimizer)
        optim_s = optimizer_time_s(optimizer, local_numel, devices,
                                   sharded=t.sharded or among_sharded)
        if t.sharded and grad_accumulation > 1:
            persistent += padded_numel * state.reduce_size
    if t.keeps_gathered:
        persistent += padded
        transient = padded
    elif t.freed_after_forward:
        transient = 2 * padded
    elif state.compute_size != state.element_size:  # mixed precision: the cast copy
        persistent += state.numel * state.compute_size
    return GroupCost(
        strategy=state.strategy, compute_s=compute_s, comm_s=comm_s,
        comm_bytes=sum(st.nbytes for st in stages), optim_s=optim_s,
        persistent_bytes=persistent, transient_bytes=transient,
        host_s=devices.param_host_time_s.get(state.strategy, 0.0) + (
            devices.replica_host_time_s if among_sharded and not t.sharded else 0.0),
    )


# [Note: the host lane]
# A compiled step runs on three lanes: the host (Python and the runtime: dispatching operators,
# the runtime's per-parameter work around its collectives, the optimizer's per-tensor
# dispatch), the device (the operators' kernels) and the link (the collectives). The host time
# the runtime spends per parameter group beyond its collectives' and operators' time is
# measured by ``detect_devices`` (``planner/host_probe.py``: ``Devices.param_host_time_s``, by
# strategy) and charged to the group (``GroupCost.host_s``), and so is what it spends per gather
# bucket (``Devices.bucket_host_time_s``: its collectives' launch and completion), once per
# bucket (its first member's); the optimizer's per-tensor time
# over sharded parameters (DTensors, stepped over their local tensors where [Note: local
# optimizer steps] applies) is measured apart (``optimizer_sharded_tensor_time_s``),
# and charged to a replicated group too where the plan shards others: the compiled module then
# hands it to the optimizer as a ``Replicate()`` DTensor (``runtime/sharded.py``), and what
# the runtime spends on such a group besides (the hook that makes its gradient a DTensor,
# [Note: a replicated parameter's local leaf]) is measured apart too
# (``Devices.replica_host_time_s``: the probe's replicated chain as such DTensors) and
# charged to it.
# Where the host is the device (the CPU: ``Devices.host_overlaps_device`` False), the lanes
# are one: every host second is a second of the step, and the step is compute + communication
# + optimizer + host. Where the host runs ahead of the device (a GPU), forward and backward
# end when the later of the two lanes does, the device lane (computation and the
# communication it waits for) or the host lane (the operators' dispatch, which the profiler
# times apart from their kernels on a GPU, [Note: timing a node on a GPU] in
# ``passes/profile_node.py``, and the runtime's host time), and the optimizer step follows
# both: max(compute + communication, dispatch + host) + optimizer. The lanes are summed over
# the step, not replayed operator by operator: a host lane that falls behind in forward and
# catches up in backward is credited as if it never stalled the device.
# The operators' dispatch is not counted in the host lane yet: the profile times each node's
# dispatch through its interpreter, which costs several times the compiled graph's direct
# call: on a GPU the lane with it predicted more than twice the measured step of
# ``benchmarks/gpu_check.py``'s GPT (``docs/benchmarks.md``, "On a GPU"), and the lanes
# without it came within its measured step. ``NodeProfile.host_time_s`` keeps the figure;
# ``predict_step_time`` passes no dispatch.


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Predicted time of one training step on one rank ([Note: the host lane])."""

    compute_s: float
    """Forward + backward of every operator."""
    comm_s: float
    """Collectives, and what they wait for the ranks to arrive (``sync_wait_s``), less the
    collective time the computation hides (``overlap``)."""
    optim_s: float
    """Optimizer step."""
    step_time_expr: sympy.Expr
    """Step time as a function of the per-rank batch size ``BATCH``."""
    host_s: float = 0.0
    """The runtime's host time (the groups' ``GroupCost.host_s``)."""
    dispatch_s: float = 0.0
    """The operators' dispatch on the host where it runs apart from their device time (a
    GPU's profile, ``NodeProfile.host_time_s``); 0 where the host computes."""
    host_overlaps_device: bool = False
    """Whether the host lane runs beside the device's (``Devices.host_overlaps_device``)."""
    sync_wait_s: float = 0.0
    """Of ``comm_s``, what the blocking collectives wait for the ranks to arrive beyond their
    price ([Note: the wait after a stretch of computation] in ``overlap.py``)."""

    @property
    def step_s(self) -> float:
        """The step at the profiled batch size."""
        return self.at_scale(1.0)

    def at_scale(self, batch_scale: float) -> float:
        """The step at ``batch_scale`` times the profiled batch size: the computation scales
        with the batch, communication, the optimizer step and the host time do not."""
        return lanes_s(self.compute_s * batch_scale, self.comm_s, self.optim_s, self.host_s,
                       dispatch_s=self.dispatch_s, host_overlaps_device=self.host_overlaps_device)


def lanes_s(compute_s: Any, comm_s: Any, optim_s: Any, host_s: Any, *, dispatch_s: Any = 0.0,
            host_overlaps_device: bool) -> Any:
    """A step's critical path through its lanes ([Note: the host lane]): numbers, or sympy
    expressions (the step as a function of the batch). One lane (the CPU): every second
    adds; the operators' dispatch is their compute there and is not counted again. Two: the
    device's (compute + communication) and the host's (dispatch + the runtime's host time) run
    side by side, and the optimizer step follows both."""
    if not host_overlaps_device:
        return compute_s + comm_s + optim_s + host_s
    device, host = compute_s + comm_s, dispatch_s + host_s
    if isinstance(device, sympy.Expr) or isinstance(host, sympy.Expr):
        return sympy.Max(device, host) + optim_s
    return max(device, host) + optim_s


def split_gradient_s(state: ParamState, devices: Devices) -> float:
    """What a part of a split weight costs in a step in assembling the weight's one gradient,
    at the device's measured copy bandwidth: ``SPLIT_GRADIENT_PASSES`` bytes per byte of its
    local gradient (its shard's for a sharded part). 0 for a frozen part."""
    if not state.trainable:
        return 0.0
    chunks = shard_count(state.strategy, devices.world_size, devices.ranks_per_node)
    local = shard_numel(state.numel, chunks, state.row) * state.element_size
    return SPLIT_GRADIENT_PASSES * local / devices.memory_bandwidth_bytes_per_s


def bucket_copy_s(state: ParamState, devices: Devices, *, again: bool) -> float:
    """What a parameter gathered with others in one bucket spends in copies (each byte read
    and written, at the device's measured copy bandwidth): its shard concatenated into the
    bucket's send buffer and its full tensor split out of the gathered flat buffer, in forward
    and, when re-gathered (``again``), in backward; its gradient packed into the bucket's flat
    gradient and its reduced shard copied out."""
    world = devices.world_size
    chunks = shard_count(state.strategy, world, devices.ranks_per_node)
    gathered = gathered_param_bytes(state.numel, element_size=state.compute_size,
                                    world_size=chunks, row=state.row)
    moved = 2 * (gathered + gathered // chunks) * (2 if again else 1)
    if state.trainable:
        reduced = gathered // state.compute_size * state.reduce_size
        moved += 2 * (reduced + reduced // chunks)
    return moved / devices.memory_bandwidth_bytes_per_s


def scatter_input_copy_s(state: ParamState, devices: Devices) -> float:
    """What launching the reduce-scatter of a group's gradient alone copies: the full gradient
    into a buffer of the collective's own, each byte read and written at the device's measured
    copy bandwidth. gloo reduces in place (``Devices.reduce_scatter_copies_input``) and autograd's
    gradient may be read by another operator's backward (an addition hands both inputs the same
    tensor), so the runtime clones it; elsewhere it copies only to pad the gradient to whole
    rows per rank or to cast it to the reduce dtype (``GradReduceScatters.start`` in
    ``runtime/params.py``; under gradient accumulation the gradient is added into the held
    buffer instead, as many bytes or more). A member of a gather bucket of several is packed
    into the bucket's flat gradient instead (:func:`bucket_copy_s`). 0 for a frozen group and
    at world 1."""
    if not state.trainable or devices.world_size <= 1:
        return 0.0
    chunks = shard_count(state.strategy, devices.world_size, devices.ranks_per_node)
    padded_numel = gathered_param_bytes(state.numel, element_size=1, world_size=chunks,
                                        row=state.row)
    if not (devices.reduce_scatter_copies_input or padded_numel != state.numel
            or state.reduce_size != state.compute_size):
        return 0.0
    moved = state.numel * state.compute_size + padded_numel * state.reduce_size
    return moved / devices.memory_bandwidth_bytes_per_s


def bucket_latencies_s(strategy: str, devices: Devices, *, again: bool) -> tuple[float, float]:
    """The latencies a member of a gather bucket after its first saves by riding in the
    bucket's collectives under ``strategy``: (its all-gathers', re-gathered when ``again``;
    its gradient's reduce-scatter and, under hybrid_shard, all-reduce), stage by stage
    (``collective_stages``: a mesh strategy's bucket runs each of its stages once)."""
    forward, backward = collective_stages(strategy, 0, 1, world_size=devices.world_size,
                                          ranks_per_node=devices.ranks_per_node,
                                          regathered=again)

    def latency_s(stages: list[Any]) -> float:
        return sum(collective_time_s(st.collective, 0, devices, group_size=st.ranks,
                                     spans_nodes=st.spans_nodes(devices.num_nodes))
                   for st in stages)

    return (latency_s(forward + [st for st in backward if st.collective == "all_gather"]),
            latency_s([st for st in backward if st.collective != "all_gather"]))


def _gradients_ready(facts: GraphFacts, _: None) -> dict[str, int]:
    """Per parameter group, the step of the backward lane (``t``-th backward: the node at
    position ``N - 1 - t``) after which its gradient is complete: the backward of its first
    use in graph order (``GraphFacts.derive``: found once per facts)."""
    last = len(facts.nodes) - 1
    ready: dict[str, int] = {}
    for node, name in facts.param_of.items():
        uses = facts.param_uses(node)
        if uses:
            ready[name] = max(ready.get(name, 0), last - min(facts.pos[u] for u in uses))
    return ready


def predict_step_time(
    gm: fx.GraphModule,
    params: Mapping[str, ParamState],
    facts: GraphFacts,
    *,
    setting: StepSetting,
    profiled_batch: int,
    recompute: Mapping[str, str] | None = None,
) -> tuple[StepTime, dict[str, GroupCost]]:
    """Step time of ``gm`` under the strategies in ``params``, on ``setting``'s devices with its
    optimizer and schedule, at the profiled batch (``StepTime.at_scale`` scales it), and each
    group's costs (without the overlap credit, which belongs to the step); the regions
    ``recompute`` names run their recomputed operators' forward once more in backward and
    re-gather every sharded parameter they read."""
    devices, schedule = setting.devices, setting.schedule
    per_group, other_s = attributed_compute_s(facts, devices)
    spans = region_spans(facts, recompute or {})
    other_s += recompute_time_s(facts, spans, devices)
    regathered = regathered_params(facts) | recomputed_params(facts, spans)
    # Replicated gradients: each all-reduce bucket pays one latency, shared by its members.
    backward_order = [n for n, st in list(params.items())[::-1]
                      if not traits(st.strategy).sharded and st.trainable]
    filled = {}
    ready = facts.derive(_gradients_ready, None)
    reduces = []  # the gradient collectives backward runs, replayed by ``overlap``
    for bucket in plan_buckets([(params[n].element_size, params[n].numel * params[n].element_size)
                                for n in backward_order], schedule.reduce_bucket_bytes):
        members = [backward_order[i] for i in bucket]
        nbytes = sum(params[m].numel * params[m].reduce_size for m in members)
        filled.update(dict.fromkeys(members, nbytes))
        if devices.world_size > 1:
            per_byte, latency = all_reduce_parts_s(nbytes, devices)
            reduces.append(TimedReduce(max(ready.get(m, 0) for m in members),
                                       per_byte * nbytes + latency, "all_reduce",
                                       ratio=devices.concurrent_ratio(nbytes)))
    among_sharded = devices.world_size > 1 and any(traits(st.strategy).sharded
                                                   for st in params.values())
    parts = split_weights(tuple(params))
    costs = {
        name: group_cost(state, regathered=name in regathered, compute_s=per_group.get(name, 0.0),
                         devices=devices, optimizer=setting.optimizer,
                         reduce_bucket_bytes=filled.get(name, schedule.reduce_bucket_bytes),
                         among_sharded=among_sharded, split_part=name in parts)
        for name, state in params.items()
    }
    # A bucket pays each collective's latency once: its members after the first ride in the
    # first one's all-gather and re-gather in backward, its trainable members after the first
    # in the first one's reduce-scatter. Its host time is charged to its first member (not in
    # ``group_cost``: the exact search bounds a step below by the groups' own costs).
    buckets = sharded_gather_buckets(facts, params, devices.world_size,
                                     schedule.gather_bucket_bytes)
    together = {n for b in regathered_together(facts, params, buckets, devices.world_size,
                                               schedule.gather_bucket_bytes) for n in b}
    for bucket in buckets:
        scattered = False  # a trainable member before this one
        scatter_s, scatter_ready, scatter_later_s, scatter_bytes = 0.0, 0, 0.0, 0
        for k, node in enumerate(bucket):
            name = facts.param_of[node]
            again = (node in together and name in regathered
                     and traits(params[name].strategy).freed_after_forward)
            gathers_s, reduces_s = bucket_latencies_s(params[name].strategy, devices,
                                                      again=again)
            saved = gathers_s if k else 0.0
            if params[name].trainable:
                saved += reduces_s if scattered else 0.0
                scatter_s += reduce_s(params[name], devices) - (reduces_s if scattered else 0.0)
                scatter_later_s += reduce_at_wait_s(params[name], devices) - (
                    reduce_at_wait_s(dataclasses.replace(params[name], numel=0), devices)
                    if scattered else 0.0)
                scatter_ready = max(scatter_ready, ready.get(name, 0))
                scatter_bytes += reduced_bytes(params[name])
                scattered = True
            if len(bucket) > 1:  # its members pass through the bucket's flat buffers on the
                saved -= bucket_copy_s(params[name], devices, again=again)  # device (copies)
                saved += scatter_input_copy_s(params[name], devices)  # packed, not copied
            strategy = params[name].strategy
            bucket_host = 0.0 if k else devices.bucket_host_time_s.get(strategy, 0.0)
            costs[name] = dataclasses.replace(costs[name],
                                              comm_s=max(0.0, costs[name].comm_s - saved),
                                              host_s=costs[name].host_s + bucket_host)
        if scattered:
            scatter_s = max(0.0, scatter_s)
            first = params[facts.param_of[bucket[0]]]
            reduces.append(TimedReduce(scatter_ready, scatter_s, "reduce_scatter",
                                       min(scatter_s, max(0.0, scatter_later_s)),
                                       at_wait_ranks(first, devices)[1],
                                       devices.concurrent_ratio(scatter_bytes)))
    compute_s = other_s + sum(per_group.values())
    optim_s = sum(c.optim_s for c in costs.values())
    forward, backward = (timed_gathers(facts, params, devices, prefetch=schedule.prefetch,
                                       gather_bucket_bytes=schedule.gather_bucket_bytes,
                                       regathered=regathered)
                         if devices.world_size > 1 else ([], []))
    waits_s = sync_wait_s(facts, devices, forward=forward, backward=backward, reduces=reduces,
                          between_steps_s=optim_s, in_flight=schedule.scatters_in_flight)
    # without prefetching every gather starts at its use and hides nothing
    prefetched = ((forward, backward) if schedule.prefetch > 0 else ([], []))
    comm_s = sum(c.comm_s for c in costs.values()) + waits_s - hidden_comm_s(
        facts, devices, forward=prefetched[0], backward=prefetched[1], reduces=reduces,
        in_flight=schedule.scatters_in_flight)
    host_s = sum(c.host_s for c in costs.values())
    dispatch_s = 0.0  # the profile's per-node dispatch overcounts ([Note: the host lane])
    overlaps = devices.host_overlaps_device
    expr = lanes_s(sympy.Float(compute_s) * BATCH / profiled_batch, sympy.Float(comm_s),
                   sympy.Float(optim_s), sympy.Float(host_s), dispatch_s=sympy.Float(dispatch_s),
                   host_overlaps_device=overlaps)
    return StepTime(compute_s, comm_s, optim_s, expr, host_s, dispatch_s, overlaps,
                    waits_s), costs

"""What activation recomputation changes in a step: activation lifetimes, the recomputed
forward's time, and each region option's memory for the search.

A recomputed region ``R`` (operators at positions ``first .. last``, policy ``selective`` or
``full``, [Note: recompute policies]) changes the timeline (:mod:`.timeline`) this way:

* a tensor an operator of ``R`` saves is alive, in forward, only until its last forward use,
  unless ``R`` keeps it (``selective``: outputs of ``regions.SELECTIVE_SAVED_OPS``, kept until
  their savers' backward and at least until the recomputation); the recomputation re-creates it
  at ``t_re = bwd(last) - 0.375`` (just before the region's backward) and it is freed at the
  backward of its earliest saver in ``R``: category "recomputed activations";
* the region's inputs are saved by checkpoint: alive until ``bwd(first)``;
* the recomputation's own intermediates (outputs no operator of ``R`` saves): the largest of
  them at ``t_re``;
* sharded parameters the region reads are gathered before the region and freed after it (the
  forward span of the region); a freed one is re-gathered once at ``t_re`` until the backward of
  its earliest saver in ``R`` (at ``t_re`` alone when nothing saves it, e.g. a bias).

The time model charges the forward time of every recomputed operator once more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from torch import fx

from ..core.regions import Recompute, kept_by_selective
from ..plan.plan import RegionPrediction
from .compute import CALL_OPS, node_compute_time_s
from .graph_facts import GraphFacts

Interval = tuple[float, float, int, bool]
"""(allocated at, freed after, bytes scaled with the batch, whether recomputed)."""


@dataclasses.dataclass(frozen=True)
class RegionSpan:
    """One recomputed region on the timeline."""

    name: str
    """Module path, e.g. 'model.blocks.3'."""
    policy: Recompute
    """selective or full."""
    first: int
    """Position of its first operator."""
    last: int
    """Position of its last operator."""
    kept: frozenset[fx.Node]
    """Operators whose outputs it keeps (selective)."""
    stop: int = -1
    """Position of the last recomputed operator that saves a tensor: the recomputation stops
    there (checkpoint's early stop), so a kept output after it is never taken back out of
    selective checkpointing's cache and lives until the region's backward ends."""

    def recompute_at(self, bwd: Callable[[int], float]) -> float:
        """When backward re-creates what the region dropped."""
        return bwd(self.last) - 0.375


@dataclasses.dataclass(frozen=True)
class RegionCost:
    """What one policy of one region costs: the search's option for it."""

    policy: str
    """save, selective or full."""
    recompute_s: float
    """Forward time of the recomputed operators (at the profiled batch)."""
    kept_bytes: int
    """Activation bytes the region's operators keep from forward to backward."""
    recomputed_bytes: int
    """Activation bytes the recomputation re-creates, alive during the region's backward."""
    recomputed_ops: tuple[str, ...]
    """Operators (node names) whose saved tensors are recomputed."""


def region_spans(facts: GraphFacts, recompute: Mapping[str, str],
                 regions: Mapping[str, list[fx.Node]] | None = None) -> dict[fx.Node, RegionSpan]:
    """Each operator of a recomputed region (of ``regions``, default ``facts.regions``), mapped
    to its region's span."""
    out: dict[fx.Node, RegionSpan] = {}
    if not recompute:
        return out
    if regions is None:
        regions = facts.regions
    for name, ops in regions.items():
        if name not in recompute:
            continue
        policy = Recompute(recompute.get(name, Recompute.SAVE))
        if policy == Recompute.SAVE:
            continue
        kept = frozenset(n for n in ops if policy == Recompute.SELECTIVE and kept_by_selective(n))
        stop = max((facts.pos[n] for n in ops
                    if n not in kept and facts.profile[n].saved_bytes > 0), default=-1)
        span = RegionSpan(name, policy, facts.pos[ops[0]], facts.pos[ops[-1]], kept, stop)
        out.update((n, span) for n in ops)
    return out


def root_intervals(r: fx.Node, facts: GraphFacts, spans: Mapping[fx.Node, RegionSpan],
                   bwd: Callable[[int], float], outputs_until: float) -> list[Interval]:
    """Lifetimes of the output of ``r`` (a storage root) under the recomputed ``spans``; the
    graph's outputs are alive until ``outputs_until`` (the caller holds them)."""
    pos = facts.pos
    users = [u for m in facts.members[r] for u in m.users]
    end = max((pos[u] if u.op != "output" else outputs_until for u in users), default=pos[r])
    own = spans.get(r)
    recomputed: dict[str, tuple[RegionSpan, float]] = {}
    for s in facts.savers.get(r, []):
        span = spans.get(s)
        if span is None or (span is own and r in own.kept):
            end = max(end, bwd(pos[s]))
        elif span is own:
            _, free = recomputed.get(span.name, (span, -1.0))
            recomputed[span.name] = (span, max(free, bwd(pos[s])))
        else:  # an input of the region: checkpoint keeps it
            end = max(end, bwd(span.first))
    for u in users:
        span = spans.get(u)
        if span is not None and span is not own:
            end = max(end, bwd(span.first))
    if own is not None and r in own.kept:  # until the recomputation takes it from the cache
        end = max(end, own.recompute_at(bwd) if pos[r] < own.stop else bwd(own.first))
    nbytes = facts.profile[r].output_bytes
    return [(pos[r], end, nbytes, False), *(
        (span.recompute_at(bwd), free, nbytes, True) for span, free in recomputed.values())]


def internal_interval(j: fx.Node, facts: GraphFacts, spans: Mapping[fx.Node, RegionSpan],
                      bwd: Callable[[int], float]) -> Interval:
    """Lifetime of what ``j`` saves that is neither an input nor an output of it."""
    p = facts.profile[j]
    internal = p.saved_bytes - p.saved_output_bytes - p.saved_input_bytes
    span = spans.get(j)
    if span is None or j in span.kept:
        return (facts.pos[j], bwd(facts.pos[j]), internal, False)
    return (span.recompute_at(bwd), bwd(facts.pos[j]), internal, True)


def recompute_workspace(spans: Mapping[fx.Node, RegionSpan], facts: GraphFacts,
                        bwd: Callable[[int], float]) -> list[Interval]:
    """The largest intermediate each recomputation creates and drops (no operator of the region
    saves it), at the recomputation."""
    largest: dict[str, tuple[RegionSpan, int]] = {}
    for n, span in spans.items():
        saved = any(spans.get(s) is span for s in facts.savers.get(facts.root[n], []))
        if n in span.kept or saved or facts.profile[n].output_is_view:
            continue
        size = facts.profile[n].output_bytes
        if size > largest.get(span.name, (span, 0))[1]:
            largest[span.name] = (span, size)
    return [(s.recompute_at(bwd), s.recompute_at(bwd), b, True) for s, b in largest.values()]


def recomputed_params(facts: GraphFacts, spans: Mapping[fx.Node, RegionSpan]) -> set[str]:
    """Parameter groups some recomputed region reads: backward re-gathers them to recompute."""
    return {name for node, name in facts.param_of.items()
            if any(u in spans for u in facts.param_uses(node))}


def recompute_time_s(facts: GraphFacts, spans: Mapping[fx.Node, RegionSpan], devices) -> float:
    """Forward time of the recomputed operators (at the profiled batch), plus, per operator of
    a recomputed region, what torch's checkpointing adds (``Devices.selective_op_time_s`` in a
    selective region, ``Devices.full_recompute_op_time_s`` in a full one; an operator of the
    graph is counted as one)."""
    per_op = {Recompute.SELECTIVE: devices.selective_op_time_s,
              Recompute.FULL: devices.full_recompute_op_time_s}
    return sum(per_op.get(span.policy, 0.0) for n, span in spans.items()
               if n.op in CALL_OPS) + sum(
        node_compute_time_s(facts.profile[n], devices).fwd_s
        for n, span in spans.items() if n not in span.kept)


def region_costs(facts: GraphFacts, devices,
                 only: Mapping[str, str] | None = None) -> dict[str, list[RegionCost]]:
    """Every region's options (those ``only`` names), ``save`` first: the search's table of
    recomputation."""
    n_nodes = len(facts.nodes)

    def bwd(i: int) -> float:
        return 2 * n_nodes - 1 - i

    boundary = n_nodes - 0.5  # between the last forward and the first backward
    out: dict[str, list[RegionCost]] = {}
    regions = facts.regions
    for name, ops in regions.items():
        if only is not None and name not in only:
            continue
        options = []
        for policy in Recompute:
            spans = region_spans(facts, {name: policy}, {name: ops})
            kept = recomputed = 0
            for n in ops:
                intervals = [internal_interval(n, facts, spans, bwd)]
                if facts.root[n] is n and not facts.profile[n].output_is_view:
                    intervals += root_intervals(n, facts, spans, bwd, 2 * n_nodes)
                for start, end, nbytes, again in intervals:
                    if again:
                        recomputed += nbytes
                    elif start < boundary < end:
                        kept += nbytes
            options.append(RegionCost(
                str(policy), recompute_time_s(facts, spans, devices), kept, recomputed,
                tuple(n.name for n in ops if n in spans and n not in spans[n].kept)))
        out[name] = options
    return out


def region_rows(facts: GraphFacts, devices, recompute: Mapping[str, str],
                scale: float = 1.0) -> tuple[RegionPrediction, ...]:
    """What each region ``recompute`` names saves and recomputes, for the plan (activation
    bytes and time at ``scale`` times the profiled batch)."""
    if not recompute:
        return ()
    costs = region_costs(facts, devices, only=recompute)
    rows = []
    for region, policy in recompute.items():
        cost = next(c for c in costs[region] if c.policy == policy)
        ops = [n.name for n in facts.regions[region]
               if n.op != "call_method" or facts.profile[n].output_bytes]
        rows.append(RegionPrediction(
            region, policy, tuple(n for n in ops if n not in cost.recomputed_ops
                                  and _saves(facts, n)),
            cost.recomputed_ops, int(cost.kept_bytes * scale), int(cost.recomputed_bytes * scale),
            cost.recompute_s * scale))
    return tuple(rows)


def _saves(facts: GraphFacts, name: str) -> bool:
    node = next(n for n in facts.nodes if n.name == name)
    return node in facts.savers.get(facts.root[node], [])

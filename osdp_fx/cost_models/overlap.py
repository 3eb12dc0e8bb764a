"""Overlap of collectives with computation: the time a schedule's prefetch and the runtime's
asynchronous gradient collectives save.

With prefetch distance ``d`` (``Schedule.prefetch``) the runtime starts each forward all-gather
(of one parameter, or of a bucket of small ones) right after the gather ``d`` places before it
has been waited for, and backward's re-gather of a freed parameter (of a bucket's saved
members together, in one all-gather, where they fit its size) when the one saved ``d`` places
after it in forward is unpacked (``runtime.params.StepContext``). In backward it
starts each gradient collective as soon as its gradients are complete (a gather bucket's
reduce-scatter after the backward of its members' first use; a replicated all-reduce bucket
once its last gradient is in), with at most ``Schedule.scatters_in_flight`` of a kind in flight
(starting one more first waits for the oldest), and waits for the rest at the end of backward
(``runtime.params.GradReduceScatters``, ``runtime.reducer.GradReducer``). This module replays
one step on two lanes: computation (each operator's forward, then each backward in reverse
order, at ``compute.node_compute_time_s``) and communication (the collectives in the order they
start, at ``communication.collective_time_s``; one started while another is in flight runs
beside it at the devices' measured ratio, [Note: collectives together]). An operator waits for
the gathers it uses; backward waits for a gradient collective when the window of those in
flight is full and at its end; a collective starts when it is issued. The
collective time the computation does not wait for is hidden; with ``d = 0`` every gather
starts at its use and hides nothing. A two-stage collective (``hierarchical``'s gathers and
reduce-scatters, ``hybrid_shard``'s reduce-scatter and all-reduce across nodes) starts its first
stage asynchronously and runs the others when it is waited for (``runtime/hierarchy.py``): only
the first can hide.

Only a share ``Devices.overlap_efficiency`` of that ideal is credited, and where a collective's
fixed cost does not hide (``Devices.overlap_hides_latency`` False: the CPU, whose gloo threads
wait for the cores the computation keeps busy) only of the share of the hidden collectives'
time beyond their latencies ([Note: overlap on the CPU] in ``planner/detect.py``). What
collectives in flight together save is credited whole: it shortens the link's own time, not
the computation's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

from torch import fx

from ..core.devices import SYNC_STRETCH_S, Devices
from ..core.layout import collective_stages
from ..core.strategies import traits
from .communication import collective_time_s
from .graph_facts import (
    GraphFacts,
    ParamState,
    node_times,
    regathered_together,
    sharded_gather_buckets,
)

@dataclasses.dataclass(frozen=True)
class GatherSeconds:
    """One group's all-gather seconds in a step (several stages added)."""

    forward_s: float
    backward_s: float
    """Backward's re-gather (0 where backward does not re-gather)."""
    forward_at_wait_s: float = 0.0
    """Of ``forward_s``, the stages after the first: run when the gather is waited for."""
    backward_at_wait_s: float = 0.0
    """Of ``backward_s``, the stages after the first."""

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclasses.dataclass(frozen=True)
class GatherWindow:
    """The computation one group's collectives may hide under (:func:`gather_windows`)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    reduce_s: float = 0.0
    """Backward's computation after the group's gradient is complete (its reduce-scatter's)."""

    def scaled(self, factor: float) -> GatherWindow:
        """The window at ``factor`` times the profiled batch (computation scales with it)."""
        return GatherWindow(self.forward_s * factor, self.backward_s * factor,
                            self.reduce_s * factor)


@dataclasses.dataclass(frozen=True)
class TimedGather:
    """One gather of a replayed lane (:func:`exposed_gather_s`)."""

    issued_at: int
    """The step of the lane it starts at (after the gathers used there were waited for)."""
    used_at: int
    """The step that waits for it."""
    seconds: float
    at_wait_s: float = 0.0
    """Of ``seconds``, the stages run when it is waited for (after the first)."""
    at_wait_ranks: int = 0
    """Ranks of the group its second stage runs over (0: one stage), which a prefetched
    gather starts at its wait ([Note: the wait after a stretch of computation])."""
    ratio: float = 1.0
    """The ratio it runs at when started beside collectives in flight, where the replay runs
    each at its own (``Devices.concurrent_ratio`` at its size; [Note: collectives
    together])."""


@dataclasses.dataclass(frozen=True)
class TimedReduce:
    """One gradient collective of a replayed backward (:func:`exposed_backward_s`)."""

    ready_at: int
    """The step of the backward lane after whose computation its gradients are complete."""
    seconds: float
    kind: str
    """``"reduce_scatter"`` or ``"all_reduce"``: each kind has its own window of collectives
    in flight, as the runtime keeps one per kind."""
    at_wait_s: float = 0.0
    """Of ``seconds``, the stages run when it is waited for (after the first)."""
    at_wait_ranks: int = 0
    """Ranks of the group its second stage runs over (0: one stage), started at its wait."""
    ratio: float = 1.0
    """As ``TimedGather.ratio``."""


# [Note: collectives together]
# The link runs collectives one after the other unless ``Devices.concurrent_collective_ratio``
# (r, measured by ``detect_devices``: two collectives started together take r of their time
# one after the other, 1/2 <= r <= 1) is below 1. Then a collective started at ``now`` while
# the link is busy until ``free`` runs beside what is in flight for o = min(free - now,
# seconds) of its time, and while two run together the link does their work in r of the time:
# it ends at free + seconds - 2 (1 - r) o. Two equal collectives started together end at r of
# their time one after the other; what every collective saves is at most 2 (1 - r) of its
# own seconds, the bound the exact search subtracts (``planner/exhaustive.py``, at
# ``Devices.least_concurrent_ratio``). On CPU gloo two collectives in flight together take
# about 0.8 of their time one after the other (``docs/benchmarks.md``, "Collectives
# together"), and a sharded step has a re-gather and gradient collectives in flight together
# in backward. Where the ratio changes with the size (``Devices.concurrent_collective_ratios``:
# on the CPU at world 2 gloo runs a small all-gather and reduce-scatter no faster together
# than one after the other, larger ones faster), each collective carries the ratio of its
# own size (``TimedGather.ratio``, ``TimedReduce.ratio``) and runs at it when it starts
# beside those in flight.


# [Note: the all-reduce runs alone]
# Inside a step, two reduce-scatters in flight together save about what the ratio says, but
# the replicated gradients' all-reduce beside the sharded gradients' reduce-scatters saves
# next to nothing, though the same pair started together outside a step runs at the ratio
# (`benchmarks/collectives_in_step.py` times both pairs in a step, each way; its runs are in
# docs/benchmarks.md, "Collectives in flight together inside a step"). So the replay runs the
# all-reduce after what is in flight, and what starts while it is in flight after it.


def _ends_s(now: float, free: float, seconds: float, ratio: float) -> float:
    """When a collective of ``seconds`` started at ``now`` ends on a link busy until ``free``
    ([Note: collectives together])."""
    if free <= now:
        return now + seconds
    return free + seconds - 2.0 * (1.0 - ratio) * min(free - now, seconds)


def exposed_gather_s(compute_s: Sequence[float], gathers: Sequence[TimedGather], *,
                     ratio: float | None = 1.0) -> float:
    """Seconds the computation waits for gathers, replaying ``compute_s`` (one duration per
    step, in order) with ``gathers`` in issue order. A gather issued at step ``s`` starts after
    the gathers used at ``s`` were waited for (a prefetch follows its anchor's gather); one used
    before it was issued starts at its use; one started while another is in flight runs beside
    it at ``ratio`` ([Note: collectives together]; None: each at its own,
    ``TimedGather.ratio``). Waiting for a gather runs its stages after the first
    (``TimedGather.at_wait_s``): the computation waits for all of them."""
    used, issued = defaultdict(list), defaultdict(list)
    for i, g in enumerate(gathers):
        used[g.used_at].append(i)
        issued[g.issued_at].append(i)
    done: dict[int, float] = {}
    now = link_free = waited = 0.0
    at = 0  # the step ``now`` is at: the computation of the steps before it is added
    for step in sorted(s for s in used.keys() | issued.keys() if s < len(compute_s)):
        # the steps without a gather in between, added one after the other as they run
        now = functools.reduce(operator.add, compute_s[at:step], now)
        at = step
        for group, wait in ((used[step], True), (issued[step], False)):
            for i in group:
                g = gathers[i]
                if i not in done:
                    link_free = done[i] = _ends_s(now, link_free, g.seconds - g.at_wait_s,
                                                  g.ratio if ratio is None else ratio)
                if wait:
                    end = max(now, done[i]) + g.at_wait_s
                    if end > now:
                        waited += end - now
                        now = end
                    if g.at_wait_s:
                        link_free = max(link_free, now)
    return waited


def exposed_backward_s(compute_s: Sequence[float], gathers: Sequence[TimedGather],
                       reduces: Sequence[TimedReduce], *, in_flight: int,
                       ratio: float | None = 1.0) -> float:
    """Seconds backward waits for its collectives, replaying ``compute_s`` (one duration per
    step of the backward lane, in order) with the re-gathers ``gathers`` (as
    :func:`exposed_gather_s`) and the gradient collectives ``reduces`` on one link: a gradient
    collective starts after the computation of its step (first waiting for the oldest of its
    kind when ``in_flight`` are in flight), beside those in flight at ``ratio`` ([Note:
    collectives together]; None: each at its own ``ratio``), and backward ends when every
    one has completed; waiting for a collective runs its stages after the first
    (``at_wait_s``). The replicated gradients'
    all-reduce runs after the collectives in flight, and those started while it is in flight
    after it ([Note: the all-reduce runs alone])."""
    used, issued, ready = defaultdict(list), defaultdict(list), defaultdict(list)
    for i, g in enumerate(gathers):
        used[g.used_at].append(i)
        issued[g.issued_at].append(i)
    last = len(compute_s) - 1
    for r in reduces:
        ready[min(max(r.ready_at, 0), last)].append(r)
    done: dict[int, float] = {}
    flight: dict[str, deque[tuple[float, float]]] = defaultdict(deque)
    now = link_free = waited = 0.0
    alone_until = 0.0  # the end of the last all-reduce: what starts before it runs after it

    def beside(t: float, own: float) -> float:
        """The ratio a collective of ratio ``own`` started at ``t`` runs at beside those in
        flight ([Note: the all-reduce runs alone])."""
        return 1.0 if t < alone_until else (own if ratio is None else ratio)

    def wait_until(t: float, then_s: float = 0.0) -> None:
        """Wait for a collective whose first stage ends at ``t``, then run ``then_s``."""
        nonlocal now, waited, link_free
        end = max(now, t) + then_s
        if end > now:
            waited += end - now
            now = end
        link_free = max(link_free, now) if then_s else link_free

    at = 0  # the step ``now`` is at: the computation of the steps before it is added
    for step in sorted(s for s in used.keys() | issued.keys() | ready.keys()
                       if 0 <= s < len(compute_s)):
        # the steps without a collective in between, added one after the other as they run
        now = functools.reduce(operator.add, compute_s[at:step], now)
        for group, wait in ((used[step], True), (issued[step], False)):
            for i in group:
                g = gathers[i]
                if i not in done:
                    link_free = done[i] = _ends_s(now, link_free, g.seconds - g.at_wait_s,
                                                  beside(now, g.ratio))
                if wait:
                    wait_until(done[i], g.at_wait_s)
        now += compute_s[step]
        at = step + 1
        for r in ready[step]:
            window = flight[r.kind]
            while len(window) >= in_flight:
                wait_until(*window.popleft())
            alone = r.kind == "all_reduce"
            link_free = _ends_s(now, link_free, r.seconds - r.at_wait_s,
                                1.0 if alone else beside(now, r.ratio))
            if alone:
                alone_until = link_free
            window.append((link_free, r.at_wait_s))
    now = functools.reduce(operator.add, compute_s[at:], now)
    for window in flight.values():
        for t, then_s in window:
            wait_until(t, then_s)
    return waited


def _stage_times_s(state: ParamState, devices: Devices, *,
                   regathered: bool) -> tuple[list[float], list[float], list[float]]:
    """Seconds of one group's collectives stage by stage, in the order they run: its
    forward all-gather's, backward's re-gather's, and its gradient's (``collective_stages``)."""
    fwd, bwd = collective_stages(
        state.strategy, state.numel, state.element_size, world_size=devices.world_size,
        ranks_per_node=devices.ranks_per_node, regathered=regathered, trainable=state.trainable,
        gather_element_size=state.compute_size, reduce_element_size=state.reduce_size,
        row=state.row)

    def times(stages: Sequence[Any]) -> list[float]:
        return [collective_time_s(st.collective, st.nbytes, devices, group_size=st.ranks,
                                  spans_nodes=st.spans_nodes(devices.num_nodes))
                for st in stages]

    return (times([st for st in fwd if st.collective == "all_gather"]),
            times([st for st in bwd if st.collective == "all_gather"]),
            times([st for st in bwd if st.collective != "all_gather"]))


def gathered_bytes(state: ParamState) -> int:
    """Bytes of one group's parameter gathered whole (in the dtype it is gathered in)."""
    return state.numel * state.compute_size


def reduced_bytes(state: ParamState) -> int:
    """Bytes of one group's gradient reduced whole (in the dtype it is reduced in)."""
    return state.numel * state.reduce_size


@functools.lru_cache(maxsize=1 << 16)  # [Note: cost caches]
def gather_s(state: ParamState, devices: Devices, *, regathered: bool) -> GatherSeconds:
    """Forward and backward all-gather seconds of one group (several stages added), and of
    each the stages after the first, which run when the gather is waited for."""
    fwd, bwd, _ = _stage_times_s(state, devices, regathered=regathered)
    return GatherSeconds(sum(fwd), sum(bwd), sum(fwd[1:]), sum(bwd[1:]))


@functools.lru_cache(maxsize=1 << 16)  # [Note: cost caches]
def reduce_at_wait_s(state: ParamState, devices: Devices) -> float:
    """Of :func:`reduce_s`, the stages after the first (``hybrid_shard``'s all-reduce across
    nodes, ``hierarchical``'s reduce-scatter across nodes): they run when the gradient's
    collective is waited for."""
    if not state.trainable:
        return 0.0
    return sum(_stage_times_s(state, devices, regathered=False)[2][1:])


@functools.lru_cache(maxsize=1 << 16)  # [Note: cost caches]
def at_wait_ranks(state: ParamState, devices: Devices) -> tuple[int, int]:
    """Ranks of the groups one group's gather and its gradient collective run their second
    stage over, started when each is waited for (``hierarchical``'s all-gather within the node
    and reduce-scatter across nodes, ``hybrid_shard``'s all-reduce across nodes); 0 for one of
    one stage."""
    fwd, bwd = collective_stages(state.strategy, state.numel, state.element_size,
                                 world_size=devices.world_size,
                                 ranks_per_node=devices.ranks_per_node)
    gathers = [st for st in fwd if st.collective == "all_gather"]
    reduces = [st for st in bwd if st.collective != "all_gather"]
    return (gathers[1].ranks if len(gathers) > 1 else 0,
            reduces[1].ranks if len(reduces) > 1 else 0)


def _lane_compute_s(facts: GraphFacts, devices: Devices) -> tuple[list[float], list[float]]:
    """The computation lane's steps: each operator's forward in graph order, and each one's
    backward in reverse order (derived once per facts and devices)."""
    times = node_times(facts, devices)
    fwd = [t.fwd_s if t else 0.0 for t in (times[n] for n in facts.nodes)]
    bwd = [t.bwd_s if t else 0.0 for t in (times[n] for n in reversed(facts.nodes))]
    return fwd, bwd


@functools.lru_cache(maxsize=1 << 16)  # [Note: cost caches]
def reduce_s(state: ParamState, devices: Devices) -> float:
    """Seconds of one group's gradient collectives (its reduce-scatter, and under hybrid_shard
    the all-reduce across nodes; several stages added); 0 for a frozen group."""
    if not state.trainable:
        return 0.0
    return sum(_stage_times_s(state, devices, regathered=False)[2])


def timed_gathers(facts: GraphFacts, params: Mapping[str, ParamState], devices: Devices, *,
                  prefetch: int, gather_bucket_bytes: int,
                  regathered: set[str]) -> tuple[list[TimedGather], list[TimedGather]]:
    """The gathers of one step as the runtime issues and waits for them with prefetch distance
    ``prefetch`` (0: each at its use): forward's, one per gather bucket, on the forward lane,
    and backward's re-gathers on the backward lane, in issue order: one per parameter, or one
    per bucket whose saved members backward re-gathers in one all-gather
    (:func:`~.graph_facts.regathered_together`, as the memory timeline and the runtime do)."""
    nodes, pos = facts.nodes, facts.pos
    gather = {node: gather_s(params[name], devices, regathered=name in regathered)
              for node, name in facts.param_of.items()}
    latency = collective_time_s("all_gather", 0, devices)
    # forward: bucket i starts after the gather of bucket i - d (at its first use)
    buckets = sharded_gather_buckets(facts, params, devices.world_size, gather_bucket_bytes)
    use = [min(pos[u] for u in facts.param_uses(b[0])) for b in buckets]
    seconds = [max(0.0, sum(gather[n].forward_s for n in b) - latency * (len(b) - 1))
               for b in buckets]
    # a bucket's later stages: its members' less the latencies its riders save there
    later = [max(0.0, sum(gather[n].forward_at_wait_s for n in b) - (len(b) - 1) * (
        gather_s(dataclasses.replace(params[facts.param_of[b[0]]], numel=0), devices,
                 regathered=False).forward_at_wait_s)) for b in buckets]

    def ratio(members: Sequence[fx.Node]) -> float:
        """The ratio the gather of ``members`` runs at beside collectives in flight."""
        return devices.concurrent_ratio(sum(gathered_bytes(params[facts.param_of[n]])
                                            for n in members))

    def stage_ranks(members: Sequence[fx.Node]) -> int:
        """The ranks of the second stage of the gather of ``members`` (one strategy)."""
        return at_wait_ranks(params[facts.param_of[members[0]]], devices)[0]

    forward = [TimedGather(use[i - prefetch] if i >= prefetch else use[i], use[i],
                           seconds[i], min(seconds[i], later[i]), stage_ranks(buckets[i]),
                           ratio(buckets[i]))
               for i in range(len(buckets))]
    # backward: re-gathered groups in the order forward saved them, a bucket's saved members
    # in one all-gather when the first of them is unpacked; unpacking the unit saved at index
    # j starts the re-gathers of those saved at j - d .. j - 1
    saved = sorted((n for n, name in facts.param_of.items()
                    if traits(params[name].strategy).freed_after_forward
                    and facts.savers.get(n) and gather[n].backward_s > 0),
                   key=lambda n: min(pos[j] for j in facts.savers[n]))
    together = {n: b for b in regathered_together(facts, params, buckets, devices.world_size,
                                                  gather_bucket_bytes) for n in b}
    units: list[list[fx.Node]] = []
    seen: set[fx.Node] = set()
    for n in saved:
        if n not in seen:
            unit = [m for m in saved if m in together[n]] if n in together else [n]
            seen.update(unit)
            units.append(unit)
    last = len(nodes) - 1
    unpack = [min(last - max(pos[j] for j in facts.savers[m]) for m in unit) for unit in units]
    backward = []
    for i, unit in enumerate(units):
        later = unpack[i + 1:i + 1 + prefetch]
        riders = len(unit) - 1  # ride in the first member's all-gather: its latency once
        at_wait_latency = gather_s(dataclasses.replace(params[facts.param_of[unit[0]]], numel=0),
                                   devices, regathered=True).backward_at_wait_s if riders else 0.0
        backward.append(TimedGather(
            min([unpack[i], *later]), unpack[i],
            max(0.0, sum(gather[m].backward_s for m in unit) - latency * riders),
            max(0.0, sum(gather[m].backward_at_wait_s for m in unit) - at_wait_latency * riders),
            stage_ranks(unit), ratio(unit)))
    backward.sort(key=lambda g: (g.issued_at, g.used_at))
    return forward, backward


def hidden_comm_s(facts: GraphFacts, devices: Devices, *, forward: Sequence[TimedGather],
                  backward: Sequence[TimedGather], reduces: Sequence[TimedReduce] = (),
                  in_flight: int = 1) -> float:
    """Seconds of collective time hidden under computation in one step (the forward gathers
    ``forward``, backward's re-gathers ``backward``, as :func:`timed_gathers` gives them under a
    schedule that prefetches, and the gradient collectives ``reduces``, at most ``in_flight``
    of a kind at once), credited at ``Devices.overlap_efficiency``, and the seconds
    collectives in flight together save ([Note: collectives together]), credited whole."""
    if devices.world_size <= 1:
        return 0.0
    fwd_compute, bwd_compute = facts.derive(_lane_compute_s, devices)
    if not (forward or backward or reduces):
        return 0.0
    total = sum(g.seconds for g in (*forward, *backward)) + sum(r.seconds for r in reduces)

    def exposed(ratio: float | None) -> float:
        return (exposed_gather_s(fwd_compute, forward, ratio=ratio)
                + exposed_backward_s(bwd_compute, backward, reduces, in_flight=in_flight,
                                     ratio=ratio))

    one_at_a_time = exposed(1.0)
    together = (one_at_a_time if devices.least_concurrent_ratio >= 1.0 else exposed(None))
    fixed = latency_s("all_gather", devices)
    beyond = (sum(max(0.0, g.seconds - fixed) for g in (*forward, *backward))
              + sum(max(0.0, r.seconds - latency_s(r.kind, devices)) for r in reduces))
    share = beyond / total if total > 0 else 0.0
    return (devices.overlap_efficiency * share * max(0.0, total - one_at_a_time)
            + max(0.0, one_at_a_time - together))


# [Note: the wait after a stretch of computation]
# Ranks that compute without synchronising drift apart: on the CPU, where every rank's
# process and gloo's threads share the cores, one rank falls behind another by milliseconds
# within a forward. A blocking collective then waits for the last rank to arrive: its time in
# a step is its price (the link figures, timed after a short matmul, as collectives follow one
# another in a sharded step) plus what the ranks drifted apart since they last synchronised.
# ``detect`` measures that wait after ``SYNC_STRETCH_S`` of computation (``Devices.
# sync_wait_s``: a small all-gather after that much matmul, against the matmul alone); after a
# stretch ``c`` the step model charges ``sqrt(c / SYNC_STRETCH_S)`` of it
# (``sync_wait_share``). Each rank's progress is its own sum of many small delays (a core taken by
# another process, a gloo thread, a page fault), so how far two ranks drift apart grows as a
# random walk does, with the square root of the time they compute apart, and keeps growing
# past ``SYNC_STRETCH_S``. How that curve follows the waits measured after stretches of other
# lengths: ``docs/cost-models.md``.
# The ranks synchronise where they wait for a collective: each gather's wait, and the end of
# backward, which waits for the gradients' collectives. What drifts is the computation
# between the last of those and the issue of the next collective, so a gather prefetched at
# another's wait is issued right after a synchronisation and waits for nothing more, while
# the first gather of forward (after the optimizer step and the forward before it), the
# first re-gather of backward, a gather of a plan that shards a few groups far apart, and the
# last gradient collective of backward (issued after the computation since the last wait)
# each pay their share. That holds where the ranks outnumber the cores: they take turns on
# the cores anyway, and prefetching one ahead saves about what this credits, measured inside
# steps. Where each rank's computation holds a core of its own, gloo's threads wait for that
# core until the computation blocks (or the kernel's tick preempts it), so a prefetched gather
# runs at its wait, after the ranks drifted apart since it was issued, and pays as one issued
# at its use (``Devices.prefetch_waits_for_ranks``, which ``detect`` sets on the CPU where the
# ranks do not outnumber the cores): timed inside steps there, prefetching one ahead saved
# next to nothing where this wait was most of its credit (``docs/benchmarks.md``, "Where a
# step's wall time goes"). A two-stage gather (``hierarchical``'s) starts its second stage at
# its wait (``runtime/hierarchy.py``): issued at its use, its first stage waits for the ranks
# of its group and the second for the rest, once for every rank in all; prefetched, its first
# stage runs after a synchronisation and its second, at the use, waits for the ranks of that
# stage's group, who drifted apart since. Drifting as independent random walks, ranks arrive
# spread as normal variables, and that stage waits for the last of its group's: it is charged
# ``group_wait_ratio`` of ``sync_wait_s`` (which is measured over all the ranks), the expected
# largest of its group's arrivals over the expected largest of all (0.55 for 2 ranks of 4).
# So does a two-stage gradient collective that backward waits for mid-way, to start another
# beyond ``Schedule.scatters_in_flight``: its second stage starts at that wait.
# A step's wait at its end follows a whole forward and backward under ``replicate`` and pays
# ``sync_wait_s`` whole; the same wait under ``full_shard`` follows its last re-gather. The share
# is charged at the profiled batch and does not scale with it.


def sync_stretches_s(fwd_compute_s: Sequence[float], bwd_compute_s: Sequence[float],
                     forward: Sequence[TimedGather], backward: Sequence[TimedGather],
                     reduces: Sequence[TimedReduce], *, between_steps_s: float,
                     prefetch_waits: bool = False, world_size: int = 1,
                     in_flight: int = 1) -> list[tuple[float, float]]:
    """For each collective of one step the ranks block on (the gathers ``forward`` on the
    forward lane ``fwd_compute_s`` and ``backward`` on the backward lane ``bwd_compute_s``, in
    the order they are issued, and the last of the gradient collectives ``reduces``, waited
    for at the end of backward), the computation between the ranks' last synchronisation and
    its issue, and the share of the ranks it waits for (:func:`group_wait_ratio`: 1 for all
    ``world_size`` of them; [Note: the wait after a stretch of computation]). Events at one
    position of a lane run as the replay runs them (:func:`exposed_gather_s`,
    :func:`exposed_backward_s`): the gathers used there, each issued first if it was not, then
    waited for; then those issued there; the gradient collectives ready after its computation,
    each first waiting for the oldest of its kind when ``in_flight`` are in flight. A gather
    issued before its use, or a gradient collective waited for in backward, whose later stages
    start at its wait (``at_wait_ranks``) issues its second stage there, over that stage's
    ranks. The ranks synchronise at each gather's wait and at the end of backward (not at a
    gradient collective's wait in backward: only its second stage's ranks meet there);
    ``between_steps_s`` separates one step's end from the next one's forward (the optimizer
    step). With ``prefetch_waits`` (``Devices.prefetch_waits_for_ranks``) a gather runs at its
    use wherever it was issued."""
    events: list[tuple[float, float | None]] = []  # (time, the share it waits; None: a sync)

    def second_stage(t: float, ranks: int) -> None:
        """A collective's second stage over ``ranks`` ranks, started at its wait at ``t``."""
        events.append((t, group_wait_ratio(ranks, world_size)))

    last = len(bwd_compute_s) - 1
    ready: dict[int, list[TimedReduce]] = defaultdict(list)
    for r in reduces:
        ready[min(max(r.ready_at, 0), last)].append(r)
    issue = max(ready, default=None)  # the last gradient collective's step
    windows: dict[str, deque[TimedReduce]] = defaultdict(deque)

    def lane(at: Sequence[float], gathers: Sequence[TimedGather], backward: bool) -> None:
        used, issued = defaultdict(list), defaultdict(list)
        for i, g in enumerate(gathers):
            used[g.used_at].append(i)
            issued[g.issued_at].append(i)
        started: set[int] = set()
        for step in sorted(used.keys() | issued.keys() | (ready.keys() if backward else set())):
            for i in used.get(step, ()):
                if i not in started:
                    started.add(i)
                    events.append((at[step], 1.0))
                elif gathers[i].at_wait_ranks:
                    second_stage(at[step], gathers[i].at_wait_ranks)
                events.append((at[step], None))
            for i in () if prefetch_waits else issued.get(step, ()):
                if i not in started:
                    started.add(i)
                    events.append((at[step], 1.0))
            for r in ready.get(step, ()) if backward else ():
                window = windows[r.kind]
                if len(window) >= in_flight and (oldest := window.popleft()).at_wait_ranks:
                    second_stage(at[step + 1], oldest.at_wait_ranks)
                window.append(r)
            if backward and step == issue:  # issued after its position's computation
                events.append((at[step + 1], 1.0))

    fwd_at = [0.0, *itertools.accumulate(fwd_compute_s)]
    bwd_at = [fwd_at[-1] + t for t in (0.0, *itertools.accumulate(bwd_compute_s))]
    lane(fwd_at, forward, False)
    lane(bwd_at, backward, True)
    if issue is not None:
        events.append((bwd_at[-1], None))
    syncs = [t for t, share in events if share is None]
    if not syncs:
        return []
    since = syncs[-1] - (bwd_at[-1] + between_steps_s)  # the last one, a step before
    stretches = []
    for t, share in events:
        if share is None:
            since = t
        else:
            stretches.append((max(0.0, t - since), share))
    return stretches


def sync_wait_share(stretch_s: float) -> float:
    """The share of ``Devices.sync_wait_s`` a blocking collective waits for the ranks beyond its
    price after ``stretch_s`` of computation since they last synchronised: the square root of
    its ratio to ``SYNC_STRETCH_S``, the stretch ``detect`` measures the wait after ([Note: the
    wait after a stretch of computation])."""
    return math.sqrt(max(stretch_s, 0.0) / SYNC_STRETCH_S)


@functools.lru_cache(maxsize=64)
def expected_max_normal(n: int) -> float:
    """The expected largest of ``n`` independent standard normal variables (0 for one),
    integrated numerically: ``n`` times the integral of ``x phi(x) Phi(x)^(n-1)``."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 4000, -12.0, 12.0
    h = (hi - lo) / steps
    total = 0.0
    for k in range(steps + 1):
        x = lo + k * h
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += (0.5 if k in (0, steps) else 1.0) * x * pdf * cdf ** (n - 1)
    return n * total * h


def group_wait_ratio(ranks: int, world_size: int) -> float:
    """How long a collective over ``ranks`` of the ranks waits for the last of them, against
    one over all ``world_size`` (``Devices.sync_wait_s`` is measured over all): ranks that
    drift apart as independent random walks arrive spread as normal variables, and the wait
    follows the expected largest of the group's arrivals ([Note: the wait after a stretch of
    computation])."""
    world = expected_max_normal(world_size)
    return min(1.0, expected_max_normal(ranks) / world) if world > 0 else 0.0


def sync_wait_s(facts: GraphFacts, devices: Devices, *, forward: Sequence[TimedGather],
                backward: Sequence[TimedGather], reduces: Sequence[TimedReduce],
                between_steps_s: float, in_flight: int = 1) -> float:
    """Seconds one step's blocking collectives (the gathers ``forward`` and ``backward`` as
    :func:`timed_gathers` gives them, and the gradient collectives ``reduces``, at most
    ``in_flight`` of a kind at once) wait for the ranks to arrive beyond their price:
    ``Devices.sync_wait_s`` for each, at the share :func:`sync_wait_share` gives the
    computation before it since the ranks last synchronised and :func:`group_wait_ratio` the
    ranks it waits for (:func:`sync_stretches_s`, [Note: the wait after a stretch of
    computation])."""
    if devices.world_size <= 1 or not devices.sync_wait_s:
        return 0.0
    fwd_compute, bwd_compute = facts.derive(_lane_compute_s, devices)
    stretches = sync_stretches_s(fwd_compute, bwd_compute, forward, backward, reduces,
                                 between_steps_s=between_steps_s,
                                 prefetch_waits=devices.prefetch_waits_for_ranks,
                                 world_size=devices.world_size, in_flight=in_flight)
    return devices.sync_wait_s * sum(share * sync_wait_share(c) for c, share in stretches)


def latency_s(collective: str, devices: Devices) -> float:
    """The part of a ``collective``'s time that hiding it does not save besides what
    ``Devices.overlap_efficiency`` leaves: its latency (the time of an empty one) where
    ``Devices.overlap_hides_latency`` is False, else 0."""
    if devices.overlap_hides_latency:
        return 0.0
    return collective_time_s(collective, 0, devices)


def gather_windows(facts: GraphFacts, devices: Devices, *,
                   prefetch: int) -> dict[str, GatherWindow]:
    """Per parameter group, the computation (forward and backward seconds) its collectives may
    hide under with prefetch distance ``prefetch``, for the search's per-group costs (its
    exact problem needs a cost per group and option, not per plan).

    Groups in the order forward first uses them: the forward gather of the i-th starts once the
    (i - d)-th is used, so it hides under the forward of the operators in between; its
    re-gather in backward starts at the backward of the (i + d)-th and hides under the backward
    of those in between; its reduce-scatter starts once its gradient is complete and hides
    under the backward of the operators before its first use. Counted as if every group were
    gathered: a replicated neighbour starts nothing; the shares of a bucket's members (one
    gather) are each the window of the member alone; and each reduce-scatter as if the link
    were its own, where :func:`hidden_comm_s` replays them one after the other."""
    if devices.world_size <= 1:
        return {}
    nodes = facts.nodes
    fwd, bwd = [0.0], [0.0]  # prefix sums over positions
    times = node_times(facts, devices)
    for n in nodes:
        t = times[n]
        fwd.append(fwd[-1] + (t.fwd_s if t else 0.0))
        bwd.append(bwd[-1] + (t.bwd_s if t else 0.0))
    first: dict[str, int] = {}
    for node, name in facts.param_of.items():
        uses = facts.param_uses(node)
        if uses:
            first[name] = min(first.get(name, len(nodes)), min(facts.pos[u] for u in uses))
    order = sorted(first, key=first.__getitem__)
    use = [first[n] for n in order]
    windows = {}
    for i, name in enumerate(order):
        before = after = 0.0
        if prefetch > 0:
            before = fwd[use[i]] - fwd[use[i - prefetch]] if i >= prefetch else 0.0
            j = i + prefetch
            after = bwd[use[j] + 1] - bwd[use[i] + 1] if j < len(order) else 0.0
        windows[name] = GatherWindow(before, after, bwd[use[i]])
    return windows


def hidden_share_s(state: ParamState, window: GatherWindow, devices: Devices, *,
                   regathered: bool) -> float:
    """The collective seconds of one group that its ``window`` (:func:`gather_windows`) hides,
    credited at ``Devices.overlap_efficiency``: its gathers' and, sharded, its reduce-scatter's,
    first stages only (a replicated gradient's all-reduce waits for its bucket to fill: not
    credited here), each less its :func:`latency_s`."""
    gathered = gather_s(state, devices, regathered=regathered)
    reduced = (reduce_s(state, devices) - reduce_at_wait_s(state, devices)
               if traits(state.strategy).sharded else 0.0)
    fixed = latency_s("all_gather", devices)
    forward = gathered.forward_s - gathered.forward_at_wait_s
    backward = gathered.backward_s - gathered.backward_at_wait_s
    return devices.overlap_efficiency * (
        min(max(0.0, forward - fixed), window.forward_s)
        + min(max(0.0, backward - fixed), window.backward_s)
        + min(max(0.0, reduced - latency_s("reduce_scatter", devices)), window.reduce_s))

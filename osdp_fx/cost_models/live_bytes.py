"""The bookkeeping of the memory timeline (``timeline.py``): what a predicted byte is
(``Category``), the live bytes at a time point (``MemoryPoint``), the prediction of a step
(``MemoryPrediction``), and the allocation events on time points that the timeline records and
sweeps (``Timeline``). The time points are those of ``timeline.py``'s module docstring."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import sympy
from torch import fx

from ..core.buckets import plan_buckets
from ..core.strategies import traits
from .graph_facts import ParamState


class Category(str, enum.Enum):
    """What a predicted byte is, for the breakdown of the peak and the memory plot."""

    PARAMETERS = "parameters"
    """This rank's parameters: shards, or full replicated tensors."""
    OPTIMIZER_STATE = "optimizer state"
    """The optimizer's per-parameter state (Adam: two fp32 tensors per element)."""
    GRADIENTS = "gradients"
    """Parameter gradients: full before a reduce-scatter, shards after, full when replicated."""
    GATHERED = "gathered parameters"
    """All-gathered (or cast) copies of sharded parameters while they are in use."""
    COMMUNICATION = "communication buffers"
    """Flat buffers of bucketed collectives and gradients held by reduce-scatters in flight."""
    ACTIVATIONS = "activations"
    """Operator outputs until their last use, and what autograd saves for backward."""
    RECOMPUTED = "recomputed activations"
    """What backward re-creates by recomputing a region, until the backward that uses it."""
    ACTIVATION_GRADIENTS = "activation gradients"
    """Gradients flowing backward through activations."""
    TEMPORARIES = "operator temporaries"
    """Scratch memory inside one operator's forward or backward."""
    OPTIMIZER_TEMPORARIES = "optimizer temporaries"
    """Scratch memory of the optimizer step."""
    INPUTS = "inputs"
    """The step's input tensors, alive for the whole step."""

    def __str__(self) -> str:
        return self.value


_CATEGORIES = tuple(Category)


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """Predicted live bytes by category at one time point of the step."""

    t: float
    """Time point (forward of node i: i; its backward: 2N - 1 - i; see module docstring)."""
    where: str
    """What happens then, e.g. 'backward of linear_3'."""
    bytes_by_category: tuple[tuple[str, int], ...]
    """(category, bytes) for every category, in ``Category`` order."""

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.bytes_by_category)


@dataclasses.dataclass(frozen=True)
class MemoryPrediction:
    """Predicted memory of one steady-state training step on one rank."""

    peak_bytes: int
    """Peak live bytes at the batch size asked for (default: the profiled one)."""
    peak_at: str
    """Where the peak happens, e.g. 'backward of linear_3'."""
    persistent_bytes: int
    """Parameters (shards or full) and optimizer state, alive for the whole step."""
    peak_bytes_expr: sympy.Expr
    """Peak as a function of the per-rank batch size ``BATCH``."""
    profiled_batch: int
    """Per-rank batch size the graph was profiled at."""
    first_step_peak_bytes: int = 0
    """Peak of the first step, before the optimizer has allocated its state (its first
    ``step()`` does, after backward)."""
    peak_by_category: tuple[tuple[str, int], ...] = ()
    """The peak's bytes by ``Category``, in ``Category`` order."""
    timeline: tuple[MemoryPoint, ...] = ()
    """Live bytes by category at every time point of a steady-state step."""
    lines: tuple[tuple[int, int], ...] = ()
    """(batch-scaled, fixed) live bytes at every steady-state time point."""


SYNC, LOCAL = "sync", "local"
"""Micro-batches of a step that accumulates gradients: the synchronised one (the last; the only
one without accumulation) and one run inside ``no_sync()``."""


class Timeline:
    """Allocation events on time points; each amount is (batch-scaled, fixed) bytes of one
    category, in every micro-batch or only in the ``SYNC`` or ``LOCAL`` one."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, tuple[Category, int, int, str]]] = []
        """(allocated at, freed after, amount), in the order they were recorded."""

    def copy(self) -> Timeline:
        """A timeline with the same events, to which more may be added."""
        out = Timeline()
        out.events = list(self.events)
        return out

    def alive(self, start: float, end: float, nbytes: int, category: Category, *,
              scaled: bool, only: str = "") -> None:
        """``nbytes`` of ``category`` allocated at ``start`` and freed after ``end`` (in the
        micro-batch ``only`` names, else in every one)."""
        if nbytes <= 0:
            return
        amount = (category, nbytes, 0, only) if scaled else (category, 0, nbytes, only)
        self.events.append((start, end if end > start else start, amount))

    def _by_time(self, micro: str) -> tuple[list[float], dict[float, list[tuple[Category, int, int]]],
                                            dict[float, list[tuple[Category, int, int]]]]:
        """The time points, and the amounts of ``micro`` allocated and freed at each."""
        times: set[float] = set()  # every event's, of any micro-batch
        allocs: dict[float, list[tuple[Category, int, int]]] = defaultdict(list)
        frees: dict[float, list[tuple[Category, int, int]]] = defaultdict(list)
        for start, end, (c, sc, fx_, only) in self.events:
            times.update((start, end))
            if only in ("", micro):
                allocs[start].append((c, sc, fx_))
                frees[end].append((c, sc, fx_))
        return sorted(times), allocs, frees

    def sweep(self, base: Mapping[Category, int],
              micro: str = SYNC) -> list[tuple[float, dict[Category, tuple[int, int]]]]:
        """(time, {category: (scaled, fixed)}) live totals after each time point's
        allocations in the micro-batch ``micro``, starting from ``base`` fixed bytes."""
        live = {c: [0, base.get(c, 0)] for c in _CATEGORIES}
        points = []
        times, allocs, frees = self._by_time(micro)
        for t in times:
            for c, sc, fx_ in allocs.get(t, ()):
                live[c][0] += sc
                live[c][1] += fx_
            points.append((t, {c: (v[0], v[1]) for c, v in live.items()}))
            for c, sc, fx_ in frees.get(t, ()):
                live[c][0] -= sc
                live[c][1] -= fx_
        return points

    def peak(self, base: Mapping[Category, int], micro: str, batch: int, profiled: int) -> int:
        """The largest live total of :meth:`sweep`'s points at ``batch`` (scaled bytes are
        profiled at ``profiled``), without keeping the points."""
        if batch == profiled:  # scaled bytes count as they are: one running total
            return self._peak_as_profiled(base, micro)
        scaled = {c: 0 for c in _CATEGORIES}
        fixed = sum(base.values())
        most = None
        times, allocs, frees = self._by_time(micro)
        for t in times:
            for c, sc, fx_ in allocs.get(t, ()):
                scaled[c] += sc
                fixed += fx_
            total = fixed + sum(v * batch // profiled for v in scaled.values())
            most = total if most is None else max(most, total)
            for c, sc, fx_ in frees.get(t, ()):
                scaled[c] -= sc
                fixed -= fx_
        return fixed if most is None else most

    def _peak_as_profiled(self, base: Mapping[Category, int], micro: str) -> int:
        """:meth:`peak` at the profiled batch: at each time point, what was allocated up to it
        and not freed before it (integers, so the sums are exact in any order)."""
        fixed = sum(base.values())
        kept = [(start, end, sc + fx_) for start, end, (_, sc, fx_, only) in self.events
                if only in ("", micro)]
        if not kept:
            return fixed
        starts, ends, sizes = (np.asarray(v) for v in zip(*kept))
        times = np.union1d(starts, ends)
        by_start, by_end = np.argsort(starts, kind="stable"), np.argsort(ends, kind="stable")
        allocated = np.concatenate(([0], np.cumsum(sizes[by_start], dtype=np.int64)))
        freed = np.concatenate(([0], np.cumsum(sizes[by_end], dtype=np.int64)))
        live = (allocated[np.searchsorted(starts[by_start], times, side="right")]
                - freed[np.searchsorted(ends[by_end], times, side="left")])
        return fixed + int(live.max())


READY_BEFORE_SCATTERS = 0.375
"""When a replicated group's gradient is ready after the backward of its first use ``t``:
``t + READY_BEFORE_SCATTERS``. Its leaf's ``AccumulateGrad`` (and the reducer's hook on it)
runs as soon as that backward has returned, before the all-gathers' backward at the same
point starts a reduce-scatter (``t + 0.5``, which first completes the one
``scatters_in_flight`` before it, ``t + 0.4375``): autograd runs ``AccumulateGrad`` first. A
bucket the gradient completes is packed then, beside the reduce-scatter still in flight."""


def replicated_buckets(tl: Timeline, params: Mapping[str, ParamState],
                        ready: Mapping[str, float], *, bucket_bytes: int, in_flight: int,
                        end: float) -> None:
    """The runtime's gradient buckets (``GradReducer``): replicated trainable groups in reverse
    order; a bucket's flat copy is allocated when its last gradient is ready (buckets start in
    order) and freed when the bucket ``in_flight`` later starts, or when backward ends."""
    order = [n for n, p in params.items() if not traits(p.strategy).sharded and p.trainable][::-1]
    groups = plan_buckets([(params[n].element_size, params[n].numel * params[n].element_size)
                           for n in order], bucket_bytes)
    starts: list[tuple[float, int]] = []
    for group in groups:
        names = [order[i] for i in group]
        flat = sum(params[n].numel * params[n].reduce_size for n in names if n in ready)
        at = max(ready.get(n, end) for n in names)
        if starts:
            at = max(at, starts[-1][0])
        if flat:
            starts.append((at, flat))
    for i, (at, flat) in enumerate(starts):
        later = i + in_flight
        # completed (and its buffer freed) before the later one is allocated
        tl.alive(at, starts[later][0] - 0.0625 if later < len(starts) else end, flat,
                 Category.COMMUNICATION, scaled=False, only=SYNC)


def describe_time(t: float, nodes: list[fx.Node]) -> str:
    n = len(nodes)
    if t < n:
        node = nodes[math.ceil(t)].name
        return f"all-gather before forward of {node}" if t % 1 else f"forward of {node}"
    if t < 2 * n and t % 1 == 0.25:
        return f"gradient sum after backward of {nodes[2 * n - 1 - int(t)].name}"
    if t < 2 * n and t % 1 == READY_BEFORE_SCATTERS:
        return f"gradient all-reduce bucket after backward of {nodes[2 * n - 1 - int(t)].name}"
    if t < 2 * n and t % 1 == 0.625:
        return f"recomputation before backward of {nodes[2 * n - 1 - math.ceil(t)].name}"
    if t < 2 * n:
        if t % 1 == 0.5:
            return f"reduce-scatter after backward of {nodes[2 * n - 1 - int(t)].name}"
        node = nodes[2 * n - 1 - math.ceil(t)].name
        return f"re-gather before backward of {node}" if t % 1 else f"backward of {node}"
    if 2 * n < t < 2 * n + 1:
        return "end of backward: a split weight's gradient joined"
    return "gradient all-reduce" if t == 2 * n else "optimizer step"

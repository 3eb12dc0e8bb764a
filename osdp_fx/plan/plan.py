"""Plan: which strategy every parameter group runs under, printable, hashable, JSON round-trip.

A plan names each parameter group (a parameter and every name tied to it) by its canonical name
and gives its strategy. ``N`` ranks form a mesh of ``nodes x ranks_per_node`` (rank ``r`` is on
node ``r // ranks_per_node``, local index ``r % ranks_per_node``):

============== ========================= ================ =====================================
strategy       forward                   fwd to bwd       backward
============== ========================= ================ =====================================
replicate      full parameter            kept             all-reduce gradient (bucketed)
shard_grad_op  all-gather (N ranks)      gathered kept    reduce-scatter gradient
full_shard     all-gather, free          freed            re-gather, reduce-scatter gradient
hybrid_shard   all-gather inside the     freed            re-gather in the node, reduce-scatter
               node, free                                 in the node, all-reduce of the shard
                                                          across nodes
hierarchical   all-gather across nodes,  freed            re-gather (two stages), reduce-scatter
               then inside the node,                      inside the node, then across nodes
               free
============== ========================= ================ =====================================

``hybrid_shard`` is FSDP's HYBRID_SHARD (group sharding, as in DeepSpeed's MiCS): a parameter is
cut into ``ranks_per_node`` shards and every node holds all of them, so a rank keeps
``1/ranks_per_node`` of it and inter-node links carry only the all-reduce of the shard.
``hierarchical`` shards over all ``N`` ranks like ``full_shard`` but runs each collective in two
stages so that inter-node links carry each byte once per node (:func:`collective_stages`). Both
free the gathered parameter after its last forward use and re-gather it in backward, as FSDP's
HYBRID_SHARD does (reshard after forward). On one node both equal ``full_shard``. Gradients are
averaged over all ``N`` ranks under every strategy.

The JSON form (``docs/plan-format.md``) is versioned and meant to be edited by hand.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from typing import Any

import torch

from ..core.buckets import DEFAULT_SCHEDULE, Schedule
from ..core.layout import (  # noqa: F401  (Stage, shard_count re-exported)
    Stage,
    collective_stages,
    row_numel,
    shard_count,
    shard_numel,
)
from ..core.regions import Recompute, check_policy
from ..core.strategies import (  # noqa: F401  (re-exported: the plan's vocabulary)
    FREED_AFTER_FORWARD,
    FULL_SHARD,
    HIERARCHICAL,
    HYBRID_SHARD,
    MESH_STRATEGIES,
    REPLICATE,
    SHARD_GRAD_OP,
    SHARDED,
    STRATEGIES,
    Strategy,
    traits,
)
from ..errors import PlanError
from ..units import format_bytes
from .table import describe_collectives, plan_table

PLAN_FORMAT = "osdp-fx-plan"
PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """The decision for one parameter group."""

    name: str
    """Canonical parameter name (first name in ``model.named_parameters()``)."""
    strategy: str
    """One of STRATEGIES."""
    shape: tuple[int, ...]
    """Shape of the full parameter."""
    dtype: str
    """Element type, e.g. 'float32'."""
    element_size: int
    """Bytes per element."""
    aliases: tuple[str, ...] = ()
    """Other names of the same tensor (tied weights)."""
    note: str = ""
    """'frozen' for a frozen group (gathered, never reduced; integer ones, a packed quantized
    weight, are frozen too), with a 4-bit weight's format after it ('frozen, nf4,
    bitsandbytes')."""
    compute_s: float | None = None
    """Predicted forward + backward time of the operators attributed to this group."""
    comm_s: float | None = None
    """Predicted time of this group's collectives per step."""
    regathered: bool = True
    """Strategies that free after forward (FREED_AFTER_FORWARD) only: whether backward re-gathers
    the parameter (some operator saved it for backward; known once the model is profiled)."""
    trainable: bool = True
    """Whether it gets a gradient (False for frozen parameters, integer ones among them): a
    group that does not has no gradient collective and no optimizer state. Not saved: a plan
    is resolved against the model."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def shard_bytes(self, world_size: int, ranks_per_node: int | None = None) -> int:
        """Bytes of the parameter one rank holds: the full tensor (replicate) or one flat
        padded shard of whole rows (:func:`shard_count` shards)."""
        chunks = shard_count(self.strategy, world_size, ranks_per_node)
        return shard_numel(self.numel, chunks, row_numel(self.shape)) * self.element_size

    def collectives(
        self, world_size: int, ranks_per_node: int | None = None, *,
        gather_element_size: int | None = None, reduce_element_size: int | None = None,
    ) -> tuple[list[Stage], list[Stage]]:
        """(forward, backward) collectives of one step (:func:`collective_stages`). Element
        sizes of the gathered parameter and of the reduced gradient default to the parameter's
        own (mixed precision changes them: :meth:`Plan.collectives_of`)."""
        return collective_stages(
            self.strategy, self.numel, self.element_size, world_size=world_size,
            ranks_per_node=ranks_per_node, regathered=self.regathered,
            trainable=self.trainable,
            gather_element_size=gather_element_size, reduce_element_size=reduce_element_size,
            row=row_numel(self.shape),
        )


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """What ``plan[name]`` gives for a parameter the plan splits (``docs/splitting.md``): the
    model's name and the parts, each a :class:`ParamPlan` of its own (``<name>_part<i>``, in
    order along the split dimension) with its own strategy. The compiled module shows the
    parameter as one, under ``name``; the parts are the plan's parameter groups."""

    name: str
    """The parameter's name in the model (a linear's weight, or its bias)."""
    parts: tuple[ParamPlan, ...]
    """The parts, in order."""

    @property
    def strategies(self) -> tuple[str, ...]:
        """Each part's strategy, in order."""
        return tuple(p.strategy for p in self.parts)

    @property
    def strategy(self) -> str:
        """The parts' strategy when they share one, else ``"mixed"`` (see :attr:`strategies`)."""
        return self.parts[0].strategy if len(set(self.strategies)) == 1 else "mixed"

    @property
    def dtype(self) -> str:
        return self.parts[0].dtype

    @property
    def trainable(self) -> bool:
        return self.parts[0].trainable

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def shard_bytes(self, world_size: int, ranks_per_node: int | None = None) -> int:
        """Bytes one rank holds of every part together."""
        return sum(p.shard_bytes(world_size, ranks_per_node) for p in self.parts)


@dataclasses.dataclass(frozen=True)
class RegionPrediction:
    """What one recomputed region saves and recomputes (``cost_models.recompute``)."""

    region: str
    """Module path, e.g. 'model.blocks.3'."""
    policy: str
    """selective or full."""
    saved_ops: tuple[str, ...]
    """Operators whose outputs it keeps for backward."""
    recomputed_ops: tuple[str, ...]
    """Operators it runs again in backward."""
    kept_bytes: int
    """Activation bytes it keeps from forward to backward."""
    recomputed_bytes: int
    """Activation bytes its recomputation re-creates."""
    recompute_s: float
    """Predicted time of the recomputed forward."""


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the cost models predict for one training step of a plan, per rank."""

    step_time_s: float
    """Compute + communication + optimizer + the runtime's host time of one step (where the
    host runs ahead of the device, a GPU, the longer of the host's and the device's lanes:
    [Note: the host lane] in ``cost_models/step.py``)."""
    compute_s: float
    """Forward and backward of every operator."""
    comm_s: float
    """Collectives and their waits for the ranks to arrive (``sync_wait_s``), less the
    collective time prefetching and asynchronous gradient collectives are predicted to
    hide."""
    optim_s: float
    """Optimizer step."""
    peak_memory_bytes: int
    """Peak live bytes over the step's timeline."""
    peak_at: str
    """Where on the timeline the peak happens."""
    optimizer: str
    """Optimizer kind the memory and time assume (sgd, sgd_momentum, adam, adamw)."""
    batch_size: int
    """Per-rank batch size the model was profiled at."""
    step_time_expr: Any = None
    """Step time as a sympy expression of the per-rank batch size ``b``."""
    peak_memory_expr: Any = None
    """Peak memory as a sympy expression of the per-rank batch size ``b``."""
    first_step_peak_bytes: int | None = None
    """Peak of the first step, before the optimizer's first ``step()`` allocates its state."""
    peak_by_category: tuple[tuple[str, int], ...] = ()
    """The peak's bytes by category (parameters, optimizer state, gradients, gathered
    parameters, communication buffers, activations, ...; ``cost_models.timeline.Category``)."""
    memory_timeline: tuple[Any, ...] = dataclasses.field(default=(), repr=False, compare=False)
    """Predicted live bytes by category at every time point of a steady-state step
    (``cost_models.timeline.MemoryPoint``); not saved with the plan."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step the memory is predicted for, all but the last inside
    ``no_sync()`` (``compile_osdp(grad_accumulation=)``); 1: no accumulation."""
    seq_len: int | None = None
    """Sequence length (dimension 1 of the inputs) the prediction is made at; None when the
    memory is not modelled in it (no such dimension, or the model fixes it)."""
    peak_memory_shape_expr: Any = None
    """Peak memory as a sympy expression of the per-rank batch size ``b`` and the sequence
    length ``s`` (None when the memory is not modelled in the sequence length)."""
    peak_lines: Any = dataclasses.field(default=None, repr=False, compare=False)
    """Every time point's live bytes as a function of (batch, sequence length)
    (``cost_models.shapes.Line``): the exact form of ``peak_memory_expr``; not saved."""
    profiled_shape: tuple[int, int | None] = dataclasses.field(default=(1, None), repr=False,
                                                               compare=False)
    """(batch, sequence length) the model was profiled at."""

    def peak_bytes_at(self, batch: int, seq: int | None = None) -> int:
        """Predicted peak memory per rank at ``batch`` per rank and sequence length ``seq``
        (ignored when the memory is not modelled in it)."""
        if self.peak_lines and seq is not None:  # (c0 + c1 s + c2 s^2) b / b0 + fixed
            return int(max((c0 + c1 * seq + c2 * seq * seq) * batch / self.profiled_shape[0] + f
                           for c0, c1, c2, f in self.peak_lines))
        import sympy
        return int(self.peak_memory_expr.subs(sympy.Symbol("b", positive=True, integer=True),
                                              batch))
    regions: tuple[RegionPrediction, ...] = ()
    """The recomputed regions: what each saves and recomputes."""
    figures: str = ""
    """Where the rates the time was predicted with come from (``Devices.figures``): "detected",
    "preset:<name>", "defaults" or "given"."""
    host_s: float = 0.0
    """The runtime's host time per step beyond its collectives and operators (measured per
    parameter by ``detect_devices``; 0 with figures that do not measure it)."""
    sync_wait_s: float = 0.0
    """Of ``comm_s``, what the blocking collectives wait for the ranks to arrive after a
    stretch of computation (``Devices.sync_wait_s``; [Note: the wait after a stretch of
    computation] in ``cost_models/overlap.py``)."""

    def time_parts(self) -> str:
        """The step's parts in milliseconds, as the plan prints them."""
        waits = (f" with {self.sync_wait_s * 1e3:.2f} of waiting for the ranks"
                 if self.sync_wait_s else "")
        host = f", runtime host {self.host_s * 1e3:.2f}" if self.host_s else ""
        return (f"compute {self.compute_s * 1e3:.2f}, communication {self.comm_s * 1e3:.2f}"
                f"{waits}, optimizer {self.optim_s * 1e3:.2f}{host}")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["step_time_expr"] = str(self.step_time_expr)
        out["peak_memory_expr"] = str(self.peak_memory_expr)
        out["peak_memory_shape_expr"] = str(self.peak_memory_shape_expr)
        out["peak_by_category"] = dict(self.peak_by_category)
        out["regions"] = [dataclasses.asdict(r) for r in self.regions]
        del out["memory_timeline"], out["peak_lines"], out["profiled_shape"]
        return out

    def breakdown(self) -> str:
        """The peak's categories, largest first: each one's name and bytes (``format_bytes``),
        comma-separated."""
        parts = sorted(((b, c) for c, b in self.peak_by_category if b), reverse=True)
        return ", ".join(f"{c} {format_bytes(b)}" for b, c in parts)


@dataclasses.dataclass(frozen=True)
class TimedPlan:
    """One plan autotuning measured (``planner/autotune.py``)."""

    hash: str
    predicted_step_s: float
    measured_step_s: float
    """The median over its timed steps of the slowest rank's seconds."""
    predicted_peak_bytes: int
    measured_peak_bytes: int
    """The fullest rank's peak over one step (``autotune.step_peak_bytes``)."""
    role: str
    """'predicted best' (the search's answer, kept unless a plan measures faster by more than
    the noise), 'alternative' (another plan predicted under the margin), or 'above the margin'
    (predicted to fit the memory limit but not its plannable share, ``MEMORY_MARGIN``: kept only
    when measured under the limit)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Strategies for every parameter group of one model at one world size."""

    params: tuple[ParamPlan, ...]
    """One entry per parameter group, in the model's parameter order."""
    world_size: int
    """Ranks the plan was made for."""
    memory_limit_bytes: int | None = None
    """Per-rank memory limit the plan was made under, if any."""
    source: str = ""
    """How the plan was made: a strategy name, 'file:<path>', 'search', or 'user'."""
    prediction: Prediction | None = None
    """Predicted step time and peak memory per rank (None when the model was not profiled)."""
    splits: tuple[tuple[str, int], ...] = ()
    """Linear weights split into parts, as (weight name, number of parts); the parts
    (``<weight>_part<i>``, and the bias's) are parameter groups of their own in ``params``."""
    param_dtype: str = ""
    """Mixed precision: the dtype floating parameters are gathered and computed in, e.g.
    'bfloat16' ('' = their own)."""
    reduce_dtype: str = ""
    """Mixed precision: the dtype gradients are reduced in ('' = the parameters' own)."""
    schedule: Schedule = DEFAULT_SCHEDULE
    """When collectives start and how they are fused: prefetch distance, gather and all-reduce
    bucket sizes, gradient collectives in flight (``core/buckets.py``)."""
    ranks_per_node: int | None = None
    """Ranks per node of the mesh the plan was made for; None: all ranks on one node."""
    recompute: tuple[tuple[str, str], ...] = ()
    """(region, 'selective' or 'full') for the regions recomputed in backward (``regions``)."""
    measured: tuple[TimedPlan, ...] = ()
    """Autotuning (``compile_osdp(autotune=K)``): the plans it timed, fastest measured first
    (the plan in force need not be: ``autotune.keep_index``); empty when the plan was not
    autotuned. Not hashed."""

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, Schedule):
            raise PlanError(f"a plan's schedule is a Schedule (osdp_fx.core.buckets), got "
                            f"{self.schedule!r}")
        object.__setattr__(self, "recompute", recomputed_regions(self.recompute))
        object.__setattr__(self, "ranks_per_node",
                           normalized_ranks_per_node(self.ranks_per_node, self.world_size))
        for p in self.params:
            if p.strategy not in STRATEGIES:
                raise PlanError(
                    f"unknown strategy {p.strategy!r} for parameter {p.name!r}; "
                    f"use one of {', '.join(STRATEGIES)}"
                )

    # ---- lookup -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ParamPlan | SplitPlan:
        """The decision for ``name``: a parameter group's :class:`ParamPlan` (by its name, an
        alias, or a part's name ``<weight>_part<i>``), or, for a parameter the plan splits, a
        :class:`SplitPlan` listing its parts. KeyError for a name the plan does not hold."""
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        parts = self.parts_of(name)
        if parts:
            return SplitPlan(name, parts)
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def parts_of(self, name: str) -> tuple[ParamPlan, ...]:
        """The parts the plan splits parameter ``name`` into (a linear's weight, or its bias),
        in order; empty when it does not split it."""
        by_name = {p.name: p for p in self.params}
        parts = []
        while f"{name}_part{len(parts)}" in by_name:
            parts.append(by_name[f"{name}_part{len(parts)}"])
        return tuple(parts) if len(parts) > 1 else ()

    def strategy_of(self, name: str) -> str:
        """The strategy of ``name`` (``"mixed"`` for a split parameter whose parts differ)."""
        return self[name].strategy

    def counts(self) -> dict[str, int]:
        """Number of parameter groups per strategy."""
        out = {s.value: 0 for s in STRATEGIES}
        for p in self.params:
            out[p.strategy] += 1
        return out

    @property
    def num_nodes(self) -> int:
        """Nodes of the mesh: world size over ranks per node."""
        return self.world_size // (self.ranks_per_node or self.world_size)

    @property
    def peak_memory_bytes(self) -> int | None:
        """Predicted peak memory per rank (None without a profile)."""
        return self.prediction.peak_memory_bytes if self.prediction else None

    @property
    def step_time_s(self) -> float | None:
        """Predicted time of one training step (None without a profile)."""
        return self.prediction.step_time_s if self.prediction else None

    def persistent_param_bytes(self, *, frozen_only: bool = False) -> int:
        """Bytes of parameters (shards or full tensors) each rank holds (``frozen_only``: of
        the groups that get no gradient)."""
        return sum(p.shard_bytes(self.world_size, self.ranks_per_node) for p in self.params
                   if not (frozen_only and p.trainable))

    def collectives_of(self, p: ParamPlan) -> tuple[list[Stage], list[Stage]]:
        """``p.collectives`` at this plan's world size, mesh and precision."""
        def size(name: str) -> int | None:
            return element_size(name) if name else None

        return p.collectives(self.world_size, self.ranks_per_node,
                             gather_element_size=size(self.param_dtype),
                             reduce_element_size=size(self.reduce_dtype))

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON form (``docs/plan-format.md``; read back by ``request.py``)."""
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "world_size": self.world_size,
            **({"ranks_per_node": self.ranks_per_node} if self.ranks_per_node else {}),
            "memory_limit_bytes": self.memory_limit_bytes,
            **({"splits": dict(self.splits)} if self.splits else {}),
            **self.schedule.to_dict(),
            **({"mixed_precision": {"param_dtype": self.param_dtype,
                                    "reduce_dtype": self.reduce_dtype}}
               if self.param_dtype else {}),
            **({"recompute": dict(self.recompute)} if self.recompute else {}),
            "params": {
                p.name: {"strategy": p.strategy, "shape": list(p.shape), "dtype": p.dtype,
                         **({"aliases": list(p.aliases)} if p.aliases else {}),
                         **({"note": p.note} if p.note else {}),
                         **({"predicted_compute_s": p.compute_s, "predicted_comm_s": p.comm_s}
                            if p.compute_s is not None else {})}
                for p in self.params
            },
            **({"predicted": self.prediction.to_dict()} if self.prediction else {}),
            **({"autotuned": [dataclasses.asdict(t) for t in self.measured]} if self.measured else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    def hash(self) -> str:
        """Digest of everything that must agree across ranks (strategies, shapes, world, mesh)."""
        data = self.to_dict()
        data.pop("memory_limit_bytes")
        data.pop("predicted", None)
        data.pop("autotuned", None)
        for entry in data["params"].values():
            entry.pop("predicted_compute_s", None)
            entry.pop("predicted_comm_s", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    # ---- printing -----------------------------------------------------------------------
    def table(self) -> str:
        """Every parameter group on a line: strategy, bytes, collectives, predicted times; then
        the totals and the predicted peak memory by category."""
        return plan_table(self)

    def __str__(self) -> str:
        return self.table()

    def explain(self, name: str) -> str:
        """Why one parameter group runs the way it does, and what that costs per step; for a
        parameter the plan splits (``name`` as the model names it), each of its parts."""
        entry = self[name]
        if isinstance(entry, SplitPlan):
            lines = [f"{name}: split into {len(entry.parts)} parts ({', '.join(entry.strategies)}"
                     f"), {format_bytes(entry.nbytes)} full; the compiled module shows it as "
                     "one parameter"]
            for part in entry.parts:
                lines += ["  " + line for line in self._explain_group(part)]
            return "\n".join(lines)
        return "\n".join(self._explain_group(entry))

    def _explain_group(self, p: ParamPlan) -> list[str]:
        fwd, bwd = self.collectives_of(p)
        lines = [
            f"{p.name}: {p.strategy}" + (f" ({p.note})" if p.note else ""),
            f"  shape {tuple(p.shape)} {p.dtype}, {format_bytes(p.nbytes)} full",
            f"  forward:  {describe_collectives(fwd)}",
            f"  backward: {describe_collectives(bwd)}",
        ]
        if p.aliases:
            lines.append(f"  tied to: {', '.join(p.aliases)}")
        return lines


def recomputed_regions(pairs: Any) -> tuple[tuple[str, str], ...]:
    """(region, policy) pairs checked, without the regions that save (recompute nothing)."""
    return tuple((r, str(check_policy(p, where=f"region {r!r}"))) for r, p in pairs
                 if p != Recompute.SAVE)


def element_size(dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"unknown dtype {dtype_name!r} in the plan's mixed precision; use e.g. "
                        "'bfloat16', 'float16' or 'float32'")
    return dtype.itemsize


def describe_mesh(world_size: int, ranks_per_node: int | None) -> str:
    if ranks_per_node is None:
        return f"{world_size} rank{'s' if world_size > 1 else ''} on one node"
    return f"{world_size // ranks_per_node} nodes x {ranks_per_node} ranks"


def normalized_ranks_per_node(ranks_per_node: int | None, world_size: int) -> int | None:
    """``ranks_per_node`` checked against the world; None when all ranks are on one node."""
    if ranks_per_node is None or ranks_per_node == world_size:
        return None
    if (not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool)
            or ranks_per_node < 1 or world_size % ranks_per_node):
        raise PlanError(
            f"ranks_per_node={ranks_per_node!r} does not divide the world size {world_size}: "
            "the mesh is nodes x ranks_per_node with the same number of ranks on every node; "
            "launch as many ranks on every node, or give the number of ranks per node"
        )
    return ranks_per_node

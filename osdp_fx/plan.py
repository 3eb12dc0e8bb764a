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
import math
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from tabulate import tabulate

from .errors import PlanError
from .units import format_bytes

from .layout import shard_count  # noqa: F401  (re-exported)
from .strategies import (  # noqa: F401  (re-exported: the plan's vocabulary)
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

DEFAULT_PREFETCH = 1
"""All-gathers start this many sharded parameters ahead of their use, unless a plan says."""

PLAN_FORMAT = "osdp-fx-plan"
PLAN_VERSION = 1


def check_prefetch(prefetch: Any) -> None:
    """Raise PlanError unless ``prefetch`` is an int >= 0."""
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise PlanError(f"prefetch must be an int >= 0 (all-gathers start that many sharded "
                        f"parameters ahead; 0 turns prefetching off), got {prefetch!r}")


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
    """Why the strategy differs from what was asked, if it does (e.g. 'frozen')."""
    compute_s: float | None = None
    """Predicted forward + backward time of the operators attributed to this group."""
    comm_s: float | None = None
    """Predicted time of this group's collectives per step."""
    regathered: bool = True
    """Strategies that free after forward (FREED_AFTER_FORWARD) only: whether backward re-gathers
    the parameter (some operator saved it for backward; known once the model is profiled)."""
    trainable: bool = True
    """Whether it gets a gradient (False for frozen and non-float parameters, which stay
    replicated; ``note`` says which). Not saved: a plan is resolved against the model."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size

    def shard_bytes(self, world_size: int, ranks_per_node: int | None = None) -> int:
        """Bytes of the parameter one rank holds: the full tensor (replicate) or one flat
        padded shard (:func:`shard_count` shards)."""
        chunks = shard_count(self.strategy, world_size, ranks_per_node)
        return -(-self.numel // chunks) * self.element_size

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
        )


@dataclasses.dataclass(frozen=True)
class Stage:
    """One collective of a parameter group's training step."""

    collective: str
    """'all_gather', 'reduce_scatter' or 'all_reduce'."""
    nbytes: int
    """Bytes of this collective's full buffer: the gathered result, the reduce-scatter's input,
    or the all-reduced tensor."""
    ranks: int
    """Ranks in the group it runs over."""
    scope: str
    """'world' (every rank), 'intra' (the ranks of one node) or 'inter' (the ranks with the same
    local index, one per node)."""

    def spans_nodes(self, num_nodes: int) -> bool:
        """Whether it runs over inter-node links."""
        return self.scope == "inter" or (self.scope == "world" and num_nodes > 1)

    def __str__(self) -> str:
        where = "" if self.scope == "world" else f"[{self.scope}]"
        return f"{self.collective}{where} {format_bytes(self.nbytes)}"


def collective_stages(
    strategy: str,
    numel: int,
    element_size: int,
    *,
    world_size: int,
    ranks_per_node: int | None = None,
    regathered: bool = True,
    trainable: bool = True,
    gather_element_size: int | None = None,
    reduce_element_size: int | None = None,
) -> tuple[list[Stage], list[Stage]]:
    """(forward, backward) collectives of one step of a group of ``numel`` elements of
    ``element_size`` bytes (gathered at ``gather_element_size`` and reduced at
    ``reduce_element_size`` bytes per element, when mixed precision makes them differ).

    With ``N = world_size`` ranks as ``n`` nodes of ``R = ranks_per_node`` and ``Pp`` the bytes
    of the parameter padded to its :func:`shard_count`:

    * replicate: all-reduce of the gradient (``P`` bytes, unpadded) over N ranks;
    * shard_grad_op: all-gather of ``Pp`` over N; reduce-scatter of ``Pp`` over N;
      full_shard also re-gathers in backward when ``regathered`` (an operator saved it);
    * hybrid_shard: all-gather of ``Pp`` over the R ranks of the node (re-gathered likewise);
      reduce-scatter of ``Pp`` over the node, then all-reduce of the ``Pp / R`` shard over the
      n ranks with the same local index;
    * hierarchical: all-gather of ``Pp / R`` over the n ranks with the same local index (each
      brings its shard: inter-node links carry each byte once per node), then of ``Pp`` over the
      node (re-gathered likewise); reduce-scatter of ``Pp`` over the node, then of ``Pp / R``
      across nodes.

    Stages over a single rank are left out, so on one node hybrid_shard and hierarchical have
    full_shard's collectives; nothing is communicated at world size 1 or when not ``trainable``
    (a frozen replicated parameter).
    """
    per_node = ranks_per_node or world_size
    nodes = world_size // per_node
    if world_size == 1:
        return [], []
    t = traits(strategy)
    reduced = reduce_element_size or element_size
    if not t.sharded:
        return [], ([Stage("all_reduce", numel * reduced, world_size, "world")]
                    if trainable else [])
    chunks = shard_count(strategy, world_size, ranks_per_node)
    padded_numel = -(-numel // chunks) * chunks
    padded, grad = padded_numel * (gather_element_size or element_size), padded_numel * reduced
    ranks = {"world": world_size, "intra": per_node, "inter": nodes}

    def size(nbytes: int, part: str) -> int:
        return nbytes if part == "full" else nbytes // per_node

    gather = [Stage("all_gather", size(padded, part), ranks[scope], scope)
              for scope, part in t.gather_stages]
    scatter = [Stage(collective, size(grad, part), ranks[scope], scope)
               for collective, scope, part in t.reduce_stages]
    again = gather if t.freed_after_forward and regathered else []
    return ([s for s in gather if s.ranks > 1],
            [s for s in again + scatter if s.ranks > 1])


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What the cost models predict for one training step of a plan, per rank."""

    step_time_s: float
    """Compute + communication + optimizer time of one step."""
    compute_s: float
    """Forward and backward of every operator."""
    comm_s: float
    """Collectives (not overlapped)."""
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

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["step_time_expr"] = str(self.step_time_expr)
        out["peak_memory_expr"] = str(self.peak_memory_expr)
        out["peak_by_category"] = dict(self.peak_by_category)
        del out["memory_timeline"]
        return out

    def breakdown(self) -> str:
        """The peak's categories, largest first, e.g. 'activations 40.0 MiB, parameters ...'."""
        parts = sorted(((b, c) for c, b in self.peak_by_category if b), reverse=True)
        return ", ".join(f"{c} {format_bytes(b)}" for b, c in parts)


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
    prefetch: int = DEFAULT_PREFETCH
    """How many sharded parameters ahead each all-gather starts, in forward and backward (0:
    each parameter is gathered when it is needed)."""
    ranks_per_node: int | None = None
    """Ranks per node of the mesh the plan was made for; None: all ranks on one node."""

    def __post_init__(self) -> None:
        check_prefetch(self.prefetch)
        object.__setattr__(self, "ranks_per_node",
                           normalized_ranks_per_node(self.ranks_per_node, self.world_size))
        for p in self.params:
            if p.strategy not in STRATEGIES:
                raise PlanError(
                    f"unknown strategy {p.strategy!r} for parameter {p.name!r}; "
                    f"use one of {', '.join(STRATEGIES)}"
                )

    # ---- lookup -------------------------------------------------------------------------
    def __getitem__(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name or name in p.aliases:
                return p
        raise KeyError(name)

    def strategy_of(self, name: str) -> str:
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

    def persistent_param_bytes(self) -> int:
        """Bytes of parameters (shards or full tensors) each rank holds."""
        return sum(p.shard_bytes(self.world_size, self.ranks_per_node) for p in self.params)

    def collectives_of(self, p: ParamPlan) -> tuple[list[Stage], list[Stage]]:
        """``p.collectives`` at this plan's world size, mesh and precision."""
        def size(name: str) -> int | None:
            return _element_size(name) if name else None

        return p.collectives(self.world_size, self.ranks_per_node,
                             gather_element_size=size(self.param_dtype),
                             reduce_element_size=size(self.reduce_dtype))

    # ---- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "world_size": self.world_size,
            **({"ranks_per_node": self.ranks_per_node} if self.ranks_per_node else {}),
            "memory_limit_bytes": self.memory_limit_bytes,
            **({"splits": dict(self.splits)} if self.splits else {}),
            "prefetch": self.prefetch,
            **({"mixed_precision": {"param_dtype": self.param_dtype,
                                    "reduce_dtype": self.reduce_dtype}}
               if self.param_dtype else {}),
            "params": {
                p.name: {"strategy": p.strategy, "shape": list(p.shape), "dtype": p.dtype,
                         **({"aliases": list(p.aliases)} if p.aliases else {}),
                         **({"note": p.note} if p.note else {}),
                         **({"predicted_compute_s": p.compute_s, "predicted_comm_s": p.comm_s}
                            if p.compute_s is not None else {})}
                for p in self.params
            },
            **({"predicted": self.prediction.to_dict()} if self.prediction else {}),
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
        for entry in data["params"].values():
            entry.pop("predicted_compute_s", None)
            entry.pop("predicted_comm_s", None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    # ---- printing -----------------------------------------------------------------------
    def table(self) -> str:
        rows = []
        predicted = self.prediction is not None
        by_link = {"intra": 0, "inter": 0}
        for p in self.params:
            fwd, bwd = self.collectives_of(p)
            for stage in fwd + bwd:
                by_link["inter" if stage.spans_nodes(self.num_nodes) else "intra"] += stage.nbytes
            row = [
                p.name + (f" (= {', '.join(p.aliases)})" if p.aliases else ""),
                "x".join(map(str, p.shape)) or "()",
                p.strategy + (f" ({p.note})" if p.note else ""),
                format_bytes(p.shard_bytes(self.world_size, self.ranks_per_node)),
                _describe_collectives(fwd),
                _describe_collectives(bwd),
            ]
            if predicted:
                row += [_ms(p.compute_s), _ms(p.comm_s)]
            rows.append(row)
        head = ["parameter", "shape", "strategy", "param bytes/rank", "forward", "backward"]
        if predicted:
            head += ["compute ms", "comm ms"]
        counts = ", ".join(f"{n} {s}" for s, n in self.counts().items() if n)
        split = "; split: " + ", ".join(f"{n} in {k}" for n, k in self.splits) if self.splits else ""
        if self.param_dtype:
            split += f"; compute in {self.param_dtype}, reduce in {self.reduce_dtype}"
        split += f"; prefetch {self.prefetch}"
        mesh = (f" = {self.num_nodes} nodes x {self.ranks_per_node} ranks"
                if self.num_nodes > 1 else "")
        lines = [
            f"Plan for world size {self.world_size}{mesh} ({counts}; source: "
            f"{self.source or 'user'}; hash {self.hash()}{split})",
            tabulate(rows, headers=head, disable_numparse=True),
            f"parameters per rank: {format_bytes(self.persistent_param_bytes())}"
            + (f"; memory limit {format_bytes(self.memory_limit_bytes)}"
               if self.memory_limit_bytes is not None else ""),
        ]
        if self.num_nodes > 1:
            lines.append(
                f"collective buffers per step: {format_bytes(by_link['intra'])} inside nodes, "
                f"{format_bytes(by_link['inter'])} across nodes ([intra]: a node's ranks, "
                "[inter]: one rank per node, unmarked: all ranks)")
        if self.prediction is not None:
            pr = self.prediction
            lines.append(
                f"predicted per rank ({pr.optimizer}, batch {pr.batch_size}): step "
                f"{pr.step_time_s * 1e3:.2f} ms (compute {pr.compute_s * 1e3:.2f}, communication "
                f"{pr.comm_s * 1e3:.2f}, optimizer {pr.optim_s * 1e3:.2f}); peak memory "
                f"{format_bytes(pr.peak_memory_bytes)} at {pr.peak_at}"
            )
            if pr.peak_by_category:
                first = (f"; first step {format_bytes(pr.first_step_peak_bytes)} (before the "
                         "optimizer state exists)" if pr.first_step_peak_bytes is not None else "")
                lines.append(f"peak memory by category: {pr.breakdown()}{first}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def explain(self, name: str) -> str:
        """Why one parameter group runs the way it does, and what that costs per step."""
        p = self[name]
        fwd, bwd = self.collectives_of(p)
        lines = [
            f"{p.name}: {p.strategy}" + (f" ({p.note})" if p.note else ""),
            f"  shape {tuple(p.shape)} {p.dtype}, {format_bytes(p.nbytes)} full",
            f"  forward:  {_describe_collectives(fwd)}",
            f"  backward: {_describe_collectives(bwd)}",
        ]
        if p.aliases:
            lines.append(f"  tied to: {', '.join(p.aliases)}")
        return "\n".join(lines)


def _element_size(dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise PlanError(f"unknown dtype {dtype_name!r} in the plan's mixed precision; use e.g. "
                        "'bfloat16', 'float16' or 'float32'")
    return dtype.itemsize


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _describe_collectives(stages: list[Stage]) -> str:
    return ", ".join(map(str, stages)) or "-"


def _describe_mesh(world_size: int, ranks_per_node: int | None) -> str:
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


def load_plan_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a plan file, raising PlanError with the fix when it is missing or malformed."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError as exc:
        raise PlanError(
            f"plan file {os.fspath(path)!r} does not exist; pass a strategy name "
            f"({', '.join(STRATEGIES)}), a Plan, or the path of a JSON plan saved with Plan.save"
        ) from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(
            f"plan file {os.fspath(path)!r} is not valid JSON ({exc}); see docs/plan-format.md"
        ) from exc
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise PlanError(
            f"plan file {os.fspath(path)!r} is not an osdp-fx plan: it needs "
            f'"format": "{PLAN_FORMAT}" and a "params" mapping; see docs/plan-format.md'
        )
    if data.get("version") != PLAN_VERSION:
        raise PlanError(
            f"plan file {os.fspath(path)!r} has version {data.get('version')!r}; this osdp-fx "
            f"reads version {PLAN_VERSION}: re-save the plan with this version"
        )
    if not isinstance(data.get("params", {}), Mapping):
        raise PlanError(f"plan file {os.fspath(path)!r}: \"params\" must map parameter names to "
                        'strategies, e.g. {"fc.weight": "full_shard"}')
    return data


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about one parameter group of the model."""

    name: str
    """Canonical name."""
    shape: tuple[int, ...]
    """Full shape."""
    dtype: str
    """Element type name, e.g. 'float32'."""
    element_size: int
    """Bytes per element."""
    aliases: tuple[str, ...]
    """Tied names."""
    trainable: bool
    """False for frozen or non-float parameters, which always stay replicated."""
    frozen: bool
    """requires_grad is False."""


def build_plan(
    requested: Mapping[str, str],
    specs: list[ParamSpec],
    *,
    world_size: int,
    memory_limit_bytes: int | None = None,
    source: str = "",
    splits: Mapping[str, int] | None = None,
    prefetch: int = DEFAULT_PREFETCH,
    ranks_per_node: int | None = None,
) -> Plan:
    """A Plan giving each parameter group its requested strategy (keyed by canonical name).

    Frozen and non-float parameters stay replicated whatever was asked; the plan notes why.
    """
    entries = []
    for s in specs:
        strategy = requested[s.name]
        note = ""
        if not s.trainable:
            strategy, note = REPLICATE, "frozen" if s.frozen else f"{s.dtype}, not float"
        entries.append(ParamPlan(
            name=s.name, strategy=strategy, shape=s.shape, dtype=s.dtype,
            element_size=s.element_size, aliases=s.aliases, note=note, trainable=s.trainable,
        ))
    return Plan(params=tuple(entries), world_size=world_size,
                memory_limit_bytes=memory_limit_bytes, source=source,
                splits=tuple(sorted((splits or {}).items())), prefetch=prefetch,
                ranks_per_node=ranks_per_node)


def resolve_plan(
    spec: str | os.PathLike[str] | Plan,
    specs: list[ParamSpec],
    *,
    world_size: int,
    ranks_per_node: int | None = None,
    memory_limit_bytes: int | None = None,
) -> Plan:
    """Turn what the user passed as ``plan=`` into a Plan for this model and world (of
    ``world_size`` ranks, ``ranks_per_node`` on each node; None: one node)."""
    by_any_name = {n: s.name for s in specs for n in (s.name, *s.aliases)}
    ranks_per_node = normalized_ranks_per_node(ranks_per_node, world_size)
    mesh = _describe_mesh(world_size, ranks_per_node)
    if isinstance(spec, Plan):
        requested = _requested_from_mapping(
            {p.name: p.strategy for p in spec.params}, by_any_name, None, "the Plan",
        )
        if spec.world_size != world_size:
            raise PlanError(
                f"the Plan was made for world size {spec.world_size} but this world has "
                f"{world_size} ranks; make a plan for {world_size} ranks"
            )
        uses_mesh = any(p.strategy in MESH_STRATEGIES for p in spec.params)
        if uses_mesh and spec.ranks_per_node != ranks_per_node:
            raise PlanError(
                f"the Plan was made for {_describe_mesh(world_size, spec.ranks_per_node)} but "
                f"this world is {mesh}, and its {HYBRID_SHARD}/{HIERARCHICAL} groups depend on "
                "the mesh: make a plan for this mesh, or describe the nodes you run on with "
                "Devices(ranks_per_node=...)"
            )
        return build_plan(requested, specs, world_size=world_size,
                          memory_limit_bytes=memory_limit_bytes, source=spec.source or "user",
                          splits=dict(spec.splits), prefetch=spec.prefetch,
                          ranks_per_node=ranks_per_node)
    if isinstance(spec, str) and spec in STRATEGIES:
        return build_plan({s.name: spec for s in specs}, specs, world_size=world_size,
                          memory_limit_bytes=memory_limit_bytes, source=spec,
                          ranks_per_node=ranks_per_node)
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        if not path.endswith(".json") and not os.path.exists(path):
            raise PlanError(
                f"unknown strategy {path!r}: use one of {', '.join(STRATEGIES)}, a Plan, or "
                "the path of a JSON plan file (ending in .json)"
            )
        data = load_plan_dict(path)
        file_world = data.get("world_size")
        if file_world is not None and (not isinstance(file_world, int) or isinstance(file_world, bool)):
            raise PlanError(f"plan file {path!r}: \"world_size\" must be an int, got "
                            f"{file_world!r}; fix it or remove it")
        if file_world is not None and file_world != world_size:
            raise PlanError(
                f"plan file {path!r} was made for world size {file_world} but this world has "
                f"{world_size} ranks; edit its \"world_size\" or remove it to use the plan at "
                "any world size"
            )
        file_per_node = data.get("ranks_per_node")
        if file_per_node is not None and (not isinstance(file_per_node, int)
                                          or isinstance(file_per_node, bool)):
            raise PlanError(f"plan file {path!r}: \"ranks_per_node\" must be an int, got "
                            f"{file_per_node!r}; fix it or remove it")
        if (file_per_node is not None
                and file_per_node not in (ranks_per_node, ranks_per_node or world_size)):
            raise PlanError(
                f"plan file {path!r} was made for {file_per_node} ranks per node but this world "
                f"is {mesh}; describe the nodes you run on with Devices(ranks_per_node="
                f"{file_per_node}) (or launch with torchrun --nproc-per-node {file_per_node}), "
                "or remove \"ranks_per_node\" from the file to use the plan on any mesh"
            )
        requested = _requested_from_mapping(
            data.get("params", {}), by_any_name, data.get("default"), f"plan file {path!r}",
            shapes={s.name: s.shape for s in specs},
        )
        return build_plan(requested, specs, world_size=world_size,
                          memory_limit_bytes=memory_limit_bytes, source=f"file:{path}",
                          splits=requested_splits(spec),
                          prefetch=data.get("prefetch", DEFAULT_PREFETCH),
                          ranks_per_node=ranks_per_node)
    raise PlanError(
        f"plan must be a strategy name ({', '.join(STRATEGIES)}), a Plan, or a path to a JSON "
        f"plan file; got {type(spec).__name__}"
    )


def requested_precision(spec: str | os.PathLike[str] | Plan | None) -> tuple[str, str] | None:
    """(param_dtype, reduce_dtype) names a Plan or plan file's "mixed_precision" asks for."""
    if isinstance(spec, Plan):
        return (spec.param_dtype, spec.reduce_dtype) if spec.param_dtype else None
    if spec is None or not isinstance(spec, (str, os.PathLike)) or (
            isinstance(spec, str) and spec in STRATEGIES):
        return None
    path = os.fspath(spec)
    if not path.endswith(".json") and not os.path.exists(path):
        return None
    mp = load_plan_dict(path).get("mixed_precision")
    if mp is None:
        return None
    if not isinstance(mp, Mapping) or not isinstance(mp.get("param_dtype"), str):
        raise PlanError(f"plan file {path!r}: \"mixed_precision\" must be like "
                        '{"param_dtype": "bfloat16", "reduce_dtype": "float32"}')
    names = (mp["param_dtype"], mp.get("reduce_dtype", "float32"))
    for name in names:
        _element_size(name)
    return names


def requested_splits(spec: str | os.PathLike[str] | Plan | None) -> dict[str, int]:
    """The linear splits a plan argument asks for (weight name -> parts); none for a strategy
    name or None."""
    if isinstance(spec, Plan):
        return dict(spec.splits)
    if spec is None or (isinstance(spec, str) and spec in STRATEGIES):
        return {}
    if not isinstance(spec, (str, os.PathLike)):
        return {}
    path = os.fspath(spec)
    if not path.endswith(".json") and not os.path.exists(path):
        return {}
    splits = load_plan_dict(path).get("splits", {})
    if not isinstance(splits, Mapping) or not all(
            isinstance(k, int) and not isinstance(k, bool) for k in splits.values()):
        raise PlanError(f"plan file {path!r}: \"splits\" must map linear weight names to a "
                        'number of parts, e.g. {"fc.weight": 4}')
    return dict(splits)


def _requested_from_mapping(
    entries: Mapping[str, Any],
    by_any_name: dict[str, str],
    default: str | None,
    where: str,
    *,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, str]:
    unknown = [n for n in entries if n not in by_any_name]
    if unknown:
        known = ", ".join(list(dict.fromkeys(by_any_name.values()))[:8])
        raise PlanError(
            f"{where} names parameters the model does not have: {', '.join(unknown[:8])}; "
            f"the model's parameters are named like: {known} ..."
        )
    requested: dict[str, str] = {}
    for name, entry in entries.items():
        strategy = entry.get("strategy") if isinstance(entry, Mapping) else entry
        if strategy not in STRATEGIES:
            raise PlanError(f"{where}: parameter {name!r} has unknown strategy {strategy!r}; "
                            f"use one of {', '.join(STRATEGIES)}")
        canon = by_any_name[name]
        if isinstance(entry, Mapping) and shapes is not None and "shape" in entry:
            shape = entry["shape"]
            if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
                raise PlanError(f"{where}: parameter {name!r} has \"shape\": {shape!r}; write "
                                "the shape as a list of ints, e.g. [768, 3072], or leave it out")
            if tuple(shape) != shapes[canon]:
                raise PlanError(
                    f"{where}: parameter {name!r} has shape {tuple(entry['shape'])} in the plan "
                    f"but {shapes[canon]} in the model; re-plan for this model"
                )
        if requested.get(canon, strategy) != strategy:
            raise PlanError(f"{where} gives tied names of {canon!r} different strategies; "
                            "tied parameters share one decision: give them the same strategy")
        requested[canon] = strategy
    if default is not None and default not in STRATEGIES:
        raise PlanError(f"{where}: default strategy {default!r} is unknown; "
                        f"use one of {', '.join(STRATEGIES)}")
    missing = [n for n in dict.fromkeys(by_any_name.values()) if n not in requested]
    if missing and default is None:
        raise PlanError(
            f"{where} gives no strategy for {len(missing)} parameters ({', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}); list them or add \"default\": \"full_shard\""
        )
    return {n: requested.get(n, default) for n in dict.fromkeys(by_any_name.values())}  # type: ignore[misc]

"""What the user passes as ``plan=``, read once, and how it becomes a :class:`~osdp_fx.plan.plan.Plan`.

``compile_osdp`` parses its ``plan=`` argument once into a :class:`PlanRequest` (a strategy name
for every parameter, a ``Plan``, the path of a JSON plan file, or None for the search); every
later step (the splits it names, its mixed precision, the strategies per parameter group) reads
the request, never the file again. The JSON format: ``docs/plan-format.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from ..core.buckets import Schedule
from ..core.regions import check_policy
from ..core.strategies import STRATEGIES, traits
from ..errors import PlanError
from .plan import (
    PLAN_FORMAT,
    PLAN_VERSION,
    ParamPlan,
    Plan,
    describe_mesh,
    element_size,
    normalized_ranks_per_node,
)

PlanSpec = Any
"""What ``plan=`` accepts: None, a strategy name, a Plan, a path, or a :class:`PlanRequest`."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """The user's ``plan=`` argument, read and checked once."""

    kind: str
    """'search' (None), 'uniform' (a strategy name), 'plan' (a Plan) or 'file' (a JSON file)."""
    strategy: str | None = None
    """The strategy of every parameter ('uniform')."""
    plan: Plan | None = None
    """The Plan given ('plan')."""
    path: str | None = None
    """The plan file's path ('file')."""
    data: Mapping[str, Any] | None = None
    """The plan file's contents, read once ('file')."""

    @classmethod
    def parse(cls, spec: PlanSpec) -> PlanRequest:
        """Read ``spec`` (a file once); raise PlanError naming the fix when it is malformed."""
        if isinstance(spec, PlanRequest):
            return spec
        if spec is None:
            return cls("search")
        if isinstance(spec, Plan):
            return cls("plan", plan=spec)
        if isinstance(spec, str) and spec in STRATEGIES:
            return cls("uniform", strategy=spec)
        if isinstance(spec, (str, os.PathLike)):
            path = os.fspath(spec)
            if not path.endswith(".json") and not os.path.exists(path):
                raise PlanError(
                    f"unknown strategy {path!r}: use one of {', '.join(STRATEGIES)}, a Plan, or "
                    "the path of a JSON plan file (ending in .json)"
                )
            request = cls("file", path=path, data=load_plan_dict(path))
            request.splits  # noqa: B018  (checked now, before any collective)
            request.precision  # noqa: B018
            request.recompute  # noqa: B018
            return request
        raise PlanError(
            f"plan must be a strategy name ({', '.join(STRATEGIES)}), a Plan, or a path to a JSON "
            f"plan file; got {type(spec).__name__}"
        )

    @property
    def splits(self) -> dict[str, int]:
        """The linear splits it asks for (weight name -> parts)."""
        if self.plan is not None:
            return dict(self.plan.splits)
        if self.data is None:
            return {}
        splits = self.data.get("splits", {})
        if not isinstance(splits, Mapping) or not all(
                isinstance(k, int) and not isinstance(k, bool) for k in splits.values()):
            raise PlanError(f"plan file {self.path!r}: \"splits\" must map linear weight names "
                            'to a number of parts, e.g. {"fc.weight": 4}')
        return dict(splits)

    @property
    def precision(self) -> tuple[str, str] | None:
        """(param_dtype, reduce_dtype) names of the mixed precision it asks for, if any."""
        if self.plan is not None:
            return (self.plan.param_dtype, self.plan.reduce_dtype) if self.plan.param_dtype else None
        if self.data is None:
            return None
        mp = self.data.get("mixed_precision")
        if mp is None:
            return None
        if not isinstance(mp, Mapping) or not isinstance(mp.get("param_dtype"), str):
            raise PlanError(f"plan file {self.path!r}: \"mixed_precision\" must be like "
                            '{"param_dtype": "bfloat16", "reduce_dtype": "float32"}')
        names = (mp["param_dtype"], mp.get("reduce_dtype", "float32"))
        for name in names:
            element_size(name)
        return names


    @property
    def recompute(self) -> dict[str, str]:
        """The regions it recomputes (module path -> 'selective' or 'full')."""
        if self.plan is not None:
            return dict(self.plan.recompute)
        if self.data is None:
            return {}
        regions = self.data.get("recompute", {})
        if not isinstance(regions, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in regions.items()):
            raise PlanError(f"plan file {self.path!r}: \"recompute\" must map region names "
                            'to a policy, e.g. {"model.blocks.0": "selective"}')
        for region, policy in regions.items():
            check_policy(policy, where=f"plan file {self.path!r}, region {region!r}")
        return dict(regions)


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
    """False for frozen parameters (integer ones among them): no gradient, no optimizer
    state."""
    frozen: bool
    """requires_grad is False."""
    format: str = ""
    """The storage format of a quantized weight's tensor ("nf4, bitsandbytes"), else ""."""


def build_plan(
    requested: Mapping[str, str],
    specs: list[ParamSpec],
    *,
    world_size: int,
    memory_limit_bytes: int | None = None,
    source: str = "",
    splits: Mapping[str, int] | None = None,
    schedule: Schedule = Schedule(),
    ranks_per_node: int | None = None,
    recompute: Mapping[str, str] | None = None,
) -> Plan:
    """A Plan giving each parameter group its requested strategy (keyed by canonical name),
    recomputing the regions ``recompute`` names.

    Frozen parameters (packed integer ones too) take the strategy asked (gathered, never
    reduced), noted "frozen" (and a quantized weight's format: "frozen, nf4, bitsandbytes").
    """
    entries = []
    for s in specs:
        note = ", ".join(x for x in ("frozen" if s.frozen else "", s.format) if x)
        entries.append(ParamPlan(
            name=s.name, strategy=requested[s.name], shape=s.shape, dtype=s.dtype,
            element_size=s.element_size, aliases=s.aliases, note=note, trainable=s.trainable,
        ))
    return Plan(params=tuple(entries), world_size=world_size,
                memory_limit_bytes=memory_limit_bytes, source=source,
                splits=tuple(sorted((splits or {}).items())), schedule=schedule,
                ranks_per_node=ranks_per_node,
                recompute=tuple((recompute or {}).items()))


def resolve_plan(
    spec: PlanSpec,
    specs: list[ParamSpec],
    *,
    world_size: int,
    ranks_per_node: int | None = None,
    memory_limit_bytes: int | None = None,
) -> Plan:
    """Turn what the user passed as ``plan=`` (or its :class:`PlanRequest`) into a Plan for this
    model and world (of ``world_size`` ranks, ``ranks_per_node`` on each node; None: one
    node)."""
    request = PlanRequest.parse(spec)
    by_any_name = {n: s.name for s in specs for n in (s.name, *s.aliases)}
    ranks_per_node = normalized_ranks_per_node(ranks_per_node, world_size)
    mesh = describe_mesh(world_size, ranks_per_node)
    if request.plan is not None:
        spec = request.plan
        requested = _requested_from_mapping(
            {p.name: p.strategy for p in spec.params}, by_any_name, None, "the Plan",
        )
        if spec.world_size != world_size:
            raise PlanError(
                f"the Plan was made for world size {spec.world_size} but this world has "
                f"{world_size} ranks; make a plan for {world_size} ranks"
            )
        uses_mesh = any(traits(p.strategy).needs_mesh for p in spec.params)
        if uses_mesh and spec.ranks_per_node != ranks_per_node:
            raise PlanError(
                f"the Plan was made for {describe_mesh(world_size, spec.ranks_per_node)} but "
                f"this world is {mesh}, and its hybrid_shard/hierarchical groups depend on "
                "the mesh: make a plan for this mesh, or describe the nodes you run on with "
                "Devices(world_size=..., ranks_per_node=...)"
            )
        return build_plan(requested, specs, world_size=world_size,
                          memory_limit_bytes=memory_limit_bytes, source=spec.source or "user",
                          splits=dict(spec.splits), schedule=spec.schedule,
                          ranks_per_node=ranks_per_node, recompute=dict(spec.recompute))
    if request.strategy is not None:
        return build_plan({s.name: request.strategy for s in specs}, specs,
                          world_size=world_size, memory_limit_bytes=memory_limit_bytes,
                          source=request.strategy, ranks_per_node=ranks_per_node)
    if request.data is None:
        raise PlanError("resolve_plan needs a plan, not a search (plan=None); "
                        "planner.make.plan_model runs the search")
    path, data = request.path, request.data
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
            f"is {mesh}; describe the nodes you run on with Devices(world_size=..., "
            f"ranks_per_node={file_per_node}) (or launch with torchrun --nproc-per-node {file_per_node}), "
            "or remove \"ranks_per_node\" from the file to use the plan on any mesh"
        )
    requested = _requested_from_mapping(
        data.get("params", {}), by_any_name, data.get("default"), f"plan file {path!r}",
        shapes={s.name: s.shape for s in specs},
    )
    return build_plan(requested, specs, world_size=world_size,
                      memory_limit_bytes=memory_limit_bytes, source=f"file:{path}",
                      splits=request.splits, schedule=Schedule.from_dict(data),
                      ranks_per_node=ranks_per_node, recompute=request.recompute)


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

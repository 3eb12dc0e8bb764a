"""Memory cost model: bytes per rank of one parameter group under each strategy.

For a group of ``numel`` elements of ``element_size`` bytes over ``N`` ranks (``R`` per node),
with ``P = numel * element_size`` (parameter), ``G = P`` (gradient, same dtype) and ``O`` the
optimizer state (fp32: ``states * numel * 4``), the persistent bytes per rank are

==================  =======================  ================================================
strategy            persistent per rank      notes
==================  =======================  ================================================
``replicate``       ``P + G + O``            gradients all-reduced
``shard_grad_op``   ``P + (G + O) / N``      full parameter kept from forward to backward
``full_shard``      ``(P + G + O) / N``      gathered before use, freed after
``hybrid_shard``    ``(P + G + O) / R``      sharded in the node, replicated across nodes
``hierarchical``    ``(P + G + O) / N``      full_shard with two-stage collectives
==================  =======================  ================================================

where ``X / N`` is one shard: ``ceil(rows / N)`` rows of the parameter (a flat shard of whole
rows, padded so every rank holds the same size; ``core/layout.py``; :func:`~osdp_fx.plan.plan.shard_count` gives the number of shards). A sharded group also needs, for a while, the gathered (padded) parameter:
:func:`gathered_param_bytes`; and its full gradient before the reduce-scatter:
:func:`unsharded_grad_bytes`. Where these transients fall on the step's memory timeline is the
search's business; this module only prices them.
"""

from __future__ import annotations

import dataclasses

from ..core.layout import shard_count
from ..core.layout import shard_numel as layout_shard_numel
from ..core.strategies import STRATEGIES, Strategy, traits
from ..errors import InputError, PlanError

__all__ = [
    "OPTIMIZER_STATES",
    "STRATEGIES",
    "ParamMemory",
    "Strategy",
    "gathered_param_bytes",
    "optimizer_state_bytes",
    "param_memory",
    "persistent_bytes",
    "shard_numel",
    "unsharded_grad_bytes",
]


OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
"""fp32 tensors of optimizer state per parameter, by optimizer kind."""

_STATE_ELEMENT_SIZE = 4  # optimizer state is kept in fp32

STEP_COUNTER_BYTES: dict[str, int] = {"adam": 4, "adamw": 4}
"""Bytes of the step counter torch.optim keeps per parameter, by optimizer kind: Adam's
``state["step"]``, a float32 scalar tensor."""


def _check_sizes(numel: int, world_size: int) -> None:
    if numel < 0:
        raise InputError(f"a parameter group cannot have {numel} elements")
    if world_size < 1:
        raise InputError(f"world_size must be at least 1, got {world_size}")


def shard_numel(numel: int, world_size: int, row: int = 1) -> int:
    """Elements of one rank's shard: ``ceil(rows / world_size)`` rows of ``row`` elements (the
    last shards are padded)."""
    _check_sizes(numel, world_size)
    return layout_shard_numel(numel, world_size, row)


def optimizer_state_bytes(numel: int, *, optimizer: str) -> int:
    """Bytes of optimizer state for one parameter of ``numel`` elements ('sgd': 0,
    'sgd_momentum': one fp32 copy, 'adam'/'adamw': two and the step counter)."""
    if optimizer not in OPTIMIZER_STATES:
        raise InputError(
            f"unknown optimizer kind {optimizer!r}: use one of {', '.join(OPTIMIZER_STATES)}"
        )
    return (OPTIMIZER_STATES[optimizer] * numel * _STATE_ELEMENT_SIZE
            + (STEP_COUNTER_BYTES.get(optimizer, 0) if numel else 0))


@dataclasses.dataclass(frozen=True)
class ParamMemory:
    """Bytes one rank holds for one parameter group under one strategy."""

    param_bytes: int
    """Parameter (full, or one shard) kept across steps."""
    grad_bytes: int
    """Gradient (full, or one shard) kept after backward until the optimizer step."""
    optimizer_bytes: int
    """Optimizer state (full, or one shard)."""
    gathered_bytes: int
    """Transient: the gathered (padded) parameter while in use; 0 when replicated."""

    @property
    def persistent_bytes(self) -> int:
        """Parameter + gradient + optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def param_memory(
    numel: int,
    *,
    element_size: int = 4,
    strategy: str,
    world_size: int,
    optimizer: str = "adamw",
    ranks_per_node: int | None = None,
    row: int = 1,
) -> ParamMemory:
    """Memory per rank of a group of ``numel`` elements in rows of ``row`` under ``strategy``
    (see module table), on ``world_size`` ranks of which ``ranks_per_node`` (None: all) share a
    node."""
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    _check_sizes(numel, world_size)
    chunks = shard_count(strategy, world_size, ranks_per_node)
    shard = shard_numel(numel, chunks, row)
    full_bytes = numel * element_size
    shard_bytes = shard * element_size
    full_state = optimizer_state_bytes(numel, optimizer=optimizer)
    shard_state = optimizer_state_bytes(shard, optimizer=optimizer)
    t = traits(strategy)
    if not t.sharded:
        return ParamMemory(full_bytes, full_bytes, full_state, 0)
    gathered = gathered_param_bytes(numel, element_size=element_size, world_size=chunks,
                                    row=row)
    if t.keeps_gathered:
        return ParamMemory(full_bytes, shard_bytes, shard_state, gathered)
    return ParamMemory(shard_bytes, shard_bytes, shard_state, gathered)


def persistent_bytes(
    numel: int,
    *,
    element_size: int = 4,
    strategy: str,
    world_size: int,
    optimizer: str = "adamw",
    ranks_per_node: int | None = None,
    row: int = 1,
) -> int:
    """Persistent bytes per rank (parameter + gradient + optimizer state) under ``strategy``."""
    return param_memory(
        numel, element_size=element_size, strategy=strategy, world_size=world_size,
        optimizer=optimizer, ranks_per_node=ranks_per_node, row=row,
    ).persistent_bytes


def gathered_param_bytes(numel: int, *, element_size: int = 4, world_size: int,
                         row: int = 1) -> int:
    """Bytes of a gathered parameter: ``world_size`` padded shards of rows of ``row`` elements
    (for hybrid_shard pass its shard count, the ranks per node)."""
    return world_size * shard_numel(numel, world_size, row) * element_size


def unsharded_grad_bytes(numel: int, *, element_size: int = 4, world_size: int,
                         row: int = 1) -> int:
    """Bytes of a sharded group's full gradient before it is reduce-scattered (padded)."""
    return gathered_param_bytes(numel, element_size=element_size, world_size=world_size, row=row)

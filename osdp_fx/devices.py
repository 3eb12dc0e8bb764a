"""Devices: what the cluster looks like, for planning and cost models."""

from __future__ import annotations

import dataclasses

from .errors import InputError
from .units import parse_bytes

DEFAULT_CPU_MEMORY_BYTES = 4 * 2**30
"""Memory limit per rank assumed on CPU when none is given (documented in docs/)."""


@dataclasses.dataclass(frozen=True)
class Devices:
    """The devices a plan is made for. Figures are per rank unless a name says otherwise."""

    world_size: int = 1
    """Number of ranks (processes, one device each)."""
    ranks_per_node: int | None = None
    """Ranks that share a node's fast links; None means all ranks are on one node."""
    memory_bytes: int | None = None
    """Memory limit per rank for parameters, gradients, optimizer state and activations."""
    compute_flops_per_s: float = 1e11
    """Sustained dense matmul throughput of one device."""
    memory_bandwidth_bytes_per_s: float = 2e10
    """Device memory bandwidth (for the roofline of memory-bound operators)."""
    intra_node_bandwidth_bytes_per_s: float = 5e9
    """Per-rank bus bandwidth of collectives inside a node."""
    intra_node_latency_s: float = 5e-5
    """Fixed cost of one collective step inside a node."""
    inter_node_bandwidth_bytes_per_s: float = 1.25e9
    """Per-rank bus bandwidth of collectives across nodes."""
    inter_node_latency_s: float = 1e-4
    """Fixed cost of one collective step across nodes."""

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise InputError(f"Devices.world_size must be a positive int, got {self.world_size!r}")
        if self.ranks_per_node is not None and (
            self.ranks_per_node < 1 or self.world_size % self.ranks_per_node
        ):
            raise InputError(
                f"Devices.ranks_per_node={self.ranks_per_node} must divide world_size="
                f"{self.world_size}; set it to the number of ranks on each node"
            )
        if self.memory_bytes is not None:
            object.__setattr__(self, "memory_bytes", parse_bytes(self.memory_bytes))

    @property
    def num_nodes(self) -> int:
        return self.world_size // (self.ranks_per_node or self.world_size)

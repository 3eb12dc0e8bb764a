"""Compute cost model: time of a node's forward and backward on one device.

Where the profile pass measured a node (``NodeProfile.fwd_time_s``/``bwd_time_s`` not None) the
measurement is used; otherwise (``fake=True`` profiles, or hardware one plans for but does not
have) a roofline whose two terms add ([Note: an additive roofline])::

    time_s = flops / devices.flops_per_s(dtype) + bytes / devices.memory_bandwidth_bytes_per_s

where ``dtype`` is the dtype the node computes in (``NodeProfile.compute_dtype``):
``Devices.compute_flops_per_s_by_dtype`` gives tensor-core throughputs (a hardware preset, e.g.
``Devices.preset("h100-sxm-8x")``, fills it from datasheets), ``compute_flops_per_s`` the
rest. The bytes a node moves are estimated from its profile:

- forward: inputs read + outputs written (0 for a view, which moves nothing);
- backward: output gradients read + tensors saved for it read + input gradients written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:
    from ..core.devices import Devices
    from ..core.node_meta import NodeProfile

__all__ = [
    "CALL_OPS",
    "ComputeTime",
    "backward_bytes",
    "forward_bytes",
    "node_compute_time_s",
    "roofline_time_s",
    "total_compute_time_s",
]

CALL_OPS = ("call_function", "call_method", "call_module")
"""The fx node kinds that run an operator."""


@dataclasses.dataclass(frozen=True)
class ComputeTime:
    """Predicted compute time of one node (or a sum of nodes) for one training step."""

    fwd_s: float
    """Forward time."""
    bwd_s: float
    """Backward time."""
    measured: bool
    """True when both times come from measurement, False when any is a roofline estimate."""

    @property
    def step_s(self) -> float:
        """Forward plus backward."""
        return self.fwd_s + self.bwd_s


# [Note: an additive roofline]
# An operator's arithmetic and its memory traffic are added, not overlapped: ``flops / FLOP/s +
# bytes / bandwidth``, where the textbook roofline takes the larger. Far from the ridge point
# (FLOP/s over bandwidth, about 300 FLOPs per byte on an H100 in bf16) the two agree: a large
# matmul is its arithmetic, an elementwise operator its traffic. Near the ridge, where the
# linears of a small transformer sit (d = 768 over 16 Ki tokens: 370 FLOPs per byte), the
# maximum credits the kernel with its peak rate, which measured matmuls there do not reach;
# the sum gives it about half. Against llm-foundry's published MPT runs
# (``benchmarks/published.py``) the maximum predicted small models too fast, the smaller the
# more; the sum closes most of that gap with nothing fitted (the figures: ``docs/benchmarks.md``,
# "Every published llm-foundry FSDP row"). A measured node (the profile's time) is not a
# roofline and is taken as measured.
def roofline_time_s(flops: float, bytes_moved: float, devices: Devices, *,
                    dtype: str = "", efficiency: float = 1.0) -> float:
    """``flops / compute throughput + bytes / memory bandwidth`` on one device of ``devices``,
    at ``efficiency`` times the throughput of ``dtype`` (a torch dtype name; '' for the
    default): [Note: an additive roofline]."""
    if devices.compute_flops_per_s <= 0 or devices.memory_bandwidth_bytes_per_s <= 0:
        raise InputError(
            f"Devices.compute_flops_per_s ({devices.compute_flops_per_s}) and "
            f"memory_bandwidth_bytes_per_s ({devices.memory_bandwidth_bytes_per_s}) must be "
            f"positive: fix them, or measure them with detect_devices()"
        )
    return (flops / (devices.flops_per_s(dtype) * efficiency)
            + bytes_moved / devices.memory_bandwidth_bytes_per_s)


def forward_bytes(profile: NodeProfile) -> int:
    """Bytes the node's forward moves: inputs read and outputs written; 0 for a view."""
    if profile.output_is_view:
        return 0
    return profile.input_bytes + profile.output_bytes


def backward_bytes(profile: NodeProfile) -> int:
    """Bytes the node's backward moves: output grads and saved tensors read, input grads written."""
    if profile.output_is_view or (profile.grad_input_bytes == 0 and profile.bwd_flops == 0):
        return 0
    return profile.output_bytes + profile.saved_bytes + profile.grad_input_bytes


def node_compute_time_s(profile: NodeProfile | None, devices: Devices) -> ComputeTime:
    """Forward and backward time of a profiled node: measured where known, roofline otherwise."""
    if profile is None:
        raise InputError(
            "a node has no profile: run passes.profile.profile_graph_pass on the graph before "
            "asking the compute cost model for its time"
        )
    fwd_s = profile.fwd_time_s
    bwd_s = profile.bwd_time_s
    measured = fwd_s is not None and bwd_s is not None
    dtype = profile.compute_dtype
    efficiency = devices.attention_efficiency if profile.attention else 1.0
    if fwd_s is None:
        fwd_s = roofline_time_s(profile.fwd_flops, forward_bytes(profile), devices, dtype=dtype,
                                efficiency=efficiency)
    if bwd_s is None:
        bwd_s = roofline_time_s(profile.bwd_flops, backward_bytes(profile), devices, dtype=dtype,
                                efficiency=efficiency)
    return ComputeTime(fwd_s=fwd_s, bwd_s=bwd_s, measured=measured)


def total_compute_time_s(profiles: Iterable[NodeProfile | None], devices: Devices) -> ComputeTime:
    """Sum of :func:`node_compute_time_s` over nodes (a step that overlaps nothing)."""
    times = [node_compute_time_s(p, devices) for p in profiles]
    return ComputeTime(
        fwd_s=sum(t.fwd_s for t in times),
        bwd_s=sum(t.bwd_s for t in times),
        measured=all(t.measured for t in times),
    )

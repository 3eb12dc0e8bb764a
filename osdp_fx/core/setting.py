"""What a training step is: the one record every layer that predicts or plans a step reads.

A :class:`StepSetting` is built once, at the front door (``planner/entry.py``, which both
``compile_osdp`` and ``python -m osdp_fx plan`` call), checked there, and passed whole: a function
takes it, or the one field it needs. The searches vary what they search (a candidate schedule, a
candidate batch size) with ``dataclasses.replace``; everything else stays as the user asked.
Torch-light (a dtype in the precision).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import InputError
from .buckets import DEFAULT_SCHEDULE, Schedule
from .devices import OPTIMIZERS, Devices
from .precision import MixedPrecision


@dataclasses.dataclass(frozen=True)
class StepSetting:
    """One step of data-parallel training, as the cost models predict it and the searches plan
    for it (the meaning of each field is that of ``compile_osdp``'s argument of that name)."""

    devices: Devices
    """The hardware and world: ranks, mesh, memory limit per rank, rates (``core/devices.py``)."""
    optimizer: str = "adamw"
    """The optimizer kind whose state and step time are predicted (one of ``OPTIMIZERS``)."""
    precision: MixedPrecision | None = None
    """Mixed precision the graph computes in (None: the parameters' own dtypes)."""
    batch_size: int | None = None
    """Per-rank batch size of the step; None: the one the model is planned for (the example's,
    or ``max_shape``'s)."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step, all but the last inside ``no_sync()``."""
    schedule: Schedule = DEFAULT_SCHEDULE
    """When collectives start and how they are fused."""

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer)
        check_grad_accumulation(self.grad_accumulation)
        if self.batch_size is not None and (
                isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int)
                or self.batch_size < 1):
            raise InputError(f"batch sizes must be positive ints, got {self.batch_size!r}")

    @property
    def memory_limit_bytes(self) -> int:
        """The per-rank memory limit plans are made under (the devices', filled in by
        ``planner.detect.devices_for``)."""
        assert self.devices.memory_bytes is not None, "devices_for fills the memory limit"
        return self.devices.memory_bytes

    def with_schedule(self, schedule: Schedule) -> StepSetting:
        return dataclasses.replace(self, schedule=schedule)

    def at_batch(self, batch_size: int | None) -> StepSetting:
        return dataclasses.replace(self, batch_size=batch_size)


def check_grad_accumulation(grad_accumulation: Any) -> None:
    """Raise InputError unless ``grad_accumulation`` is an int >= 1."""
    if (isinstance(grad_accumulation, bool) or not isinstance(grad_accumulation, int)
            or grad_accumulation < 1):
        raise InputError(
            f"grad_accumulation={grad_accumulation!r} is not a number of micro-batches: pass an "
            "int >= 1, the micro-batches each optimizer step accumulates gradients over (all "
            "but the last run inside compiled.no_sync()); 1 means no accumulation")


def check_optimizer(optimizer: str) -> None:
    """Raise InputError unless ``optimizer`` is a kind the cost models know."""
    if optimizer not in OPTIMIZERS:
        raise InputError(f"optimizer {optimizer!r} is not a kind the cost models know; use one "
                         f"of {', '.join(OPTIMIZERS)} (the closest to your optimizer)")

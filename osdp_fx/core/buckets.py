"""Bucketing rules: which collectives are fused into one, and how many may be in flight.

The runtime (``runtime/reducer.py``, ``runtime/params.py``, the shard pass) applies these rules
and the cost models (``cost_models/step.py``, ``cost_models/timeline.py``) predict with the same
ones, so both read them here. Torch-free.

* Replicated gradients are all-reduced in flat buckets of at most :data:`DEFAULT_BUCKET_BYTES`
  per dtype, filled in reverse parameter order (about the order backward produces them), DDP's
  way (:func:`plan_buckets`).
* Consecutive sharded parameters share one all-gather and one reduce-scatter while their
  gathered bytes add up to at most the schedule's ``gather_bucket_bytes``; runs of small ones
  (at most :data:`SMALL_PARAM_BYTES` each) share one at any length (:func:`gather_buckets`).
  A bucket with a parameter that is not small never spans two repeated blocks
  (:func:`block_of`), as FSDP2 gathers one module's parameters: one block's recomputation or
  backward re-gathers that block and no part of the next.
* At most :data:`MAX_IN_FLIGHT` gradient collectives (reduce-scatters, all-reduce buckets) run at
  once: starting one more first completes the oldest.

A plan's :class:`Schedule` (prefetch distance, the two bucket sizes) sets these per plan; the
search chooses it among :func:`candidate_schedules` (``search.search_schedules``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ..errors import PlanError

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Bytes of one all-reduce bucket of replicated gradients (DDP's default)."""

SMALL_PARAM_BYTES = 64 * 1024
"""Consecutive sharded parameters whose gathered size is at most this share one all-gather and
one reduce-scatter (``runtime.params.all_gather_params``), whatever the schedule's bucket size;
the default ``gather_bucket_bytes``."""

LARGE_GATHER_BUCKET_BYTES = 2**20
"""The larger fixed gather bucket the search (and a named plan's schedule) tries: 1 MiB."""

MAX_IN_FLIGHT = 2
"""Gradient collectives (reduce-scatters, all-reduce buckets) that may run at once."""

DEFAULT_PREFETCH = 1
"""All-gathers start this many sharded parameters ahead of their use, unless a plan says."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When collectives start and how they are fused: part of a plan, searched with it."""

    prefetch: int = DEFAULT_PREFETCH
    """How many sharded parameters (gather buckets) ahead each all-gather starts, in forward
    and in backward (0: each is gathered when it is needed)."""
    gather_bucket_bytes: int = SMALL_PARAM_BYTES
    """Consecutive sharded parameters of at most this many gathered bytes in all share one
    all-gather and one reduce-scatter (:func:`gather_buckets`)."""
    reduce_bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Bytes of one all-reduce bucket of replicated gradients (:func:`plan_buckets`)."""
    scatters_in_flight: int = MAX_IN_FLIGHT
    """Gradient collectives (reduce-scatters, all-reduce buckets) that may run at once:
    starting one more first completes the oldest. 1 holds one block's gradient buffers at a
    time where a gather bucket is a whole block, as FSDP2 does."""

    def __post_init__(self) -> None:
        """Raise PlanError for a value the runtime cannot run (a plan file's, a user's)."""
        if not _is_int(self.prefetch) or self.prefetch < 0:
            raise PlanError(f"prefetch must be an int >= 0 (all-gathers start that many sharded "
                            f"parameters ahead; 0 turns prefetching off), got {self.prefetch!r}")
        for name in ("gather_bucket_bytes", "reduce_bucket_bytes"):
            nbytes = getattr(self, name)
            if not _is_int(nbytes) or nbytes < 1:
                raise PlanError(f"{name} must be a number of bytes >= 1 (an int), got {nbytes!r}")
        if not _is_int(self.scatters_in_flight) or self.scatters_in_flight < 1:
            raise PlanError(f"scatters_in_flight={self.scatters_in_flight!r}: give an int >= 1 "
                            f"(how many gradient collectives may run at once; default "
                            f"{MAX_IN_FLIGHT})")

    def to_dict(self) -> dict[str, int]:
        """The plan file's fields of this schedule: ``prefetch`` always, the others when not
        the defaults (so that older plans keep their hash)."""
        return {"prefetch": self.prefetch, **{
            f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.name != "prefetch" and getattr(self, f.name) != f.default}}

    @classmethod
    def from_dict(cls, data: Any) -> Schedule:
        """The schedule of a plan file's fields (what it leaves out is the default: older
        files name none, or only ``prefetch``), checked."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


DEFAULT_SCHEDULE = Schedule()
"""The schedule of a plan that names none (the cost models' default argument)."""


def candidate_schedules(prefetch: int | None = None,
                        block_bytes: int | None = None) -> list[Schedule]:
    """The schedules the search tries (the default first): prefetch 0, 1 or 2 (or only
    ``prefetch`` when the user fixed it), gather buckets of 64 KiB (small parameters only),
    1 MiB, or ``block_bytes`` when given (the most bytes one transformer block gathers: one
    all-gather per block, as FSDP2 groups a block's parameters), all-reduce buckets of 25 MiB
    or 4 MiB; with block buckets also one gradient collective in flight instead of
    :data:`MAX_IN_FLIGHT` (each holds a block's flat gradient and its shard). Each costs memory
    (a deeper prefetch holds more gathered parameters, a larger bucket a larger flat buffer,
    more collectives in flight more buffers) and saves time (overlap, latency; a bucket's
    members pay for copying through its flat buffers)."""
    depths = [DEFAULT_PREFETCH, 0, 2] if prefetch is None else [prefetch]
    gathers = [SMALL_PARAM_BYTES, LARGE_GATHER_BUCKET_BYTES]
    if block_bytes is not None and block_bytes > LARGE_GATHER_BUCKET_BYTES:
        gathers.append(block_bytes)
    return [Schedule(d, g, r, f) for d in depths for g in gathers
            for r in (DEFAULT_BUCKET_BYTES, 4 * 2**20)
            for f in ((MAX_IN_FLIGHT, 1) if g == block_bytes else (MAX_IN_FLIGHT,))]


def plan_buckets(sizes: Sequence[tuple[Any, int]], bucket_bytes: int) -> list[list[int]]:
    """Group tensors, given as (dtype, bytes) in order, into buckets of one dtype and at most
    ``bucket_bytes`` (a larger tensor gets a bucket of its own). Returns index lists."""
    buckets: list[list[int]] = []
    open_bucket: dict[Any, tuple[list[int], int]] = {}
    for i, (dtype, nbytes) in enumerate(sizes):
        bucket, filled = open_bucket.get(dtype, (None, 0))
        if bucket is None or filled + nbytes > bucket_bytes:
            bucket, filled = [], 0
            buckets.append(bucket)
        bucket.append(i)
        open_bucket[dtype] = (bucket, filled + nbytes)
    return buckets


_BLOCK = re.compile(r"^(.+?\.\d+)\.")


def block_of(param: str) -> str | None:
    """The repeated block a parameter belongs to: the outermost indexed submodule in its name
    (``layers.3`` of ``layers.3.mlp.fc1.weight``, ``model.layers.3`` in a Hugging Face model,
    as ``regions.region_of`` finds a region), None outside any (embeddings, final norm, head).
    A gather bucket with a parameter that is not small stays within one block."""
    match = _BLOCK.match(param)
    return match.group(1) if match else None


def gather_buckets(sizes: list[tuple[Any, int]], bucket_bytes: int = SMALL_PARAM_BYTES,
                   blocks: Sequence[str | None] | None = None,
                   frozen: Sequence[bool] | None = None,
                   owners: Sequence[Any] | None = None) -> list[list[int]]:
    """Which consecutive gathers share one collective, given each gather's (key, bytes) in graph
    order and its block (:func:`block_of`; None: no blocks). A parameter joins the bucket of the
    gather before it when their keys (strategy, group, dtypes) agree and either

    * it is of the bucket's block and the bucket then holds at most ``bucket_bytes`` in all (a
      whole transformer block in one all-gather and one reduce-scatter, as FSDP2 groups a
      module's parameters; its members' gradients are copied into the bucket's flat buffer), or
    * it and every member are small (at most :data:`SMALL_PARAM_BYTES`; such runs, biases and
      norm weights, are short, and their copies cost nothing next to a collective's latency;
      they may span blocks) and all are frozen or all trainable (``frozen``, per gather; None:
      all trainable): the frozen and trainable parameters of a block share its bucket, but a
      run of small ones stops where frozen and trainable ones alternate (in a small model, a
      LoRA's every weight is small: the run would be the whole model, gathered at once).

    * it has the same owner as the gather before it (``owners``, per gather; None: none): the
      tensors of one packed quantized weight (its packed bytes and its scales, read by one
      operator: ``passes/quantized.py``) are gathered in one collective whatever their size.

    So a bucket holding a parameter that is not small never spans two blocks. Returns index
    lists."""
    block = list(blocks) if blocks is not None else [None] * len(sizes)
    is_frozen = list(frozen) if frozen is not None else [False] * len(sizes)
    owner = list(owners) if owners is not None else [None] * len(sizes)
    buckets: list[list[int]] = []
    total, small, kinds = 0, False, set()
    for i, (key, nbytes) in enumerate(sizes):
        joins = buckets and sizes[buckets[-1][0]][0] == key and (
            (block[buckets[-1][0]] == block[i] and total + nbytes <= bucket_bytes)
            or (small and nbytes <= SMALL_PARAM_BYTES and kinds == {is_frozen[i]})
            or (owner[i] is not None and owner[i] == owner[buckets[-1][-1]]))
        if joins:
            buckets[-1].append(i)
            total += nbytes
            small = small and nbytes <= SMALL_PARAM_BYTES
            kinds.add(is_frozen[i])
        else:
            buckets.append([i])
            total, small, kinds = nbytes, nbytes <= SMALL_PARAM_BYTES, {is_frozen[i]}
    return buckets

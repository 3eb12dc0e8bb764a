"""What the searches return: named records, not tuples.

:class:`Found` is one searched plan (``search.search_plan``, ``exhaustive.exhaustive_search``);
:class:`Ranked` is such a plan under a schedule with its predicted step time, the items of
``search.search_schedules``, ``search_margin.search_beyond_margin`` and
``schedule_search.rank_schedules``; :class:`BatchChoice` is ``search.search_batch_size``'s
answer.
"""

from __future__ import annotations

import dataclasses

from ..core.buckets import Schedule


@dataclasses.dataclass(frozen=True)
class Found:
    """A searched plan: what each parameter group and each recomputable region does."""

    strategies: dict[str, str]
    """Strategy per parameter group."""
    recompute: dict[str, str]
    """Policy per recomputed region ("full" or "selective"); regions saved are absent."""


@dataclasses.dataclass(frozen=True)
class Ranked:
    """A searched plan under one schedule, with the step time it is ranked by."""

    step_s: float
    """Predicted seconds of one step (the step model's, at the batch the search plans for)."""
    schedule: Schedule
    """Prefetch distance, bucket sizes and gradient collectives in flight."""
    found: Found
    """The strategies and recomputed regions."""


@dataclasses.dataclass(frozen=True)
class BatchChoice:
    """The per-rank batch size the batch search chose and the strategies found at it."""

    batch_size: int
    """Per-rank batch size."""
    strategies: dict[str, str]
    """Strategy per parameter group (nothing recomputed)."""

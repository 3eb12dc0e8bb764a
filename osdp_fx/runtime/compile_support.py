"""How the runtime composes with ``torch.compile``: the compute between collectives is compiled.

[Note: torch.compile]
``torch.compile(compiled)`` (or ``compiled.compile()``) hands dynamo the rewritten graph
module's forward; ``OSDPModule.forward`` itself, which sets up the step's runtime state, runs
eagerly. The collectives of that graph (the all-gather and prefetch calls) are marked
:func:`eager`, so dynamo breaks the graph at each and runs it as is: inductor compiles the
compute between two collectives, one region at a time, and each region's backward is one
compiled node of the autograd graph between the gathers' own backward nodes (which start the
reduce-scatters) and the hooks of the replicated parameters (which start their all-reduces).
Everything that makes the plan's memory and overlap hold stays the runtime's own, outside the
compiled code: asynchronous gathers waited for where the graph needs them, saved-tensor hooks
that keep a handle instead of a gathered full_shard parameter (they see the tensors a compiled
region saves like any other), re-gathers and prefetches in backward, bounded reduce-scatters and
bucketed all-reduces.

A ``free_param`` call inside a region cannot run in the middle of compiled code: traced, it
appends the tensor to a list (dynamo replays that when the region has run) and the next
collective call, or the end of the forward, frees what the list holds. So a gathered parameter
is freed at the end of the region of its last use rather than just after that use: at most the
parameters that one region gathers are alive at once, as FSDP frees after a module's forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

_F = TypeVar("_F", bound=Callable[..., object])

_deferred: list[torch.Tensor] = []


def defer_free(full: torch.Tensor) -> None:
    """Free ``full`` at the next collective call (inside a compiled region)."""
    _deferred.append(full)


def take_deferred() -> list[torch.Tensor]:
    """The tensors whose free was deferred, in order; the list is emptied."""
    out = list(_deferred)
    _deferred.clear()
    return out


def eager(before: Callable[[], None]) -> Callable[[_F], _F]:
    """Decorate a runtime call the graph makes: torch.compile breaks the graph at it and runs
    it as is, after ``before()`` (which frees what the region before it deferred)."""
    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            before()
            return fn(*args, **kwargs)
        return torch.compiler.disable(call)  # type: ignore[return-value]
    return decorate

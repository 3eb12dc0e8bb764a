"""How the runtime composes with ``torch.compile``: the compute between collectives is compiled.

[Note: torch.compile]
Under ``torch.compile(compiled)`` (or ``compiled.compile()``), ``OSDPModule.forward``, which sets
up the step's runtime state, runs as it is, and so does the graph it then runs
(``compiled_regions.py``): the rewritten graph in which each run of compute between two
collective calls is a *region*, a graph module of its own whose frame dynamo compiles whole (no
graph break), with the user's backend and options, where that measured faster than running it
eagerly ([Note: measured regions]). The collective calls between the regions (the all-gather and
prefetch calls, marked :func:`eager`) run as they do without torch.compile. A compiled region's
backward is one node of the autograd graph between the gathers' own backward nodes (which start
the reduce-scatters) and the hooks of the replicated parameters (which start their all-reduces).
Everything that makes the plan's memory and overlap hold stays the runtime's own, outside the
compiled code: asynchronous gathers waited for where the graph needs them, saved-tensor hooks
that keep a handle instead of a gathered full_shard parameter (they see the tensors a compiled
region saves like any other), re-gathers and prefetches in backward, bounded reduce-scatters and
bucketed all-reduces. The graph users print, and that runs without torch.compile, is not
changed.

Why regions rather than dynamo tracing the whole graph and breaking it at each collective call:
each break costs a resume function whose guards cover every live value of the graph; and the
frames that run as they are (this module's forward, the graph around the regions) are skipped by
dynamo from C (:func:`run_eagerly`), not through a call back into Python each time. So
dynamo's own overhead per forward (``backend="eager"``, no compiler) is smaller with regions
than with graph breaks (``benchmarks/torch_compile.py`` measures both).

A ``free_param`` call inside a region cannot run in the middle of compiled code: traced, it
appends the tensor to a list (dynamo replays that when the region has run) and the next
collective call, or the end of the forward, frees what the list holds. So a gathered parameter
is freed at the end of the region of its last use rather than just after that use: at most the
parameters that one region gathers are alive at once, as FSDP frees after a module's forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import fx

from .._version import TORCH_COMPILE_FLOOR
from ..errors import InputError

_F = TypeVar("_F", bound=Callable[..., object])

_deferred: list[torch.Tensor] = []
_eager_calls: set[Callable[..., object]] = set()


def defer_free(full: torch.Tensor) -> None:
    """Free ``full`` at the next collective call (inside a compiled region)."""
    _deferred.append(full)


def take_deferred() -> list[torch.Tensor]:
    """The tensors whose free was deferred, in order; the list is emptied."""
    out = list(_deferred)
    _deferred.clear()
    return out


def eager(before: Callable[[], None]) -> Callable[[_F], _F]:
    """Decorate a runtime call the graph makes (a collective): torch.compile runs it as it is,
    after ``before()`` (which frees what the region before it deferred), and the compute
    between two such calls is a region ([Note: torch.compile])."""
    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            before()
            return fn(*args, **kwargs)
        disabled = torch.compiler.disable(call)
        _eager_calls.add(disabled)
        return disabled  # type: ignore[return-value]
    return decorate


def _code_strategies() -> tuple[Any, Any, Any] | str:
    """Dynamo's per-code execution strategies (set_code_exec_strategy, FrameAction,
    FrameExecStrategy), or why this torch has none."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError as e:
        return str(e)
    return set_code_exec_strategy, FrameAction, FrameExecStrategy


def run_eagerly(fn: Callable[..., object], *, recursive: bool = False) -> None:
    """Have torch.compile run ``fn``'s frame as it is and compile the frames it calls, or, with
    ``recursive``, run those as they are too: ``torch.compiler.disable(fn, recursive=...)``
    without a wrapper around each call (dynamo skips the code object from C, not through a
    call back into Python). A torch without per-code strategies is refused under torch.compile
    (:func:`check_compilable`)."""
    strategies = _code_strategies()
    if isinstance(strategies, str):
        return
    set_code_exec_strategy, action, strategy = strategies
    nested = action.SKIP if recursive else action.DEFAULT
    set_code_exec_strategy(fn.__code__, strategy(action.SKIP, nested))


def check_compilable() -> None:
    """InputError, under torch.compile, where this torch cannot skip code from C."""
    missing = _code_strategies()
    if isinstance(missing, str):
        raise InputError(
            f"torch.compile of an osdp-fx module needs dynamo's per-code execution strategies "
            f"(torch._C._dynamo.eval_frame.set_code_exec_strategy), which torch "
            f"{torch.__version__} lacks ({missing}); upgrade torch to "
            f"{'.'.join(map(str, TORCH_COMPILE_FLOOR))} or newer (2.13 is "
            f"tested on the CPU, 2.11 on a GPU) or run the module without torch.compile")


def under_torch_compile() -> bool:
    """Whether torch.compile (dynamo) compiles the frames this eagerly running one calls."""
    from torch._C._dynamo import eval_frame

    callback = getattr(eval_frame, "get_eval_frame_callback", lambda: None)()
    return callback is not None and callback is not False


def is_collective_call(node: fx.Node) -> bool:
    """Whether ``node`` is a runtime call that runs as it is under torch.compile (:func:`eager`):
    a collective."""
    return node.op == "call_function" and node.target in _eager_calls


def release_graphs(graphs: list[fx.Graph]) -> None:
    """Cut each graph's reference to its module (graph modules and their graphs refer to each
    other: without this their parameters outlive them until Python's collector runs)."""
    for graph in graphs:
        graph._owning_module = None


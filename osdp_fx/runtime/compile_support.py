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

Adjacent collective calls (an all-gather and the prefetch of the next parameter, with nothing
computed between them) run as one call under torch.compile (:func:`grouped_calls`): dynamo
breaks the graph once for them, not once each. On the compare.py GPT under shard_grad_op, 67
calls make 18 such groups. The graph users print and that runs eagerly is not changed.

A ``free_param`` call inside a region cannot run in the middle of compiled code: traced, it
appends the tensor to a list (dynamo replays that when the region has run) and the next
collective call, or the end of the forward, frees what the list holds. So a gathered parameter
is freed at the end of the region of its last use rather than just after that use: at most the
parameters that one region gathers are alive at once, as FSDP frees after a module's forward.
"""

from __future__ import annotations

import copy
import functools
import operator
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import fx, nn

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
    """Decorate a runtime call the graph makes: torch.compile breaks the graph at it and runs
    it as is, after ``before()`` (which frees what the region before it deferred)."""
    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            before()
            return fn(*args, **kwargs)
        disabled = torch.compiler.disable(call)
        _eager_calls.add(disabled)
        return disabled  # type: ignore[return-value]
    return decorate


def under_torch_compile() -> bool:
    """Whether torch.compile (dynamo) compiles the frames this eagerly running one calls."""
    from torch._C._dynamo import eval_frame

    callback = getattr(eval_frame, "get_eval_frame_callback", lambda: None)()
    return callback is not None and callback is not False


class _Input:
    """An argument of a group's call: the group's ``i``-th input."""

    def __init__(self, i: int) -> None:
        self.i = i


class _Earlier:
    """An argument of a group's call: the output of the group's ``i``-th call."""

    def __init__(self, i: int) -> None:
        self.i = i


class CallGroup(nn.Module):
    """Runtime calls that were adjacent in the graph, run one after the other in one call;
    returns every call's output."""

    def __init__(self, calls: list[tuple[Callable[..., Any], Any, Any]]) -> None:
        super().__init__()
        self.calls = calls  # (function, args, kwargs) with _Input / _Earlier for the values

    @torch.compiler.disable
    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        outs: list[Any] = []

        def value(a: Any) -> Any:
            if isinstance(a, _Input):
                return inputs[a.i]
            return outs[a.i] if isinstance(a, _Earlier) else a

        for fn, args, kwargs in self.calls:
            outs.append(fn(*fx.node.map_aggregate(args, value),
                           **fx.node.map_aggregate(kwargs, value)))
        return tuple(outs)


def grouped_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters and submodules) in which every run of two or
    more collective calls with nothing computed between them is one :class:`CallGroup` call;
    the parameter reads among them move before the run."""
    graph = copy.deepcopy(gm.graph)
    runs: list[list[fx.Node]] = []
    run: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _eager_calls:
            run.append(node)
        elif node.op == "get_attr" and run:
            run[0].prepend(node)  # a parameter read: pure, so it may come earlier
        else:
            if len(run) > 1:
                runs.append(run)
            run = []
    out = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    for k, run in enumerate(runs):
        inside = {n: i for i, n in enumerate(run)}
        inputs: dict[fx.Node, int] = {}

        def template(n: fx.Node) -> Any:
            if n in inside:
                return _Earlier(inside[n])
            return _Input(inputs.setdefault(n, len(inputs)))

        calls = [(n.target, fx.node.map_arg(n.args, template), fx.node.map_arg(n.kwargs, template))
                 for n in run]
        name = f"osdp_call_group_{k}"
        out.add_submodule(name, CallGroup(calls))
        with graph.inserting_before(run[0]):
            group = graph.call_module(name, tuple(inputs))
            for i, n in enumerate(run):
                if any(u not in inside for u in n.users):
                    n.replace_all_uses_with(graph.call_function(operator.getitem, (group, i)),
                                            delete_user_cb=lambda u: u not in inside)
        for n in reversed(run):
            graph.erase_node(n)
    out.recompile()
    return out


GROUPED = "_osdp_grouped_gm"
"""Where :func:`grouped_for` keeps a module's grouped graph module (in its ``__dict__``)."""


@torch.compiler.disable  # built once, eagerly
def grouped_for(owner: nn.Module, gm: fx.GraphModule) -> fx.GraphModule:
    """``owner``'s :func:`grouped_calls` copy of ``gm``: built the first time, then kept."""
    grouped = owner.__dict__.get(GROUPED)
    if grouped is None:
        grouped = grouped_calls(gm)
        object.__setattr__(owner, GROUPED, grouped)
        # the graph and its module refer to each other: cut that when the owner goes
        weakref.finalize(owner, setattr, grouped.graph, "_owning_module", None)
    return grouped

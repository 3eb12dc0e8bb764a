"""How the runtime composes with ``torch.compile``: the compute between collectives is compiled.

[Note: torch.compile]
Under ``torch.compile(compiled)`` (or ``compiled.compile()``), ``OSDPModule.forward``, which sets
up the step's runtime state, runs as it is, and so does the graph it then runs: a copy of the
rewritten graph (:func:`compiled_regions`) in which each run of compute between two collective
calls is a submodule, a *region*. Dynamo compiles each region's frame whole (no graph break),
with the user's backend and options; the collective calls between the regions (the all-gather
and prefetch calls, marked :func:`eager`) run as they do without torch.compile. Each region's
backward is one compiled node of the autograd graph between the gathers' own backward nodes
(which start the reduce-scatters) and the hooks of the replicated parameters (which start their
all-reduces). Everything that makes the plan's memory and overlap hold stays the runtime's own,
outside the compiled code: asynchronous gathers waited for where the graph needs them,
saved-tensor hooks that keep a handle instead of a gathered full_shard parameter (they see the
tensors a compiled region saves like any other), re-gathers and prefetches in backward, bounded
reduce-scatters and bucketed all-reduces.

Why regions rather than dynamo tracing the whole graph and breaking it at each collective call:
each break costs a resume function whose guards cover every live value of the graph, and the
frames that run as they are (this module's forward and the graph between the regions) are
skipped by dynamo from C (:func:`run_eagerly`), not through a Python call back each time. On
the compare.py GPT at world 1 (19 regions), dynamo without a compiler (``backend="eager"``)
added 3.4-4.8 ms to a 40-44 ms forward with graph breaks and 2 ms with regions.

Adjacent collective calls (an all-gather and the prefetch of the next parameter, with nothing
computed between them) are one call (:func:`grouped_calls`), so no region is empty: on the
compare.py GPT under shard_grad_op, 67 calls make 18 groups and 19 regions. The graph users
print and that runs eagerly is not changed.

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


def run_eagerly(fn: Callable[..., object]) -> None:
    """Have torch.compile run ``fn``'s own frame as it is, and compile the frames it calls (as
    ``torch.compiler.disable(fn, recursive=False)`` does, without a wrapper dynamo traces and
    a call back into Python at each call: dynamo skips the code object from C)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)


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


REGION = "osdp_region_"
"""The name of a compiled region's submodule in :func:`compiled_regions`, before its index."""


def is_collective_call(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` of ``gm`` is a runtime call that runs eagerly (a collective, or a
    :class:`CallGroup` of them)."""
    if node.op == "call_function":
        return node.target in _eager_calls
    return node.op == "call_module" and isinstance(gm.get_submodule(node.target), CallGroup)


def _region_module(root: fx.GraphModule, nodes: list[fx.Node]) -> tuple[
        fx.GraphModule, list[fx.Node], list[fx.Node]]:
    """The graph module that computes ``nodes`` (a run of ``root``'s graph), the nodes outside
    it that it reads (its inputs, in order) and the nodes of it read outside (its outputs)."""
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a.op != "get_attr":
                inputs.setdefault(a)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env = {a: graph.placeholder(a.name) for a in inputs}
    for n in nodes:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:  # a parameter read: read again here
                env[a] = graph.get_attr(a.target)
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(root, graph, class_name="OSDPRegion"), list(inputs), outputs


def compiled_regions(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its parameters and submodules) that runs eagerly and calls,
    between its collective calls (grouped as by :func:`grouped_calls`), each run of compute
    nodes as a submodule ``osdp_region_<k>``: the frames torch.compile compiles."""
    grouped = grouped_calls(gm)
    runs: list[list[fx.Node]] = [[]]
    for node in grouped.graph.nodes:
        if node.op in ("placeholder", "output") or is_collective_call(grouped, node):
            runs.append([])
        elif node.op != "get_attr":  # a parameter read: each region that reads it reads it
            runs[-1].append(node)
    runs = [run for run in runs if run]
    starts = {run[0]: k for k, run in enumerate(runs)}
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(grouped.graph._codegen)  # export's pytree inputs, outputs
    env: dict[fx.Node, fx.Node] = {}
    for node in grouped.graph.nodes:
        if node in starts:
            name = f"{REGION}{starts[node]}"
            module, inputs, outputs = _region_module(grouped, runs[starts[node]])
            grouped.add_submodule(name, module)
            call = graph.call_module(name, tuple(env[a] for a in inputs))
            for i, n in enumerate(outputs):
                env[n] = graph.call_function(operator.getitem, (call, i))
        elif node.op in ("placeholder", "get_attr", "output") or is_collective_call(
                grouped, node):
            env[node] = graph.node_copy(node, env.__getitem__)
    for node in reversed(graph.nodes):  # parameter reads that only regions made
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    out = fx.GraphModule(grouped, graph, class_name=type(gm).__name__)
    release_graphs([grouped.graph])  # grouped goes: its graph must not keep it alive
    run_eagerly(type(out).forward)  # each graph module has a class, and a forward, of its own
    return out


REGIONS = "_osdp_regions_gm"
"""Where :func:`regions_for` keeps a module's :func:`compiled_regions` (in its ``__dict__``)."""


@torch.compiler.disable  # built once, eagerly
def regions_for(owner: nn.Module, gm: fx.GraphModule) -> fx.GraphModule:
    """``owner``'s :func:`compiled_regions` copy of ``gm``: built the first time, then kept."""
    regions = owner.__dict__.get(REGIONS)
    if regions is None:
        regions = compiled_regions(gm)
        object.__setattr__(owner, REGIONS, regions)
        # graphs and their modules refer to each other: cut that when the owner goes
        weakref.finalize(owner, release_graphs, [m.graph for m in regions.modules()
                                                 if isinstance(m, fx.GraphModule)])
    return regions


def release_graphs(graphs: list[fx.Graph]) -> None:
    """Cut each graph's reference to its module (graph modules and their graphs refer to each
    other: without this their parameters outlive them until Python's collector runs)."""
    for graph in graphs:
        graph._owning_module = None

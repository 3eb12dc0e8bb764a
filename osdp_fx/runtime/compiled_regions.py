"""What torch.compile compiles of a compiled module: its regions, each where it measured faster.

[Note: measured regions]
Under ``torch.compile``, a compiled module runs its rewritten graph through
:class:`CompiledRegions`: each run of compute between two collective calls is a *region*, a
graph module of its own (``body``) whose frame dynamo compiles whole, with the user's backend
and options ([Note: torch.compile] in ``compile_support.py``). A compiled region costs a fixed
time per call besides its kernels (dynamo's guards, AOT autograd's wrapper in forward and
backward); where inductor fuses little (a projection and a
layer norm eager already runs as one kernel) that is more than it gains, and a plan that
gathers each parameter on its own has a region per parameter. So each region runs compiled or
eagerly, whichever measured faster on this machine:

- the first :data:`WARMUP_STEPS` forwards run every region compiled (dynamo compiles then);
- the next ``2 * TRIAL_STEPS`` forwards alternate, every region compiled then every region
  eagerly; each region's forward and backward are timed (gradient hooks mark where its
  backward starts and ends; on a GPU the device is synchronised around each, in these steps
  only);
- the forward after them sums each trial's times over the ranks (one all-reduce, so every rank
  makes the same choice) and compiles a region only where its compiled trials beat its eager
  ones by more than chance would (:data:`SIGNIFICANCE`): ties run eagerly, and so as the plan
  predicts (a compiled region frees a gathered parameter at its end, not after its last use).
  From then on an eager region runs, with everything it calls, as without torch.compile.

``compiled.compiled_regions`` (``OSDPModule``) prints the regions, their times and choices.
"""

from __future__ import annotations

import itertools
import math
import operator
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from .collectives import WORLD, all_reduce_sum_, collective_device, group_size
from .compile_support import (
    check_compilable,
    is_collective_call,
    release_graphs,
    run_eagerly,
)

WARMUP_STEPS = 2
"""Forwards that run every region compiled before the trials (the first compiles)."""
TRIAL_STEPS = 8
"""Timed forwards (and their backwards) per way of running the regions, alternating."""
SETTLED_AFTER = WARMUP_STEPS + 2 * TRIAL_STEPS + 1
"""The forwards after which every region runs its chosen way (the last of them chooses)."""
SIGNIFICANCE = 0.05
"""A region is compiled where its compiled trials beat its eager ones by a margin that equal
ways would reach with at most this probability (a one-sided Mann-Whitney test)."""
REGION = "osdp_region_"
"""The name of a region's submodule in the graph :class:`CompiledRegions` runs, before its
index."""
COMPILED, EAGER = "compiled", "eager"


@torch.compiler.disable
def _device_of(args: tuple[Any, ...]) -> torch.device | None:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), None)


@torch.compiler.disable
def _now(device: torch.device | None) -> float:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Region(nn.Module):
    """One run of compute between two collective calls while the regions are on trial: its
    ``body`` run through torch.compile or eagerly (:attr:`mode`), timed."""

    def __init__(self, body: fx.GraphModule, own_params: list[nn.Parameter]) -> None:
        super().__init__()
        self.body = body
        self.mode = COMPILED
        self.timing = False
        self.times: dict[str, dict[str, list[float]]] = {
            m: {"forward": [], "backward": []} for m in (COMPILED, EAGER)}
        self._eager = torch.compiler.disable(body)
        # the parameters only this region reads: where its backward ends when no input has a
        # gradient
        self.own_params = own_params
        self._hooks: list[Any] = []

    def forward(self, *args: Any) -> tuple[Any, ...]:
        run = self.body if self.mode == COMPILED else self._eager
        if not self.timing:
            return run(*args)
        return self._timed(run, args)

    # Called straight, not through nn.Module's __call__: dynamo would trace that frame and
    # inline this one, while it skips this one's own frame (run_eagerly below).
    __call__ = forward

    def _timed(self, run: Callable[..., tuple[Any, ...]], args: tuple[Any, ...]) -> Any:
        times = self.times[self.mode]
        device = _device_of(args)
        t0 = _now(device)
        out = run(*args)
        times["forward"].append(_now(device) - t0)
        if torch.is_grad_enabled():
            self._clock(times["backward"], device, args, out)
        return out

    @torch.compiler.disable
    def _clock(self, into: list[float], device: torch.device | None,
               args: tuple[Any, ...], out: tuple[Any, ...]) -> None:
        """Time this forward's backward: from the first of the outputs' backward nodes until
        every input's gradient (with none, every own parameter's) is computed."""
        self.unhook()  # a forward whose backward never ran
        outputs = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        inputs = inputs or [p for p in self.own_params if p.requires_grad]
        if not outputs or not inputs:
            return
        start: list[float] = []

        def begin(*_: Any) -> None:
            if not start:
                start.append(_now(device))

        def end(_: Any) -> None:
            if start:
                into.append(_now(device) - start[0])
            self.unhook()

        nodes = {id(o.grad_fn): o.grad_fn for o in outputs if o.grad_fn is not None}
        self._hooks = [n.register_prehook(begin) for n in nodes.values()]
        self._hooks.append(torch.autograd.graph.register_multi_grad_hook(inputs, end))

    def unhook(self) -> None:
        """Remove the clock's hooks (they hold the autograd nodes they watch)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def samples(self, mode: str) -> list[float]:
        """Seconds of each trial run ``mode`` way: its forward and, where timed, backward."""
        fwd, bwd = self.times[mode]["forward"], self.times[mode]["backward"]
        return [f + (bwd[i] if i < len(bwd) else 0.0) for i, f in enumerate(fwd)]

    def cost(self, mode: str) -> float:
        """Median forward plus median backward seconds run ``mode`` way (0 for untimed)."""
        return sum(statistics.median(v) if v else 0.0 for v in self.times[mode].values())


# the frames dynamo compiles are the bodies'; these run as they are
run_eagerly(Region.forward)
run_eagerly(Region._timed)


class CompiledRegions:
    """The graph a compiled module runs under torch.compile ([Note: measured regions]):
    built from its rewritten graph module ``gm`` (sharing its parameters and submodules)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        runs: list[list[fx.Node]] = [[]]
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output") or is_collective_call(node):
                runs.append([])
            elif node.op != "get_attr":  # a parameter read: each region reads it itself
                runs[-1].append(node)
        self.runs = [run for run in runs if run]
        bodies = [_body(gm, run) for run in self.runs]
        readers: dict[nn.Parameter, list[int]] = {}
        for k, body in enumerate(bodies):
            for p in set(body.parameters()):
                readers.setdefault(p, []).append(k)
        self.regions = [Region(body, [p for p, ks in readers.items() if ks == [k]])
                        for k, body in enumerate(bodies)]
        self.module = self._graph(lambda k: self.regions[k])
        self.forwards = 0
        self.decided = False

    def __call__(self, *inputs: Any) -> Any:
        self.begin_forward()
        return self.module(*inputs)

    @torch.compiler.disable
    def begin_forward(self) -> None:
        """Called as each forward begins: the regions' way of running in it. Only forwards
        with gradients count (a forward under ``torch.no_grad()`` is not timed)."""
        if self.decided:
            return
        if not torch.is_grad_enabled():
            for r in self.regions:
                r.timing = False
            return
        trial = self.forwards - WARMUP_STEPS
        self.forwards += 1
        if trial >= 2 * TRIAL_STEPS:
            self._decide()
            return
        for r in self.regions:
            r.timing = trial >= 0
            r.mode = EAGER if trial >= 0 and trial % 2 else COMPILED

    def _decide(self) -> None:
        samples = torch.tensor([[r.samples(m)[:TRIAL_STEPS] for m in (COMPILED, EAGER)]
                                for r in self.regions], dtype=torch.float64)
        if group_size(WORLD) > 1:  # every rank chooses alike
            samples = all_reduce_sum_(samples.to(collective_device()), WORLD).cpu()
        most = _most_pairs_not_faster(TRIAL_STEPS, SIGNIFICANCE)
        for r, (compiled, eager) in zip(self.regions, samples.tolist()):
            r.timing = False
            r.unhook()
            not_faster = sum(c >= e for c in compiled for e in eager)
            r.mode = COMPILED if not_faster <= most else EAGER
        old = self.module
        # A compiled region stays a Region (its body, a graph module, would be recompiled with
        # the graph, and so re-traced); an eager one is its body, which runs, with everything
        # it calls (saved-tensor hooks, free_param), as it does without torch.compile.
        self.module = self._graph(lambda k: self.regions[k] if self.regions[k].mode == COMPILED
                                  else self.regions[k].body)
        for r in self.regions:
            if r.mode == EAGER:
                run_eagerly(type(r.body).forward, recursive=True)
        release_graphs([old.graph])
        self.decided = True

    def _graph(self, call: Callable[[int], nn.Module]) -> fx.GraphModule:
        """``gm``'s graph with each run ``k`` of compute a call of ``call(k)``; it runs as it
        is, its callees as dynamo decides."""
        starts = {run[0]: k for k, run in enumerate(self.runs)}
        inside = {n for run in self.runs for n in run}
        graph = fx.Graph()
        graph._codegen = self.gm.graph._codegen  # export's pytree inputs and outputs
        env: dict[fx.Node, fx.Node] = {}
        targets: dict[str, Any] = {}
        for node in self.gm.graph.nodes:
            k = starts.get(node)
            if k is not None:
                targets[f"{REGION}{k}"] = call(k)
                inputs, outputs = _boundary(self.runs[k])
                out = graph.call_module(f"{REGION}{k}", tuple(env[a] for a in inputs))
                for i, n in enumerate(outputs):
                    env[n] = graph.call_function(operator.getitem, (out, i))
            elif node not in inside:
                env[node] = graph.node_copy(node, env.__getitem__)
        for node in reversed(graph.nodes):  # parameter reads that only regions made
            if node.op == "get_attr" and not node.users:
                graph.erase_node(node)
        for node in graph.nodes:
            if node.op == "get_attr":
                targets[node.target] = operator.attrgetter(node.target)(self.gm)
        top = fx.GraphModule(targets, graph, class_name=type(self.gm).__name__)
        run_eagerly(type(top).forward)  # each graph module has a class, and forward, its own
        return top

    def train(self, mode: bool) -> None:
        for m in (self.module, *(r.body for r in self.regions)):
            m.training = mode

    def release(self) -> None:
        """Cut the graphs' references to their modules (when the owner goes)."""
        release_graphs([self.module.graph, *(r.body.graph for r in self.regions)])

    def table(self) -> str:
        """The regions: operators, median times each way and the way each runs."""
        lines = ["| region | operators | compiled ms (fwd + bwd) | eager ms (fwd + bwd) | runs |",
                 "|---|---|---|---|---|"]
        for k, r in enumerate(self.regions):
            ops = [getattr(n.target, "__name__", str(n.target)) for n in r.body.graph.nodes
                   if n.op in ("call_function", "call_method", "call_module")
                   and n.target is not operator.getitem]
            cells = [f"{1e3 * r.cost(m):.2f}" if any(r.times[m].values()) else "-"
                     for m in (COMPILED, EAGER)]
            runs = r.mode if self.decided else f"{r.mode} (on trial)"
            lines.append(f"| {k} | {', '.join(ops)} | {cells[0]} | {cells[1]} | {runs} |")
        return "\n".join(lines)


def _most_pairs_not_faster(n: int, alpha: float) -> int:
    """The largest count of (compiled, eager) trial pairs in which the compiled one was not
    faster that ``n`` against ``n`` trials of two equal ways reach with probability at most
    ``alpha`` (the Mann-Whitney U statistic's exact distribution: every way of ranking them
    alike; 4 for 5 against 5, where P(U <= 4) = 12/252), -1 where none is that unlikely."""
    counts: dict[int, int] = {}
    for fast in itertools.combinations(range(2 * n), n):  # the ranks of the compiled trials
        u = sum(r - i for i, r in enumerate(fast))  # pairs in which an eager one ranks lower
        counts[u] = counts.get(u, 0) + 1
    total, seen, most = math.comb(2 * n, n), 0, -1
    for u in sorted(counts):
        seen += counts[u]
        if seen / total > alpha:
            break
        most = u
    return most


def _boundary(run: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """The nodes outside ``run`` that it reads (in order; parameter reads excepted) and the
    nodes of it read outside."""
    inside = set(run)
    inputs: dict[fx.Node, None] = {}
    for n in run:
        for a in n.all_input_nodes:
            if a not in inside and a.op != "get_attr":
                inputs.setdefault(a)
    return list(inputs), [n for n in run if any(u not in inside for u in n.users)]


def _body(gm: fx.GraphModule, run: list[fx.Node]) -> fx.GraphModule:
    """The graph module that computes ``run`` from its inputs (:func:`_boundary`), reading
    ``gm``'s parameters itself, and returns its outputs as a tuple."""
    inputs, outputs = _boundary(run)
    graph = fx.Graph()
    env = {a: graph.placeholder(a.name) for a in inputs}
    for n in run:
        for a in n.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = graph.get_attr(a.target)
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, graph, class_name="OSDPRegion")


@torch.compiler.disable  # built once, eagerly
def build_regions(gm: fx.GraphModule) -> CompiledRegions:
    """The :class:`CompiledRegions` of ``gm`` (its owner keeps them, ``OSDPModule``), after
    checking that this torch can compile them."""
    check_compilable()
    return CompiledRegions(gm)


run_eagerly(CompiledRegions.__call__)

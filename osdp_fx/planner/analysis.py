"""What the planner knows of a captured model: its profile and facts (:class:`Analysis`), the
checks of the planner's options, and the share of the memory limit the search plans for."""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Hashable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from ..core.buckets import DEFAULT_BUCKET_BYTES, Schedule
from ..core.devices import Devices
from ..core.io_spec import input_shape
from ..core.layout import row_numel, split_weights
from ..core.node_meta import NodeProfile, osdp_meta, set_osdp_meta
from ..core.precision import MixedPrecision, dtype_name
from ..core.setting import StepSetting
from ..core.strategies import traits
from ..cost_models.graph_facts import GraphFacts, ParamState, graph_facts
from ..cost_models.shapes import node_factors
from ..cost_models.step import GroupCost, StepTime, group_cost, predict_step_time, regathered_params
from ..passes.capture import Captured, unchanged_state
from ..passes.pipeline import run_pipeline
from ..passes.profile import ProfileGraph, SlowestRankTimes, scale_to_times, times_whole_graph
from ..passes.quantized import quantized_format
from ..passes.sequence import NodeNumels, sequence_numels
from ..plan.request import ParamSpec
from ..runtime.collectives import WORLD, group_size

MEMORY_MARGIN = Devices.memory_margin
"""Share of the memory limit the search keeps free for bytes the memory model does not predict,
unless the devices say otherwise (``Devices.memory_margin``; 0 on the CPU).

Measured against an independent storage tracker (``tests/distributed/test_memory_promise.py``,
``tests/distributed/test_zoo.py``, ``docs/cost-models.md``, ``benchmarks/recompute.py``,
``benchmarks/optimality.py``), predicted peaks on the CPU equal what a step holds or lie above
it; what the model does not see is a GPU's allocator (the caching allocator rounds and
fragments, ``foreach`` Adam's temporaries). A searched plan is therefore one whose predicted
peak is at most ``(1 - margin) * limit``."""


def plannable_bytes(memory_limit_bytes: int, margin: float = MEMORY_MARGIN) -> int:
    """The predicted peak a searched plan may have under ``memory_limit_bytes``."""
    return memory_limit_bytes - int(memory_limit_bytes * margin)


def unmargined_limit(memory_limit_bytes: int, margin: float = MEMORY_MARGIN) -> int:
    """The limit whose plannable bytes are at most ``memory_limit_bytes`` itself, and as close
    as bytes allow: a search under it plans up to the limit, with no margin (autotuning's
    candidates above the margin, which it admits only when measured under the limit)."""
    limit = int(memory_limit_bytes / (1 - margin)) + 1
    while plannable_bytes(limit, margin) > memory_limit_bytes:
        limit -= 1
    return limit


@dataclasses.dataclass
class Analysis:
    """A captured model with its profile."""

    captured: Captured
    """The normalised graph and the model's parameter groups."""
    facts: GraphFacts
    """Storage roots, savers and gradient flow of the profiled graph."""
    batch_size: int
    """Per-rank batch size of the profiled inputs (first dimension of the first tensor)."""
    precision: MixedPrecision | None = None
    """Mixed precision the graph was cast for before profiling (``cast_params_pass``)."""
    seq_len: int | None = None
    """Sequence length of the profiled inputs (dimension 1; None: no such dimension)."""
    example_inputs: tuple[Any, ...] = ()
    """The inputs the graph was profiled on (the sequence analysis runs on them)."""
    max_shape: tuple[int, int | None] | None = None
    """The largest per-rank (batch, sequence length) to plan for; None: the profiled one."""
    _seq_scales: dict[int | None, dict[str, tuple[float, ...]] | None] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    _states: dict[tuple[str, str], ParamState] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    steps: dict[Hashable, tuple[StepTime, dict[str, GroupCost]]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    """The step model's predictions of the candidate plans the searches asked for
    (:func:`plan_step`), by what they depend on besides this analysis."""
    peaks: dict[Hashable, int] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    """The timeline's peaks of the candidate plans the searches asked for, by what they depend
    on besides this analysis (``search.plan_peak_bytes``): a schedule's search asks again for
    plans an earlier search of it predicted (its loosened and tightened repeats, the base of
    each), about half of a search's timelines."""

    @functools.cached_property
    def formats(self) -> dict[str, str]:
        """The 4-bit format of each group stored in one (``passes.quantized.quantized_format``,
        by canonical name); the others are absent."""
        return {s.name: s.format for s in param_specs(self.captured) if s.format}

    @functools.cached_property
    def regathered(self) -> set[str]:
        """The groups some operator saves for backward (re-gathered there when freed after
        forward, ``step.regathered_params``)."""
        return regathered_params(self.facts)

    @functools.cached_property
    def split_parts(self) -> dict[str, str]:
        """The groups that are parts of a split weight, and the weight of each
        (``layout.split_weights``)."""
        return split_weights(tuple(self.captured.params))

    @functools.cached_property
    def seq_numels(self) -> NodeNumels | None:
        """Elements per node at three sequence lengths (``passes/sequence.py``); None when the
        memory is not modelled in the sequence length. Analysed at the first ask (a search
        that plans for the profiled shape asks only when it predicts its final plan; the
        analysis of the graph before its splits or its cast never asks)."""
        if self.seq_len is None:
            return None
        return _sequence_numels(self.captured, self.example_inputs, self.seq_len)

    @property
    def plan_batch(self) -> int:
        """The per-rank batch size plans are made for."""
        return self.max_shape[0] if self.max_shape else self.batch_size

    def batch_scale(self, batch_size: int | None = None) -> float:
        """``batch_size`` (None: the planned one) over the profiled batch size: how compute
        and activations scale from what was profiled."""
        return (batch_size or self.plan_batch) / self.batch_size

    @property
    def plan_seq(self) -> int | None:
        """The sequence length plans are made for."""
        return self.max_shape[1] if self.max_shape and self.max_shape[1] else self.seq_len

    def seq_scale(self, seq: int | None = None) -> dict[str, tuple[float, ...]] | None:
        """How each node's activation bytes scale at ``seq`` (default: the plan's sequence
        length) from the profiled one (``cost_models.shapes.node_factors``); computed once per
        sequence length (the searches ask for it for every candidate plan)."""
        seq = seq or self.plan_seq
        if seq is None or seq == self.seq_len:
            return None  # node_factors' answer, without the sequence analysis
        if seq not in self._seq_scales:
            self._seq_scales[seq] = node_factors(self.seq_numels, self.seq_len, seq)
        return self._seq_scales[seq]


def param_specs(captured: Captured) -> list[ParamSpec]:
    """What a Plan needs to know about each parameter group of a captured model (a 4-bit
    weight's tensors: their format, from the op that reads them)."""
    formats = {n.target: quantized_format(n) for n in captured.gm.graph.nodes
               if n.op == "get_attr"}
    return [
        ParamSpec(name=p.name, shape=p.shape, dtype=str(p.dtype).removeprefix("torch."),
                  element_size=p.dtype.itemsize, aliases=p.aliases, trainable=p.trainable,
                  frozen=not p.requires_grad,
                  format=next((formats[n] for n in (p.name, *p.aliases) if formats.get(n)), ""))
        for p in captured.params.values()
    ]


_PROFILES_KEPT = 8
_measured: collections.OrderedDict[tuple[Any, ...], dict[str, NodeProfile]] = (
    collections.OrderedDict())
"""Measured profiles of this process, by :func:`_profile_key`, the latest last."""


_sequence_measured: collections.OrderedDict[tuple[Any, ...], NodeNumels | None] = (
    collections.OrderedDict())
"""Sequence analyses of this process (``passes/sequence.py``), by :func:`_graph_key`, the
sequence length, the device and the nodes profiled."""


def _graph_key(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """The graph's code and the shapes, dtypes and devices of its parameters, buffers and
    inputs."""
    def sig(t: torch.Tensor) -> tuple[Any, ...]:
        return tuple(t.shape), t.dtype, t.device.type, t.requires_grad

    inputs = [sig(t) for t in pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    state = [(n, *sig(t)) for n, t in (*gm.named_parameters(), *gm.named_buffers())]
    return gm.code, tuple(inputs), tuple(state)


def _profile_key(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """What a measured profile depends on: the process group, :func:`_graph_key` and the
    threads that compute."""
    group = id(torch.distributed.group.WORLD) if group_size(WORLD) > 1 else None
    return group, *_graph_key(gm, example_inputs), torch.get_num_threads()


def _sequence_numels(captured: Captured, example_inputs: tuple[Any, ...],
                     seq: int) -> NodeNumels | None:
    """``sequence_numels`` of the captured graph, analysed once per process for a graph and
    its shapes (it depends on nothing else; compiling the same model again reuses it)."""
    device = captured.materialize_device or "cpu"
    # the nodes whose bytes beyond their tensors the memory model scales (shapes.rescaled)
    held = frozenset(n.name for n in captured.gm.graph.nodes if (p := osdp_meta(n).profile) and (
        p.saved_bytes - p.saved_output_bytes - p.saved_input_bytes or p.fwd_transient_bytes
        or p.bwd_transient_bytes))
    key = (*_graph_key(captured.gm, example_inputs), seq, str(device), held)
    if key not in _sequence_measured:
        _sequence_measured[key] = sequence_numels(captured.gm, example_inputs, seq_len=seq,
                                                  meta_device=device, profiled=held)
        while len(_sequence_measured) > _PROFILES_KEPT:
            _sequence_measured.popitem(last=False)
    _sequence_measured.move_to_end(key)
    return _sequence_measured[key]


def _restore_profile(gm: fx.GraphModule, key: tuple[Any, ...]) -> bool:
    """Give ``gm`` the times measured earlier in this process for the same ``key``, if every
    rank has them (collective in a process group: the ranks must agree to skip measuring)."""
    saved = _measured.get(key)
    if group_size(WORLD) > 1:
        have = torch.tensor([0 if saved is None else 1])
        torch.distributed.all_reduce(have, op=torch.distributed.ReduceOp.MIN)
        if not have.item():
            return False
    if saved is None:
        return False
    for node in gm.graph.nodes:
        set_osdp_meta(node, profile=saved[node.name])
    _measured.move_to_end(key)
    return True


def _remember_profile(gm: fx.GraphModule, key: tuple[Any, ...]) -> None:
    _measured[key] = {n.name: osdp_meta(n).profile for n in gm.graph.nodes}
    while len(_measured) > _PROFILES_KEPT:
        _measured.popitem(last=False)


def analyze(captured: Captured, example_inputs: tuple[Any, ...], *, fake: bool = False,
            warmup: int = 1, repeats: int = 3,
            precision: MixedPrecision | None = None,
            max_shape: tuple[int, int | None] | None = None,
            share_repeats: bool = True,
            computation: tuple[float, float] | None = None) -> Analysis:
    """Profile ``captured.gm`` on ``example_inputs``, the node times scaled to the whole
    graph's on the CPU ([Note: the whole graph's time] in ``passes/profile.py``); in a process
    group, the node times are made the same on every rank, summing to the slowest rank's
    (``slowest_rank_times_pass``).

    Measured once per process group for a graph and its inputs' and parameters' shapes: a later
    call with the same reuses those times (the last few are kept), so that compiling the same
    model twice gives the same plan, as ``Devices`` are detected once per group; the sequence
    analysis is reused alike, in any group. Under fake tensors a repeated block takes the
    profile of the first like it (``share_repeats``; [Note: repeated blocks]).

    ``computation``: the forward and backward seconds of a graph that computes what this one
    does (the graph before its linears were split), to which this graph's node times are
    scaled where its whole graph would be timed, each node keeping its share ([Note: the split
    graph's computation] in ``planner/make.py``)."""
    fake = fake or any(p.device.type == "meta" for p in captured.gm.parameters())
    key = None if fake else _profile_key(captured.gm, example_inputs)
    if key is None or not _restore_profile(captured.gm, key):
        if not fake and group_size(WORLD) > 1:
            # ranks time their nodes together, sharing the machine as they do when training
            torch.distributed.barrier()
        with unchanged_state(captured.gm):
            run_pipeline(captured.gm, [ProfileGraph(
                example_inputs, warmup=warmup, repeats=repeats, fake=fake,
                meta_device=captured.materialize_device or "cpu", share_repeats=share_repeats,
                whole_graph=True)])
        if not fake:
            run_pipeline(captured.gm, [SlowestRankTimes()])
            _remember_profile(captured.gm, key)
    if computation is not None and times_whole_graph(captured.gm, example_inputs, fake=fake):
        scale_to_times(captured.gm, *computation)
    trainable = {name: p.trainable for name, p in captured.params.items()}
    batch, seq = input_shape(example_inputs)
    return Analysis(captured, graph_facts(captured.gm, trainable), batch, precision,
                    seq_len=seq, example_inputs=example_inputs, max_shape=max_shape)


def param_state(analysis: Analysis, name: str, strategy: str) -> ParamState:
    """What the cost models know of group ``name`` under ``strategy``, made once per analysis
    (the searches ask for every group's state under every candidate plan)."""
    state = analysis._states.get((name, strategy))
    if state is None:
        state = analysis._states[name, strategy] = _param_state(analysis, name, strategy)
    return state


def _param_state(analysis: Analysis, name: str, strategy: str) -> ParamState:
    p = analysis.captured.params[name]
    # a quantized weight's tensors are read in their stored dtype (mixed precision casts none)
    packed = name in analysis.formats
    mp = analysis.precision if p.dtype.is_floating_point and not packed else None
    return ParamState(numel=p.numel, element_size=p.dtype.itemsize, strategy=strategy,
                      trainable=p.trainable, row=row_numel(p.shape),
                      compute_element_size=mp.param_dtype.itemsize if mp else None,
                      reduce_element_size=mp.reduce_dtype.itemsize if mp else None,
                      gathered_dtype=dtype_name(mp.param_dtype if mp else p.dtype),
                      packed=packed)


def param_states(analysis: Analysis, strategies: Mapping[str, str]) -> dict[str, ParamState]:
    return {name: param_state(analysis, name, strategies[name]) for name in analysis.captured.params}


def candidate_key(analysis: Analysis, strategies: Mapping[str, str],
                  recompute: Mapping[str, str], schedule: Schedule) -> tuple[Any, ...]:
    """What a candidate plan's predictions depend on besides the analysis, the devices and the
    options: its strategies, recomputed regions and schedule, the schedule's all-reduce bucket
    size left out where no trainable group is replicated (only replicated gradients are
    all-reduced in buckets: ``step.predict_step_time``, ``live_bytes.replicated_buckets``), so
    that the candidate schedules that differ in it alone share such a plan's predictions."""
    params = analysis.captured.params
    all_reduces = any(params[n].trainable and not traits(s).sharded
                      for n, s in strategies.items())
    timing = (schedule.prefetch, schedule.gather_bucket_bytes,
              schedule.reduce_bucket_bytes if all_reduces else None, schedule.scatters_in_flight)
    return (tuple(strategies[n] for n in params), tuple(sorted(recompute.items())), timing)


def search_cost(analysis: Analysis, name: str, state: ParamState, setting: StepSetting, *,
                reduce_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                split_part: bool | None = None) -> GroupCost:
    """Group ``name``'s communication, optimizer and memory costs in ``state`` (its strategy;
    a split part's size) under ``setting``, without its computation: what a search weighs one
    option by (replicated gradients in all-reduce buckets of ``reduce_bucket_bytes``).
    ``split_part``: whether ``state`` is a part of a split weight (None: whether ``name`` is
    one in the analysis)."""
    if split_part is None:
        split_part = name in analysis.split_parts
    return group_cost(state, regathered=name in analysis.regathered, compute_s=0.0,
                      devices=setting.devices, optimizer=setting.optimizer,
                      grad_accumulation=setting.grad_accumulation,
                      reduce_bucket_bytes=reduce_bucket_bytes, split_part=split_part)


def plan_step(analysis: Analysis, strategies: Mapping[str, str],
              recompute: Mapping[str, str] | None, setting: StepSetting,
              ) -> tuple[StepTime, dict[str, GroupCost]]:
    """``predict_step_time`` of a candidate plan of this analysis under ``setting``'s devices,
    optimizer and schedule (the step time and each group's costs, at the profiled batch:
    ``StepTime.at_scale`` scales it), predicted once per analysis (``Analysis.steps``: the
    searches score the same plan again, each schedule's repeats, the local search). The result
    is shared: read it, do not change it."""
    recompute = recompute or {}
    key = candidate_key(analysis, strategies, recompute, setting.schedule) + (
        setting.devices, setting.optimizer)
    step = analysis.steps.get(key)
    if step is None:
        step = analysis.steps[key] = predict_step_time(
            analysis.captured.gm, param_states(analysis, strategies), analysis.facts,
            setting=setting, profiled_batch=analysis.batch_size, recompute=recompute)
    return step


def plan_step_s(analysis: Analysis, strategies: Mapping[str, str],
                recompute: Mapping[str, str] | None, setting: StepSetting) -> float:
    """The step model's seconds for a candidate plan at ``setting``'s batch size (None: the
    one the analysis plans for)."""
    step, _ = plan_step(analysis, strategies, recompute, setting)
    return step.at_scale(analysis.batch_scale(setting.batch_size))

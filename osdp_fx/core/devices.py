"""Devices: what the cluster looks like, for planning and cost models.

A :class:`Devices` is written by hand (or loaded with :meth:`Devices.from_json`) to plan for
hardware one does not have, or measured on the running process group with
:func:`osdp_fx.detect_devices`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import logging
import math
import os
from typing import Any

from ..errors import InputError
from ..units import parse_bytes
from .strategies import COLLECTIVES, Strategy

log = logging.getLogger(__name__)

DEFAULT_CPU_MEMORY_BYTES = 4 * 2**30
"""Memory limit per rank assumed on CPU when none is given (documented in docs/)."""

OPTIMIZERS = ("sgd", "sgd_momentum", "adam", "adamw")
"""The optimizer kinds cost models know (torch.optim.SGD without and with momentum, Adam, AdamW)."""
_STRATEGIES = tuple(s.value for s in Strategy)
DTYPES = ("float64", "float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
"""Dtype names ``Devices.compute_flops_per_s_by_dtype`` takes (torch's, without 'torch.')."""


OVERLAP_EFFICIENCY = 0.5
"""The default ``Devices.overlap_efficiency``, and the presets': half of the ideal. Chosen on a
2-core CPU when the step model had no host lane, where a model crediting none or all of the
overlap missed prefetching's steps on either side (``CHANGELOG.md``); kept where nothing
measures it (a GPU, whose collectives run beside its kernels, and the published rows the
presets predict); ``detect`` measures it on the CPU."""

_POSITIVE_RATES = ("compute_flops_per_s", "memory_bandwidth_bytes_per_s",
                   "intra_node_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s")
_NON_NEGATIVE_TIMES = ("intra_node_latency_s", "inter_node_latency_s", "selective_op_time_s",
                       "full_recompute_op_time_s", "sync_wait_s", "replica_host_time_s")

SYNC_STRETCH_S = 10e-3
"""The computation since the ranks last synchronised after which a blocking collective waits
``Devices.sync_wait_s`` more than its price; after a stretch ``c``, ``sqrt(c /
SYNC_STRETCH_S)`` of it ([Note: the wait after a stretch of computation] in
``cost_models/overlap.py``). ``detect`` measures the wait after this long."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Devices:
    """The devices a plan is made for. Figures are per rank unless a name says otherwise."""

    world_size: int = 1
    """Number of ranks (processes, one device each)."""
    ranks_per_node: int | None = None
    """Ranks that share a node's fast links; None means all ranks are on one node."""
    memory_bytes: int | None = None
    """Memory limit per rank for parameters, gradients, optimizer state and activations."""
    compute_flops_per_s: float = 1e11
    """Sustained dense matmul throughput of one device."""
    memory_bandwidth_bytes_per_s: float = 2e10
    """Device memory bandwidth (for the roofline of memory-bound operators)."""
    intra_node_bandwidth_bytes_per_s: float = 5e9
    """Per-rank bus bandwidth of collectives inside a node."""
    intra_node_latency_s: float = 5e-5
    """Fixed cost of one collective step inside a node."""
    inter_node_bandwidth_bytes_per_s: float = 1.25e9
    """Bandwidth of one rank's network link across nodes. A collective over one rank per node
    runs at it; a ring over several ranks of every node spreads its crossings over all of a
    node's links, at ``min(intra_node_bandwidth_bytes_per_s, ranks_per_node x this)``
    ([Note: rings across nodes] in ``cost_models/communication.py``)."""
    inter_node_latency_s: float = 1e-4
    """Fixed cost of one collective step across nodes (a ring's crossing steps)."""
    collective_links: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """Link figures of one collective in one scope, where it runs unlike the scope's figures
    above: keys ``"<scope>.<collective>"`` (scope ``intra_node``, ``inter_node``, or ``world``:
    a ring over every rank of every node as measured, which the whole world's collectives
    then run at instead of the rule of [Note: rings across nodes]; collective
    ``all_gather``, ``reduce_scatter`` or ``all_reduce``), values ``{"bandwidth_bytes_per_s": B,
    "latency_s": alpha}``. ``detect`` fits every collective to its own timings (CPU gloo's
    all-gather and reduce-scatter are slower than its all-reduce, by a ratio that changes with
    the size); a collective without an entry runs at its scope's figures."""
    collective_times: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Measured times of one collective in one scope, which its collectives over a group of
    the same size are priced from instead of its link figures: keys as ``collective_links``'s,
    values ``{"group_size": p, "total_bytes": [n1, n2, ...], "seconds": [t1, t2, ...]}`` (sizes
    increasing, times not decreasing). A size between two timed ones costs the time on the
    straight line between them, a smaller one the time on the line from the link figures'
    fixed cost (at 0 bytes) to the first, a larger one the last time plus the last two's rate
    ([Note: priced from the timed sizes] in ``cost_models/communication.py``). ``detect``
    records the sizes it timed; a collective without an entry, or over a group of another size,
    runs at its link figures."""
    concurrent_collective_ratio: float = 1.0
    """The time two collectives take started together, over the time they take one after the
    other, in [0.5, 1]: 1 where the link runs them one at a time (the default, and presets);
    below 1 where it runs them side by side faster (gloo's threads on the CPU: a step has a
    re-gather and gradient collectives in flight together in backward). The step model's
    communication lane runs a collective started while another is in flight at it, or at
    :attr:`concurrent_collective_ratios`' ratio for its size where that is given ([Note:
    collectives together] in ``cost_models/overlap.py``); ``detect`` measures it."""
    concurrent_collective_ratios: dict[str, list[float]] = dataclasses.field(
        default_factory=dict)
    """The ratio of :attr:`concurrent_collective_ratio` by the size of the collectives, where
    it changes with it: ``{"total_bytes": [n1, n2, ...], "ratios": [r1, r2, ...]}`` (sizes
    increasing, ratios in [0.5, 1]) for an all-gather and a reduce-scatter of one size started
    together (a re-gather beside a gradient's reduce-scatter, the pair a sharded step has in
    flight). A collective started beside those in flight runs at the ratio of its own size:
    on the line between the two timed sizes around it in the logarithm of the size, the
    first's below the first, the last's above the last. ``detect`` measures it on the CPU,
    where gloo runs two small collectives at world 2 no faster together than one after the
    other but saves at larger sizes and with more ranks per core (``docs/cost-models.md``);
    empty (every size at :attr:`concurrent_collective_ratio`) by default and in presets."""
    overlap_efficiency: float = OVERLAP_EFFICIENCY
    """Share of the collective time a step's schedule ideally hides under computation that
    hiding it saves, in [0, 1]: :data:`OVERLAP_EFFICIENCY` by default and in the presets. On the
    CPU a collective's work (gloo's copies, reductions and socket calls) runs on the cores the
    computation runs on, and ``detect`` measures the share: an all-gather started beside a
    computation against both alone ([Note: overlap on the CPU] in ``planner/detect.py``)."""
    overlap_hides_latency: bool = True
    """Whether the share :attr:`overlap_efficiency` applies to a collective's fixed cost (its
    latency) as to the rest of its time: true where the link runs beside the computation (a
    GPU's); ``detect`` sets False on the CPU, where that cost is gloo's threads waking and
    their round trips between the ranks, which wait for the cores the computation keeps busy,
    and hiding it saves nothing ([Note: overlap on the CPU])."""
    optimizer_element_time_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Measured optimizer step time per parameter element, by optimizer kind ("sgd",
    "sgd_momentum", "adam", "adamw"); a kind missing here is modelled as memory-bound (the bytes
    its update moves over the memory bandwidth)."""
    optimizer_tensor_time_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Measured fixed time per parameter tensor of an optimizer step (its kernel launches and
    Python), by optimizer kind; 0 for a kind missing here."""
    optimizer_sharded_tensor_time_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Measured fixed time per parameter tensor of an optimizer step over a sharded parameter
    (a ``DTensor``, as the compiled module hands it to the optimizer: stepped over its local
    tensor by torch's elementwise optimizers, [Note: local optimizer steps] in
    ``runtime/local_step.py``, through DTensor's dispatch by others), by optimizer kind; a kind
    missing here takes ``optimizer_tensor_time_s``."""
    param_host_time_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Measured host time the runtime spends per parameter group per step, beyond the time of
    its collectives and of the operators that read it, by strategy (``"replicate"``,
    ``"shard_grad_op"``, ``"full_shard"``, ...): a sharded group's copies into and out of its
    gather bucket's flat buffers, its cast and ``DTensor`` views, the saved-tensor handle that
    re-gathers a freed parameter, its gradient packed for the reduce-scatter and the reduced
    shard accumulated into ``.grad``; a replicated group's gradient hook and bucket copies.
    ``detect`` measures it ([Note: the host lane] in ``cost_models/step.py``); 0 for a
    strategy missing here (datasheet presets: their runs are not host-bound)."""
    bucket_host_time_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Measured host time the runtime spends per gather bucket per step beyond its members'
    (``param_host_time_s``), by sharded strategy: the launch and completion of the bucket's
    collectives on the host (the autograd function around its all-gather, its send buffer, the
    release of its output, its re-gather's handle, its gradients' flat buffer and the reduced
    chunk copied out). ``detect`` measures it ([Note: the host lane] in
    ``cost_models/step.py``; on the CPU by the thread's clock, not scaled by the ranks' share
    of the cores: [Note: a bucket's work in the waits] in ``planner/detect.py``); 0 for a
    strategy missing here."""
    replica_host_time_s: float = 0.0
    """Measured host time the runtime spends per step on a replicated parameter group of a
    plan that shards other groups, beyond ``param_host_time_s["replicate"]``: its parameter is
    then a ``Replicate()`` DTensor whose local tensor the graph reads as a leaf of autograd,
    and a hook on that leaf makes each gradient a DTensor ([Note: a replicated parameter's
    local leaf] in ``runtime/sharded.py``). ``detect`` measures it; 0 when not measured."""
    host_overlaps_device: bool = False
    """Whether the host runs ahead of the device: a GPU, whose kernels queue while the CPU
    dispatches the next ones, so a step takes the longer of the host's and the device's
    lanes; False on the CPU, where the host computes, and every host second is a second of
    the step ([Note: the host lane])."""
    sync_wait_s: float = 0.0
    """What a blocking collective takes beyond its price (the link figures') when the ranks
    reach it after :data:`SYNC_STRETCH_S` of computation since they last synchronised (after
    more or less, more or less of it: the square root of the ratio): they drift apart while
    they compute, and the first to arrive waits for the last ([Note: the wait after a stretch
    of computation] in ``cost_models/overlap.py``). ``detect`` measures it
    (a small all-gather after a stretch of matmuls against the matmuls alone); 0 when not
    measured (presets)."""
    prefetch_waits_for_ranks: bool = False
    """Whether a gather started ahead of its use (prefetched) still waits for the ranks as one
    started at its use: true where a rank's computation holds a core of its own while an
    asynchronous collective's threads wait for one, so the gather runs when the computation
    blocks at its wait, after the ranks drifted apart since it was started ([Note: the wait
    after a stretch of computation] in ``cost_models/overlap.py``). ``detect`` sets it on the
    CPU where the ranks do not outnumber the cores they share; False by default and in the
    presets (a GPU's collectives run on their own stream)."""
    selective_op_time_s: float = 0.0
    """Time torch's selective activation checkpointing adds per operator of a selectively
    recomputed region, in forward and in the recomputation together (its dispatch mode runs
    Python around every operator); measured by ``detect``, 0 when not measured."""
    full_recompute_op_time_s: float = 0.0
    """Time torch's activation checkpointing adds per operator of a fully recomputed region,
    beyond the operators' forward run once more: the saved-tensor hooks that pack every
    tensor the region's operators save in forward and unpack it in backward, the frame that
    recomputes the region from the first unpack, the random number generator's state saved
    and restored; measured by ``detect``, 0 when not measured."""
    attention_efficiency: float = 1.0
    """Share of the matmul rate (:meth:`flops_per_s`) a fused attention kernel (scaled
    dot-product attention) reaches where its time is estimated, not measured (a roofline:
    ``cost_models/compute.py``). Presets set ``presets.ATTENTION_EFFICIENCY``, fitted on five
    published rows; 1.0 by hand and from ``detect``, whose profiles measure every node."""
    compute_flops_per_s_by_dtype: dict[str, float] = dataclasses.field(default_factory=dict)
    """Sustained matmul throughput of operators computing in a dtype ("bfloat16", ...) where it
    differs from ``compute_flops_per_s`` (tensor cores); the roofline uses :meth:`flops_per_s`."""
    source: str = ""
    """Where the figures come from: "preset:<name>", "detected", or "" (defaults, by hand)."""
    memory_margin: float = 0.03
    """Share of ``memory_bytes`` kept free for what a GPU's caching allocator adds to the peak:
    presets and GPU ``detect`` set ``presets.GPU_MEMORY_MARGIN``, CPU ``detect`` 0."""
    all_reduce_trees: bool = False
    """Whether an all-reduce across nodes may run as NCCL's trees, which it picks over rings at
    the sizes where they are faster ([Note: trees across nodes] in
    ``cost_models/communication.py``): presets and ``detect`` on NCCL set it; gloo runs no
    trees."""
    reduce_scatter_copies_input: bool = False
    """Whether a reduce-scatter copies the gradient it is handed at its launch, so that both
    are alive then: true of gloo with more than one rank ([Note: gloo reduce-scatter] in
    ``runtime/collectives.py``), false of NCCL and of one rank. ``detect`` and ``devices_for``
    set it from the running process group's backend; False (as without a process group)
    unless stated, e.g. to plan offline for a gloo world."""

    def __post_init__(self) -> None:
        if not _is_int(self.world_size) or self.world_size < 1:
            raise InputError(f"Devices.world_size must be a positive int, got {self.world_size!r}")
        if self.ranks_per_node is not None and (
            not _is_int(self.ranks_per_node) or self.ranks_per_node < 1
            or self.world_size % self.ranks_per_node
        ):
            raise InputError(
                f"Devices.ranks_per_node={self.ranks_per_node} must divide world_size="
                f"{self.world_size}; set it to the number of ranks on each node, and give the "
                f"world size with it (e.g. Devices(world_size=16, ranks_per_node=8))"
            )
        if self.memory_bytes is not None:
            object.__setattr__(self, "memory_bytes", parse_bytes(self.memory_bytes))
        _check_margin(self.memory_margin)
        for name in _POSITIVE_RATES:
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < float("inf"):
                raise InputError(f"Devices.{name} must be a positive, finite number, got "
                                 f"{value!r}")
        for name in _NON_NEGATIVE_TIMES:
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < float("inf"):
                raise InputError(f"Devices.{name} must be a non-negative, finite number of "
                                 f"seconds, got {value!r}")
        _check_collective_links(self.collective_links)
        _check_collective_times(self.collective_times)
        if not _is_number(self.attention_efficiency) or not 0 < self.attention_efficiency <= 1:
            raise InputError(f"Devices.attention_efficiency must be a share of the matmul rate "
                             f"in (0, 1], got {self.attention_efficiency!r}")
        _check_concurrent_ratios(self.concurrent_collective_ratios)
        if (not _is_number(self.concurrent_collective_ratio)
                or not 0.5 <= self.concurrent_collective_ratio <= 1):
            raise InputError(f"Devices.concurrent_collective_ratio must be in [0.5, 1] (the time "
                             f"of two collectives started together over their time one after "
                             f"the other; 1: one at a time), got "
                             f"{self.concurrent_collective_ratio!r}")
        if not _is_number(self.overlap_efficiency) or not 0 <= self.overlap_efficiency <= 1:
            raise InputError(f"Devices.overlap_efficiency must be in [0, 1] (the share of the "
                             f"ideally hidden collective time that hiding saves; 0: none), "
                             f"got {self.overlap_efficiency!r}")
        for name, keys, low, what in (
                ("optimizer_element_time_s", OPTIMIZERS, 0, "non-negative seconds"),
                ("optimizer_tensor_time_s", OPTIMIZERS, 0, "non-negative seconds"),
                ("optimizer_sharded_tensor_time_s", OPTIMIZERS, 0, "non-negative seconds"),
                ("param_host_time_s", _STRATEGIES, 0, "non-negative seconds"),
                ("bucket_host_time_s", _STRATEGIES, 0, "non-negative seconds"),
                ("compute_flops_per_s_by_dtype", DTYPES, 1e-300, "positive FLOP/s")):
            bad = {k: v for k, v in getattr(self, name).items() if k not in keys
                   or not isinstance(v, (int, float)) or not low <= v < float("inf")}
            if bad:
                kind = {id(OPTIMIZERS): "optimizer kinds", id(_STRATEGIES): "strategies"}.get(
                    id(keys), "dtype names")
                raise InputError(f"Devices.{name} has invalid entries {bad}: keys are {kind}"
                                 f" ({', '.join(keys)}), values {what}")
        if not isinstance(self.host_overlaps_device, bool):
            raise InputError(f"Devices.host_overlaps_device must be True or False, got "
                             f"{self.host_overlaps_device!r}")
        for name in ("overlap_hides_latency", "prefetch_waits_for_ranks"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"Devices.{name} must be True or False, got "
                                 f"{getattr(self, name)!r}")

    def __hash__(self) -> int:
        return self._fingerprint_hash

    @functools.cached_property
    def _fingerprint_hash(self) -> int:
        """A hash of every figure (the dict fields as sorted items), computed once: the cost
        models' caches key their results by the Devices they were computed for."""
        def frozen(value: Any) -> Any:
            if isinstance(value, dict):
                return tuple(sorted((k, frozen(v)) for k, v in value.items()))
            if isinstance(value, list):
                return tuple(frozen(v) for v in value)
            return value

        return hash(tuple(frozen(getattr(self, f.name)) for f in dataclasses.fields(self)))

    @property
    def figures(self) -> str:
        """Where the figures come from, as a plan reports it: ``"detected"`` (measured on the
        running machine), ``"preset:<name>"``, ``"defaults"`` (``Devices()``'s, CPU-like) or
        ``"given"`` (written by hand)."""
        if self.source:
            return self.source
        default = _DEFAULTS
        same = all(getattr(self, name) == getattr(default, name) for name in _FIGURES)
        return "defaults" if same else "given"

    def concurrent_ratio(self, nbytes: float) -> float:
        """The ratio a collective of ``nbytes`` runs at beside collectives in flight
        (:attr:`concurrent_collective_ratios` at its size, else
        :attr:`concurrent_collective_ratio`)."""
        table = self.concurrent_collective_ratios
        if not table:
            return self.concurrent_collective_ratio
        sizes, ratios = table["total_bytes"], table["ratios"]
        if nbytes <= sizes[0]:
            return ratios[0]
        if nbytes >= sizes[-1]:
            return ratios[-1]
        i = bisect.bisect_right(sizes, nbytes)
        x0, x1, x = math.log(sizes[i - 1]), math.log(sizes[i]), math.log(nbytes)
        return ratios[i - 1] + (ratios[i] - ratios[i - 1]) * (x - x0) / (x1 - x0)

    @property
    def least_concurrent_ratio(self) -> float:
        """The least ratio any collective runs at beside others in flight: the most two
        collectives together save is ``2 (1 - this)`` of a collective's time."""
        return min([self.concurrent_collective_ratio,
                    *self.concurrent_collective_ratios.get("ratios", [])])

    @property
    def num_nodes(self) -> int:
        return self.world_size // (self.ranks_per_node or self.world_size)

    def flops_per_s(self, dtype: str = "") -> float:
        """Matmul throughput of an operator computing in ``dtype`` (a torch dtype name)."""
        return self.compute_flops_per_s_by_dtype.get(dtype, self.compute_flops_per_s)

    @classmethod
    def preset(cls, name: str, *, world_size: int | None = None,
               memory_limit: int | str | None = None) -> Devices:
        """``world_size`` ranks (default: one node) of a known cluster kind, e.g. ``Devices.
        preset("h100-sxm-8x", world_size=64)``: datasheet figures times stated efficiencies,
        sources in ``osdp_fx/core/presets.py`` (``python -m osdp_fx devices`` lists the names);
        ``memory_limit`` defaults to the GPU's memory."""
        from .presets import preset_figures

        return cls(**preset_figures(name, world_size=world_size, memory_limit=memory_limit))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write these figures as a JSON object (one key per field) to ``path``."""
        with open(path, "w") as f:
            json.dump(dataclasses.asdict(self), f, indent=2)
            f.write("\n")

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Devices:
        """Read a Devices written by :meth:`to_json` (or by hand; missing keys keep defaults)."""
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as e:
            raise InputError(f"cannot read devices file {os.fspath(path)!r}: {e}") from e
        except json.JSONDecodeError as e:
            raise InputError(f"devices file {os.fspath(path)!r} is not valid JSON: {e}") from e
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict):
            raise InputError(
                f"devices file {os.fspath(path)!r} must hold a JSON object with keys among "
                f"{', '.join(names)}"
            )
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise InputError(
                f"devices file {os.fspath(path)!r} has unknown keys {unknown}; valid keys are "
                f"{', '.join(names)}"
            )
        return cls(**data)


def _check_scope_keys(field: str, entries: dict[str, Any]) -> None:
    """Every key of ``Devices.<field>`` names a scope and a collective."""
    keys = {f"{scope}.{c}" for scope in LINK_SCOPES for c in COLLECTIVES}
    unknown = [key for key in entries if key not in keys]
    if unknown:
        raise InputError(
            f"Devices.{field} has an unknown key {unknown[0]!r}: keys are "
            f"'<scope>.<collective>' with scope {' or '.join(LINK_SCOPES)} and collective "
            f"one of {', '.join(COLLECTIVES)}, e.g. 'intra_node.all_gather'"
        )


def _check_collective_links(links: dict[str, dict[str, float]]) -> None:
    _check_scope_keys("collective_links", links)
    for key, figures in links.items():
        if (not isinstance(figures, dict) or set(figures) != {"bandwidth_bytes_per_s", "latency_s"}
                or not 0 < figures["bandwidth_bytes_per_s"] < float("inf")
                or not 0 <= figures["latency_s"] < float("inf")):
            raise InputError(
                f"Devices.collective_links[{key!r}] = {figures!r} must be "
                '{"bandwidth_bytes_per_s": positive bytes/s, "latency_s": non-negative seconds}'
            )


def _check_collective_times(tables: dict[str, dict[str, Any]]) -> None:
    _check_scope_keys("collective_times", tables)
    for key, table in tables.items():
        sizes = table.get("total_bytes") if isinstance(table, dict) else None
        times = table.get("seconds") if isinstance(table, dict) else None
        if (not isinstance(table, dict) or set(table) != {"group_size", "total_bytes", "seconds"}
                or not _is_int(table["group_size"]) or table["group_size"] < 2
                or not isinstance(sizes, list) or not isinstance(times, list)
                or len(sizes) < 2 or len(sizes) != len(times)
                or not all(_is_number(v) and 0 < v < float("inf") for v in sizes + times)
                or any(b <= a for a, b in zip(sizes, sizes[1:]))
                or any(b < a for a, b in zip(times, times[1:]))):
            raise InputError(
                f"Devices.collective_times[{key!r}] must be {{\"group_size\": ranks (2 or "
                f"more), \"total_bytes\": [increasing positive sizes], \"seconds\": [as many "
                f"positive times, none below the one before]}}, got {table!r}"
            )


def _check_concurrent_ratios(table: dict[str, list[float]]) -> None:
    if not table:
        return
    sizes = table.get("total_bytes") if isinstance(table, dict) else None
    ratios = table.get("ratios") if isinstance(table, dict) else None
    if (not isinstance(table, dict) or set(table) != {"total_bytes", "ratios"}
            or not isinstance(sizes, list) or not isinstance(ratios, list)
            or not sizes or len(sizes) != len(ratios)
            or not all(_is_number(v) and 0 < v < float("inf") for v in sizes)
            or any(b <= a for a, b in zip(sizes, sizes[1:]))
            or not all(_is_number(r) and 0.5 <= r <= 1 for r in ratios)):
        raise InputError(
            f"Devices.concurrent_collective_ratios must be {{}} or {{\"total_bytes\": "
            f"[increasing positive sizes], \"ratios\": [as many ratios in [0.5, 1]]}}, got "
            f"{table!r}"
        )


LINK_SCOPES = ("intra_node", "inter_node", "world")
"""Scopes of link figures: collectives inside a node, collectives that cross nodes, and (link
figures only) a ring over every rank of every node as measured."""


def _check_margin(margin: Any) -> None:
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise InputError(f"Devices.memory_margin={margin!r} is not a share of the memory limit: "
                         "give a float in [0, 1), e.g. 0.03 to plan for 97 %")


def device_memory_bytes(device: Any = None) -> int:
    """The memory a rank on ``device`` plans for when no limit is given: a GPU's whole memory
    (``torch.cuda.mem_get_info``), else ``DEFAULT_CPU_MEMORY_BYTES``."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[1])
    return DEFAULT_CPU_MEMORY_BYTES


_FIGURES = (*_POSITIVE_RATES, *_NON_NEGATIVE_TIMES, "collective_links", "collective_times",
            "concurrent_collective_ratio", "concurrent_collective_ratios", "overlap_efficiency",
            "overlap_hides_latency", "prefetch_waits_for_ranks",
            "optimizer_element_time_s", "optimizer_tensor_time_s",
            "optimizer_sharded_tensor_time_s", "param_host_time_s", "bucket_host_time_s",
            "host_overlaps_device", "attention_efficiency", "compute_flops_per_s_by_dtype")
"""The fields of :class:`Devices` that are rates and times (not the world or the limit)."""

_DEFAULTS = Devices()

"""What the memory and step-time models read off a profiled, normalised graph: which storage
each node's output shares, who saves it for backward, where gradients flow, and the parameter
groups with their strategies (:class:`ParamState`)."""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from torch import fx

from ..core.buckets import SMALL_PARAM_BYTES, block_of, gather_buckets
from ..core.node_meta import NodeRole, osdp_meta
from ..core.regions import find_regions
from ..core.strategies import traits
from ..errors import InputError
from .compute import CALL_OPS, ComputeTime, node_compute_time_s
from .memory import gathered_param_bytes

if TYPE_CHECKING:
    from ..core.devices import Devices

_T = TypeVar("_T")
_A = TypeVar("_A")


@dataclasses.dataclass(frozen=True)
class ParamState:
    """What the timeline needs about one parameter group."""

    numel: int
    """Elements of the full parameter."""
    element_size: int
    """Bytes per element."""
    strategy: str
    """replicate, shard_grad_op or full_shard."""
    trainable: bool
    """Whether it gets a gradient and optimizer state."""
    compute_element_size: int | None = None
    """Mixed precision: bytes per element of the gathered / cast parameter (None: its own)."""
    reduce_element_size: int | None = None
    """Mixed precision: bytes per element of the reduced gradient (None: its own)."""
    row: int = 1
    """Elements of one row (dim 0 index): shards are whole rows (``core.layout.row_numel``)."""
    gathered_dtype: str = ""
    """The dtype its all-gather moves: the compute dtype of a float parameter under mixed
    precision, else its own ('int8' for a packed quantized weight)."""
    packed: bool = False
    """A tensor of a 4-bit weight's format (its packed bytes or a scale, ``ParamSpec.format``),
    gathered in its stored dtype in one byte buffer with the others of its weight."""

    @property
    def gather_kind(self) -> str:
        """What a sharded parameter's gather must share with another's to ride in one bucket
        (one flat buffer): the strategy and the dtype moved (frozen and trainable parameters
        share: the bucket's reduce-scatter carries the trainable members' gradients), or, for
        a quantized weight's tensors, ``packed``: gathered as bytes, whatever their dtypes."""
        if self.packed:
            return f"{self.strategy}, packed"
        return f"{self.strategy}{f', {self.gathered_dtype}' if self.gathered_dtype else ''}"

    @property
    def compute_size(self) -> int:
        return self.compute_element_size or self.element_size

    @property
    def reduce_size(self) -> int:
        return self.reduce_element_size or self.element_size


@dataclasses.dataclass
class GraphFacts:
    """Storage roots, savers and gradient flow of a profiled, normalised graph."""

    nodes: list[fx.Node]
    """Nodes in graph order."""
    pos: dict[fx.Node, int]
    """Index of each node."""
    profile: dict[fx.Node, Any]
    """Each node's NodeProfile."""
    root: dict[fx.Node, fx.Node]
    """The node whose output storage each node's output shares (itself if new)."""
    members: dict[fx.Node, list[fx.Node]]
    """Nodes sharing each root's storage."""
    savers: dict[fx.Node, list[fx.Node]]
    """Nodes that save (a view of) each root's storage for backward."""
    requires_grad: dict[fx.Node, bool]
    """Whether each node's output takes part in backward."""
    param_of: dict[fx.Node, str]
    """Parameter get_attr nodes and their group names."""
    derived: dict[Any, Any] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                compare=False)
    """What :meth:`derive` computed (not copied by ``dataclasses.replace``: facts with another
    profile derive afresh)."""
    uses: dict[fx.Node, tuple[fx.Node, ...]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False)
    """What :meth:`param_uses` found, by parameter node."""

    @functools.cached_property
    def regions(self) -> dict[str, list[fx.Node]]:
        """The graph's recomputable regions (``core.regions.find_regions``), found once: every
        candidate plan's timeline and recomputation costs read them, and the graph does not
        change under its facts."""
        return find_regions(self.nodes[0].graph)

    def derive(self, fn: Callable[[GraphFacts, _A], _T], arg: _A) -> _T:
        """``fn(self, arg)``, computed once for the facts' lifetime: what the cost models derive
        from the facts and one more argument alone (each node's compute time on some devices,
        the activations' allocations under some recomputed regions), which a search asks for
        under every one of a hundred candidate plans. ``arg`` is a key by value when it is
        hashable, else by identity (``Devices``, whose throughputs are dicts: the same object
        must be passed again, and it is held so that its id is not reused)."""
        key: Any = (fn, arg)
        try:
            hash(key)
            by_value = True
        except TypeError:
            key, by_value = (fn, id(arg)), False
        hit = self.derived.get(key)
        if hit is None or not by_value and hit[0] is not arg:
            hit = self.derived[key] = (arg, fn(self, arg))
        return hit[1]

    def param_uses(self, node: fx.Node) -> tuple[fx.Node, ...]:
        """Nodes that read parameter node ``node`` or a view of it (excluding the views), found
        once per node (every candidate plan's timeline asks)."""
        uses = self.uses.get(node)
        if uses is None:
            uses = self.uses[node] = tuple(
                u for m in self.members[node] for u in m.users if self.root[u] is not node)
        return uses


def node_times(facts: GraphFacts, devices: Devices) -> dict[fx.Node, ComputeTime | None]:
    """Each node's forward and backward time on ``devices`` (``compute.node_compute_time_s``;
    None for a node that runs no operator), once per facts and devices."""
    return facts.derive(_node_times, devices)


def _node_times(facts: GraphFacts, devices: Devices) -> dict[fx.Node, ComputeTime | None]:
    return {n: node_compute_time_s(facts.profile[n], devices) if n.op in CALL_OPS else None
            for n in facts.nodes}


def graph_facts(gm: fx.GraphModule, trainable: Mapping[str, bool]) -> GraphFacts:
    """Analyse ``gm`` (profiled by ``profile_graph_pass``); ``trainable`` by parameter group."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_name = {n.name: n for n in nodes}
    prof = {n: osdp_meta(n).profile for n in nodes}
    missing = [n for n in nodes if prof[n] is None]
    if missing:
        raise InputError(f"node {missing[0].format_node()} has no profile: run "
                         "profile_graph_pass on the graph first")
    root: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        inputs = [a for a in n.all_input_nodes if prof[a].output_bytes > 0]
        # a parameter's mixed-precision cast counts as the parameter (its compute copy)
        view = inputs and n.op != "get_attr" and (prof[n].output_is_view
                                                  or osdp_meta(n).role == NodeRole.CAST)
        root[n] = root[inputs[0]] if view else n
    param_of = {n: osdp_meta(n).param for n in nodes if n.op == "get_attr" and osdp_meta(n).param}
    requires_grad: dict[fx.Node, bool] = {}
    for n in nodes:
        if n in param_of:
            requires_grad[n] = trainable[param_of[n]]
        else:
            requires_grad[n] = (
                n.op not in ("placeholder", "get_attr") and prof[n].output_bytes > 0
                and any(requires_grad[a] for a in n.all_input_nodes))
    members: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for n in nodes:
        members[root[n]].append(n)
    savers: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for j in nodes:
        p = prof[j]
        for name in (*p.saved_inputs, *p.saved_params):
            savers[root[by_name[name]]].append(j)
        if p.saved_output_bytes:
            savers[root[j]].append(j)
    # plain dicts: the facts are shared by every prediction of an analysis, which must not
    # add keys to them
    return GraphFacts(nodes, pos, prof, root, dict(members), dict(savers), requires_grad,
                      param_of)


def sharded_gather_buckets(facts: GraphFacts, params: Mapping[str, ParamState],
                           world_size: int,
                           small_bytes: int = SMALL_PARAM_BYTES,
                           region_first: Mapping[fx.Node, int] | None = None) -> list[list[fx.Node]]:
    """The forward all-gathers of the sharded parameters (their get_attr nodes), in the order
    the runtime issues them: each before the first node that reads its parameter (under mixed
    precision the cast, wherever the capture put it), runs of parameters of one sharded strategy
    bucketed into one (``buckets.gather_buckets`` with ``small_bytes``, a bucket holding a
    parameter that is not small within one block: ``buckets.block_of``). ``region_first``:
    the position of the first operator of the recomputed region each of its operators is in;
    a region's all-gathers all run before it, in the parameters' graph order
    (``passes/recompute.py``). Without ``region_first``, found once per facts for the same
    states (a plan's step time and its overlap ask alike): read the result, do not change it."""
    if region_first is None:
        return facts.derive(_gather_buckets, (tuple(params.items()), world_size, small_bytes))
    return _sharded_gather_buckets(facts, params, world_size, small_bytes, region_first)


def _gather_buckets(facts: GraphFacts,
                    key: tuple[tuple[tuple[str, ParamState], ...], int, int]) -> list[list[fx.Node]]:
    items, world_size, small_bytes = key
    return _sharded_gather_buckets(facts, dict(items), world_size, small_bytes, None)


def _sharded_gather_buckets(facts: GraphFacts, params: Mapping[str, ParamState],
                            world_size: int, small_bytes: int,
                            region_first: Mapping[fx.Node, int] | None) -> list[list[fx.Node]]:
    sharded = [n for n, name in facts.param_of.items()
               if traits(params[name].strategy).sharded and facts.param_uses(n)]
    at = region_first or {}
    # in the order the runtime gathers them: before the first node reading the parameter node
    # itself (its operator, a view of it, or its mixed-precision cast, which may sit far ahead
    # of the operator: ``passes/shard.py``)
    first = {n: min(at.get(u, facts.pos[u]) for u in n.users) for n in sharded}
    order = sorted(sharded, key=first.__getitem__)

    def key(n: fx.Node) -> tuple[str, int]:
        state = params[facts.param_of[n]]
        # gathers of different dtypes never share one flat buffer (but packed ones, as bytes)
        return (state.gather_kind,
                gathered_param_bytes(state.numel, element_size=state.element_size,
                                     world_size=world_size, row=state.row))

    def owner(n: fx.Node) -> fx.Node | None:  # the operator reading a quantized weight's tensors
        return (next(iter(facts.param_uses(n)), None)
                if params[facts.param_of[n]].packed else None)

    blocks = [block_of(facts.param_of[n]) for n in order]
    return [[order[i] for i in b]
            for b in gather_buckets([key(n) for n in order], small_bytes, blocks,
                                    [not params[facts.param_of[n]].trainable for n in order],
                                    [owner(n) for n in order])]


def regathered_together(facts: GraphFacts, params: Mapping[str, ParamState],
                        buckets: list[list[fx.Node]], world_size: int,
                        bucket_bytes: int) -> list[list[fx.Node]]:
    """The buckets of ``buckets`` whose members backward re-gathers in one all-gather: those of
    several parameters that add up to at most ``bucket_bytes`` (a longer run of small
    parameters is re-gathered member by member)."""
    def nbytes(n: fx.Node) -> int:
        state = params[facts.param_of[n]]
        return gathered_param_bytes(state.numel, element_size=state.element_size,
                                    world_size=world_size, row=state.row)

    return [b for b in buckets if len(b) > 1 and sum(map(nbytes, b)) <= bucket_bytes]


def small_gather_key(state: ParamState, world_size: int,
                     small_bytes: int = SMALL_PARAM_BYTES) -> str | None:
    """What a sharded parameter's gather must share with a neighbour's to ride in its bucket
    (:func:`sharded_gather_buckets`: the strategy), or None when it never rides (larger than
    the bucket, ``small_bytes``, and than :data:`~osdp_fx.core.buckets.SMALL_PARAM_BYTES`
    gathered)."""
    nbytes = gathered_param_bytes(state.numel, element_size=state.element_size,
                                  world_size=world_size, row=state.row)
    return state.gather_kind if nbytes <= max(small_bytes, SMALL_PARAM_BYTES) else None


SPLIT_BEFORE = 1 / 16
"""How long before the backward of the operator that unpacks it a re-gathered bucket is split."""
PREFETCH_BEFORE = 1 / 32
"""How long before that operator's backward the re-gathers its unpacking prefetches start."""


@dataclasses.dataclass(frozen=True)
class Regather:
    """Backward's first re-gather of one full_shard parameter (``StepContext``)."""

    start: float
    """When its all-gather starts (allocating its buffer)."""
    split: float
    """When its copy exists: ``start`` when gathered alone; when gathered with its bucket's
    other saved members, when the first of them is unpacked (the flat buffer is split)."""
    flat_bytes: int
    """The bytes of its bucket's flat buffer, alive from ``start`` to ``split``, charged on
    the bucket's first member (0 on the others and alone)."""


def prefetched_regathers(
    regathered: list[fx.Node], savers: Mapping[fx.Node, list[fx.Node]],
    pos: Mapping[fx.Node, int], bwd: Any, prefetch: int,
    buckets: list[list[fx.Node]] | None = None, gathered_bytes: Mapping[fx.Node, int] | None = None,
) -> dict[tuple[fx.Node, fx.Node], Regather]:
    """Backward's first re-gather of each full_shard parameter, keyed by (parameter, saver).
    The saved members of one forward gather bucket (``buckets``) are re-gathered in one
    all-gather when the first of them is unpacked; unpacking one starts gathering the
    ``prefetch`` re-gathers (parameters or buckets) forward saved just before it."""
    saved_order = sorted(regathered, key=lambda n: min(pos[j] for j in savers[n]))
    first_unpack = {n: max(savers[n], key=pos.__getitem__) for n in regathered}
    index = {n: i for i, n in enumerate(saved_order)}
    units: list[list[fx.Node]] = []
    seen: set[fx.Node] = set()
    bucket_of = {n: b for b in (buckets or []) for n in b}
    for n in saved_order:
        if n not in seen:
            unit = sorted((m for m in bucket_of.get(n, [n]) if m in index), key=index.__getitem__)
            seen.update(unit)
            units.append(unit)
    own = [min(bwd(pos[first_unpack[m]]) for m in unit) for unit in units]
    out: dict[tuple[fx.Node, fx.Node], Regather] = {}
    for i, unit in enumerate(units):
        # Unpacking waits for its own re-gather and splits it (a bucket's flat buffer and its
        # copies both alive, then the flat freed) before it starts the prefetched ones, and
        # all of that before the operator's backward allocates anything.
        by = min(range(i, min(len(units), i + 1 + prefetch)), key=own.__getitem__)
        start = own[by] - (SPLIT_BEFORE if by == i else PREFETCH_BEFORE)
        flat = sum(gathered_bytes[m] for m in unit) if len(unit) > 1 and gathered_bytes else 0
        split = own[i] - SPLIT_BEFORE if len(unit) > 1 else start
        for k, m in enumerate(unit):
            out[(m, first_unpack[m])] = Regather(start, split, 0 if k else flat)
    return out


SCALAR_BYTES = 8
"""An output of at most this many bytes is a scalar (one element of any dtype): a loss."""


def activation_grad_intervals(facts: GraphFacts,
                              bwd: Callable[[int], float]) -> list[tuple[float, float, int]]:
    """(allocated at, freed after, bytes at the profiled batch) of the gradients flowing
    backward through activations.

    A node's output gradient lives from the backward of the last node that reads its storage (it
    or a view of it: the views' gradients are views of one gradient buffer, made by the backward
    of the last operator that reads any of them) to the node's own backward. A storage several
    operators read directly (a residual stream, the input of a split linear's parts) gets its
    gradient summed out of place (autograd's input buffer): the backward of every direct reader
    but the first to run allocates its contribution, and a quarter step later the sum, while
    the gradient so far is alive. A scalar output (the loss) gets the gradient
    ``loss.backward()`` starts from (``ones_like(loss)``), which the caller holds until backward
    returns. When that last reader's backward returns its own output's gradient as the node's
    (``NodeProfile.grad_passthrough``: a residual addition gives both operands the gradient it
    received), the two are one tensor: counted once, from the earlier start to the later end."""
    pos, prof, out = facts.pos, facts.profile, []
    spans: dict[fx.Node, tuple[float, float, int]] = {}
    same: dict[fx.Node, fx.Node] = {}  # a gradient -> the one whose storage it is (union-find)
    links: list[tuple[fx.Node, fx.Node]] = []  # (node, reader whose output's gradient it gets)

    def owner(n: fx.Node) -> fx.Node:
        while same.get(n, n) is not n:
            n = same[n]
        return n

    for n in facts.nodes:
        if n.op == "output":
            out += [(bwd(pos[n]), bwd(0), prof[a].output_bytes) for a in n.all_input_nodes
                    if facts.requires_grad[a] and 0 < prof[a].output_bytes <= SCALAR_BYTES]
        if (not facts.requires_grad[n] or n in facts.param_of or prof[n].output_is_view
                or n.op == "output"):
            continue
        grad_users = [u for m in facts.members.get(n, []) for u in m.users
                      if u.op != "output" and facts.requires_grad[u] and facts.root[u] is not n]
        if not grad_users:
            continue
        nbytes = prof[n].output_bytes
        last = max(grad_users, key=pos.__getitem__)
        spans[n] = (bwd(pos[last]), bwd(pos[n]), nbytes)
        if any(m.name in prof[last].grad_passthrough for m in facts.members.get(n, [])):
            links.append((n, facts.root[last]))
        direct = sorted({pos[u] for u in n.users if u.op != "output" and facts.requires_grad[u]})
        for p in direct[:-1]:  # the last reader's backward runs first and makes the buffer
            out += [(bwd(p), bwd(p) + 0.25, nbytes), (bwd(p) + 0.25, bwd(p) + 0.25, nbytes)]
    for n, given in links:
        if given in spans and owner(n) is not owner(given):
            same[owner(n)] = owner(given)
    merged: dict[fx.Node, tuple[float, float, int]] = {}
    for n, (start, end, nbytes) in spans.items():
        s0, e0, b0 = merged.get(owner(n), (start, end, nbytes))
        merged[owner(n)] = (min(s0, start), max(e0, end), max(b0, nbytes))
    return out + list(merged.values())

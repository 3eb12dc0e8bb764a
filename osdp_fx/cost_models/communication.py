"""Communication cost model: alpha-beta (latency-bandwidth) times of ring collectives.

A ring collective over ``p`` ranks moves a message of ``n`` bytes in ``p - 1`` steps; each step
sends ``n / p`` bytes per rank over a link of bandwidth ``B`` (bytes/s) and pays a fixed latency
``alpha`` (s):

- all-gather (each rank has ``n / p``, all end with ``n``):  ``(p-1)/p * n / B + (p-1) * alpha``
- reduce-scatter (each rank has ``n``, ends with its ``n / p``): the same
- all-reduce = reduce-scatter + all-gather:  ``2 (p-1)/p * n / B + 2 (p-1) * alpha``

``n`` is always the *total* (unsharded, padded) size of the tensor in bytes. ``B`` is the bus
bandwidth one rank sees. A group inside one node runs at the intra-node figures of
:class:`~osdp_fx.core.devices.Devices`; one rank per node (hybrid sharding's cross-node groups)
at its inter-node figures, one rank's network link; a ring over several ranks of each of several
nodes as NCCL runs it, its hops across nodes spread over every network link of a node
([Note: rings across nodes], :func:`group_link`).

Where a collective's times were measured at several sizes over a group of the same size
(``Devices.collective_times``, which ``detect_devices`` records), it is priced on the polyline
through them instead ([Note: priced from the timed sizes]).

All functions are pure; :func:`fit_link` inverts the model to turn measured collective times into
a :class:`Link` (used by ``detect_devices``).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.strategies import COLLECTIVES, Collective
from ..errors import InputError

if TYPE_CHECKING:
    from ..core.devices import Devices

__all__ = [
    "COLLECTIVES",
    "Collective",
    "CollectiveSample",
    "Link",
    "all_gather_time_s",
    "all_reduce_parts_s",
    "all_reduce_time_s",
    "collective_time_s",
    "fit_link",
    "group_link",
    "scope_link",
    "reduce_scatter_time_s",
]



@dataclasses.dataclass(frozen=True)
class Link:
    """Figures of the links a collective runs over."""

    bandwidth_bytes_per_s: float
    """Per-rank bus bandwidth B."""
    latency_s: float
    """Fixed cost alpha of one ring step."""


def _check(total_bytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_s: float) -> None:
    if group_size < 1:
        raise InputError(f"a collective needs a group of at least 1 rank, got group_size={group_size}")
    if total_bytes < 0:
        raise InputError(f"a collective cannot move a negative number of bytes ({total_bytes})")
    if not bandwidth_bytes_per_s > 0 or not math.isfinite(bandwidth_bytes_per_s):
        raise InputError(
            f"collective bandwidth must be a positive finite number of bytes/s, got "
            f"{bandwidth_bytes_per_s!r}: fix the *_bandwidth_bytes_per_s fields of Devices"
        )
    if not latency_s >= 0 or not math.isfinite(latency_s):
        raise InputError(
            f"collective latency must be a non-negative finite number of seconds, got "
            f"{latency_s!r}: fix the *_latency_s fields of Devices"
        )


def _ring_steps_time_s(
    total_bytes: float, group_size: int, *, phases: int,
    bandwidth_bytes_per_s: float, latency_s: float,
) -> float:
    _check(total_bytes, group_size, bandwidth_bytes_per_s, latency_s)
    p = group_size
    if p == 1:
        return 0.0
    return phases * ((p - 1) / p * total_bytes / bandwidth_bytes_per_s + (p - 1) * latency_s)


def all_gather_time_s(
    total_bytes: float, group_size: int, *, bandwidth_bytes_per_s: float, latency_s: float
) -> float:
    """Ring all-gather of a tensor of ``total_bytes`` bytes (gathered size) over ``group_size`` ranks.

    ``T = (p-1)/p * n / B + (p-1) * alpha``; 0 for a group of one rank.
    """
    return _ring_steps_time_s(
        total_bytes, group_size, phases=1,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s,
    )


def reduce_scatter_time_s(
    total_bytes: float, group_size: int, *, bandwidth_bytes_per_s: float, latency_s: float
) -> float:
    """Ring reduce-scatter of a tensor of ``total_bytes`` bytes (unsharded input size).

    ``T = (p-1)/p * n / B + (p-1) * alpha``: the all-gather's steps in reverse (the reduction's
    arithmetic is neglected).
    """
    return all_gather_time_s(
        total_bytes, group_size, bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s
    )


def all_reduce_time_s(
    total_bytes: float, group_size: int, *, bandwidth_bytes_per_s: float, latency_s: float
) -> float:
    """Ring all-reduce of ``total_bytes`` bytes: a reduce-scatter followed by an all-gather.

    ``T = 2 (p-1)/p * n / B + 2 (p-1) * alpha``.
    """
    return _ring_steps_time_s(
        total_bytes, group_size, phases=2,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s, latency_s=latency_s,
    )


_TIME_FUNCTIONS = {
    "all_gather": all_gather_time_s,
    "reduce_scatter": reduce_scatter_time_s,
    "all_reduce": all_reduce_time_s,
}


def scope_link(devices: Devices, collective: Collective, scope: str) -> Link:
    """The figures of one scope (``"intra_node"``: a node's links; ``"inter_node"``: one rank's
    network link) for ``collective``: its own entry in ``devices.collective_links`` where there
    is one, else the scope's figures."""
    own = devices.collective_links.get(f"{scope}.{collective}")
    if own is not None:
        return Link(own["bandwidth_bytes_per_s"], own["latency_s"])
    return Link(getattr(devices, f"{scope}_bandwidth_bytes_per_s"),
                getattr(devices, f"{scope}_latency_s"))


def group_link(
    devices: Devices, collective: Collective, *, group_size: int | None = None,
    spans_nodes: bool | None = None,
) -> Link:
    """The link figures ``collective`` over ``group_size`` ranks of ``devices`` runs at, one
    ring step's latency and the bus bandwidth one rank sees (:func:`scope_link` per scope).

    ``group_size`` defaults to the whole world. Ranks are assumed placed node by node, so a group
    of consecutive ranks spans nodes when it is larger than ``devices.ranks_per_node``; pass
    ``spans_nodes`` to say so explicitly (e.g. True for the ranks with the same local index on
    every node, as in the cross-group all-reduce of hybrid sharding: a group spanning nodes that
    is no larger than the number of nodes has one rank per node).

    [Note: rings across nodes] NCCL runs a collective over ``R`` ranks of each of ``m`` nodes as
    rings through every rank of a node in turn, one ring per channel, and routes the channels'
    hops from node to node through different ranks' network links: the node's traffic to the
    next node is spread over its ``R`` links, so the ring moves data at
    ``min(B_intra, R * B_net)`` per rank (``B_net``: one rank's network link, the inter-node
    figure), and of a ring's ``m R - 1`` steps ``m - 1`` cross nodes at the inter-node latency
    and the others stay in a node (their latencies averaged over the steps here). Where that
    ring over the whole world was measured (``collective_links["world.<collective>"]``, which
    ``detect`` records), the world's collectives run at the measured figures instead: on nodes
    that share one machine's cores the node's ring can be the slower one, which the rule
    cannot express. This is the
    ring bandwidth of NCCL's tuning model on NVSwitch nodes (meta-pytorch/autoparallel
    ``cost_models/nccl_cost_model.py`` ports it) and its ring latency of intra- and inter-node
    steps; an all-reduce may run as trees instead ([Note: trees across nodes]); NVLS is not
    modelled.
    """
    size = devices.world_size if group_size is None else group_size
    scope = _scope_of(devices, size, spans_nodes)
    if scope in ("intra_node", "inter_node"):
        return scope_link(devices, collective, scope)
    measured = devices.collective_links.get(f"world.{collective}")
    if scope == "world" and measured is not None:
        return Link(measured["bandwidth_bytes_per_s"], measured["latency_s"])
    per_node = devices.ranks_per_node or size
    nodes = size // per_node
    intra = scope_link(devices, collective, "intra_node")
    net = scope_link(devices, collective, "inter_node")
    steps = size - 1
    return Link(min(intra.bandwidth_bytes_per_s, per_node * net.bandwidth_bytes_per_s),
                ((size - nodes) * intra.latency_s + (nodes - 1) * net.latency_s) / steps)


def _scope_of(devices: Devices, size: int, spans_nodes: bool | None) -> str | None:
    """The scope of figures a group of ``size`` ranks of ``devices`` runs at, as
    :func:`group_link` places it: ``"intra_node"``, ``"inter_node"`` (one rank per node),
    ``"world"`` (a ring over the whole world of nodes of several ranks), or None (a ring over
    several ranks of some of the nodes, at the rule of [Note: rings across nodes])."""
    if spans_nodes is None:
        spans_nodes = devices.ranks_per_node is not None and size > devices.ranks_per_node
    if not spans_nodes:
        return "intra_node"
    per_node = devices.ranks_per_node or size
    if size <= devices.num_nodes or size // per_node < 2 or per_node < 2:
        return "inter_node"  # one rank per node: each crossing over one rank's link
    return "world" if size == devices.world_size else None


TREE_BANDWIDTH_SHARE = 0.92
"""Share of a ring's bus bandwidth NCCL's tuning model gives a tree all-reduce across nodes
(``src/graph/tuning.cc``: the tree's bus bandwidth is the ring's times 0.92)."""


def all_reduce_parts_s(
    total_bytes: float, devices: Devices, *, group_size: int | None = None,
    spans_nodes: bool | None = None,
) -> tuple[float, float]:
    """An all-reduce of ``total_bytes`` over a group of ``devices`` (as :func:`group_link`
    places it) as ``(seconds per byte, latency seconds)``: its time is ``per_byte * n +
    latency``. A ring's, or where ``devices.all_reduce_trees`` and the group spans nodes, the
    faster at ``total_bytes`` of the ring and the tree, as NCCL picks.

    [Note: trees across nodes] NCCL also runs an all-reduce as two binary trees over the nodes,
    each node's ranks a chain hanging from its tree rank: the gradient is reduced up the chains
    and the trees and broadcast back down, ``2 ((R - 1) alpha_intra + floor(log2 m) alpha_net)``
    of latency for ``R`` ranks on each of ``m`` nodes where a ring pays ``2 (m R - 1)`` steps,
    and each rank moves ``2 n`` bytes at :data:`TREE_BANDWIDTH_SHARE` of the ring's bus bandwidth
    (the ring moves ``2 (p - 1) / p n``). NCCL's tuning model (``src/graph/tuning.cc``) gives
    both and picks, per message size, the one it predicts faster: the tree for small messages
    over many nodes, the ring for large ones. Its per-channel caps on the tree's bandwidth, its
    other protocols (LL, LL128) and NVLS are not modelled. Where the group's times were
    measured (``devices.collective_times``), the time at ``total_bytes`` is theirs
    ([Note: priced from the timed sizes]), split into the fixed cost it starts from and the
    mean rate above it."""
    size = devices.world_size if group_size is None else group_size
    table = _timed(devices, "all_reduce", size, spans_nodes)
    line = _line_all_reduce_parts_s(total_bytes, devices, size, spans_nodes)
    if table is None:
        return line
    fixed = min(line[1], table["seconds"][0])
    if total_bytes == 0:  # the rate of the first stretch
        return (table["seconds"][0] - fixed) / table["total_bytes"][0], fixed
    return (_interpolated_s(table, fixed, total_bytes) - fixed) / total_bytes, fixed


def _line_all_reduce_parts_s(total_bytes: float, devices: Devices, size: int,
                             spans_nodes: bool | None) -> tuple[float, float]:
    """:func:`all_reduce_parts_s` at the link figures (not the timed sizes)."""
    link = group_link(devices, "all_reduce", group_size=size, spans_nodes=spans_nodes)
    _check(total_bytes, size, link.bandwidth_bytes_per_s, link.latency_s)
    if size == 1:
        return 0.0, 0.0
    ring = (2 * (size - 1) / size / link.bandwidth_bytes_per_s, 2 * (size - 1) * link.latency_s)
    if spans_nodes is None:
        spans_nodes = devices.ranks_per_node is not None and size > devices.ranks_per_node
    if not (devices.all_reduce_trees and spans_nodes):
        return ring
    per_node = 1 if size <= devices.num_nodes else devices.ranks_per_node or size
    nodes = size // per_node
    if nodes < 2:
        return ring
    intra = scope_link(devices, "all_reduce", "intra_node").latency_s
    net = scope_link(devices, "all_reduce", "inter_node").latency_s
    tree = (2 / (TREE_BANDWIDTH_SHARE * link.bandwidth_bytes_per_s),
            2 * ((per_node - 1) * intra + (nodes.bit_length() - 1) * net))
    return min(ring, tree, key=lambda parts: parts[0] * total_bytes + parts[1])


def collective_time_s(
    collective: Collective,
    total_bytes: float,
    devices: Devices,
    *,
    group_size: int | None = None,
    spans_nodes: bool | None = None,
) -> float:
    """Predicted time of ``collective`` on ``total_bytes`` bytes over a group of ``devices``,
    at the collective's link figures (:func:`group_link`).

    ``group_size`` (default: the world) and ``spans_nodes`` choose intra- or inter-node figures
    as in :func:`group_link`. Where the group's times were measured
    (``devices.collective_times``), the time is theirs ([Note: priced from the timed sizes]).
    """
    if collective not in _TIME_FUNCTIONS:
        raise InputError(
            f"unknown collective {collective!r}: use one of {', '.join(COLLECTIVES)}"
        )
    size = devices.world_size if group_size is None else group_size
    if collective == "all_reduce":
        per_byte, latency = all_reduce_parts_s(total_bytes, devices, group_size=size,
                                               spans_nodes=spans_nodes)
        return per_byte * total_bytes + latency
    link = group_link(devices, collective, group_size=size, spans_nodes=spans_nodes)

    def line_s(nbytes: float) -> float:
        return _TIME_FUNCTIONS[collective](
            nbytes, size,
            bandwidth_bytes_per_s=link.bandwidth_bytes_per_s, latency_s=link.latency_s,
        )

    time_s = line_s(total_bytes)
    table = _timed(devices, collective, size, spans_nodes)
    if table is None:
        return time_s
    return _interpolated_s(table, min(line_s(0), table["seconds"][0]), total_bytes)


def _timed(devices: Devices, collective: Collective, size: int,
           spans_nodes: bool | None) -> dict | None:
    """The measured times ``collective`` over a group of ``size`` ranks is priced from
    (``devices.collective_times`` of its scope, timed over a group of the same size), or None."""
    scope = _scope_of(devices, size, spans_nodes)
    table = devices.collective_times.get(f"{scope}.{collective}") if scope else None
    return table if table is not None and table["group_size"] == size else None


def _interpolated_s(table: dict, fixed_s: float, total_bytes: float) -> float:
    """The time of ``total_bytes`` on the polyline through ``(0, fixed_s)`` and the timed
    sizes of ``table``, continued past the last at the rate of the last two.

    [Note: priced from the timed sizes] A collective's measured times need not lie on the
    ring model's straight line: CPU gloo's rate changes with the size (its times over
    4 KiB-16 MiB bend upwards at world 4, so that one line fitted to all of them prices the
    middle sizes above their times and the largest below: ``docs/cost-models.md``). Where the
    sizes were timed, a size between two of them costs the time on the straight line between
    the two, which is every timed size's own time and follows the curve between them; below
    the first timed size the line runs from the fitted fixed cost (the collective's time at
    0 bytes at its link figures, which bucketed collectives share; no more than the first
    timed size's time), and past the last at the rate between the last two, the rate of the
    largest messages."""
    sizes, times = table["total_bytes"], table["seconds"]
    xs, ys = [0.0, *sizes], [fixed_s, *times]
    i = min(bisect.bisect_right(xs, total_bytes), len(xs) - 1)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (total_bytes - xs[i - 1]) / (xs[i] - xs[i - 1])


@dataclasses.dataclass(frozen=True)
class CollectiveSample:
    """One measured collective, an input of :func:`fit_link`."""

    collective: Collective
    """Which collective ran: 'all_gather', 'reduce_scatter' or 'all_reduce'."""
    total_bytes: float
    """Total (unsharded) message size n in bytes."""
    group_size: int
    """Ranks p in the group (at least 2 to carry information)."""
    time_s: float
    """Measured time (median over repeats, slowest rank)."""


_MIN_LATENCY_S = 1e-7
"""Floor of a fitted latency: a fit on noisy data may otherwise give 0 or less."""


def fit_link(samples: Sequence[CollectiveSample]) -> Link:
    """Fit ``B`` and ``alpha`` of the ring model to measured collective times.

    Each sample gives ``t = a * n / B + l * alpha`` with ``(a, l) = ((p-1)/p, p-1)`` for
    all-gather and reduce-scatter and twice that for all-reduce. The fit is a least-squares fit
    of ``(1/B, alpha)`` on *relative* errors (rows divided by ``t``) so small messages, which
    carry the latency, count as much as large ones; both unknowns are kept positive.
    """
    rows: list[tuple[float, float]] = []
    for s in samples:
        if s.group_size < 2 or s.time_s <= 0 or s.total_bytes <= 0:
            continue
        phases = 2 if s.collective == "all_reduce" else 1
        p = s.group_size
        rows.append((phases * (p - 1) / p * s.total_bytes / s.time_s, phases * (p - 1) / s.time_s))
    if len(rows) < 2:
        raise InputError(
            "fitting link bandwidth and latency needs at least two collective timings of "
            "positive size and time over groups of 2 or more ranks"
        )
    inverse_bandwidth, latency = _nonnegative_least_squares_2(rows)
    if inverse_bandwidth <= 0:  # all time explained by latency: take the best rate observed
        inverse_bandwidth = 1.0 / max(r[0] for r in rows)
    return Link(bandwidth_bytes_per_s=1.0 / inverse_bandwidth, latency_s=max(latency, _MIN_LATENCY_S))


def _nonnegative_least_squares_2(rows: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """argmin over x, y >= 0 of sum (a x + b y - 1)^2 for rows (a, b)."""
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if det > 0:
        x = (sa * sbb - sb * sab) / det
        y = (saa * sb - sab * sa) / det
        if x >= 0 and y >= 0:
            return x, y
    # The optimum lies on a boundary: fit one unknown with the other at zero, keep the better.
    candidates = [(sa / saa, 0.0), (0.0, sb / sbb)]

    def residual(xy: tuple[float, float]) -> float:
        return sum((a * xy[0] + b * xy[1] - 1) ** 2 for a, b in rows)

    return min(candidates, key=residual)

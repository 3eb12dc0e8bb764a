r"""Exact minimum-time choice of one option per operator under a peak-memory limit.

The problem
-----------
There are ``n`` operators (parameter groups). Operator ``i`` has options ``j = 0 .. k_i - 1``
(a strategy, a split factor, ...), each with a time ``t[i, j]`` (seconds), a persistent memory
``p[i, j]`` (bytes held for the whole training step: shards, gradients, optimizer state) and a
transient memory ``r[i, j]`` (bytes alive only while operator ``i`` runs, e.g. its gathered
parameter). With ``B`` the base memory (activations, workspace, overhead) and ``L`` the limit,
the search solves

.. math::

    \min_{j_0, \dots, j_{n-1}} \sum_i t[i, j_i]
    \quad \text{s.t.} \quad
    B + \sum_i p[i, j_i] + \max_i r[i, j_i] \le L .

The ``max`` makes the constraint non-additive; it is removed exactly by enumerating its value.
For every candidate ``T`` in the sorted distinct transient values (:func:`_transient_candidates`,
starting at the smallest ``T`` every operator can meet), the restricted problem is a
multiple-choice knapsack:

.. math::

    \mathrm{MCK}(T) = \min \sum_i t[i, j_i]
    \quad \text{s.t.} \quad
    r[i, j_i] \le T \;\; \forall i, \qquad
    \sum_i \lceil p[i, j_i] / g \rceil \le \lfloor (L - B - T) / g \rfloor ,

and the answer is ``min_T MCK(T)``: the optimum's own largest transient is one of the candidates,
and it is feasible for that ``T``. Caps are solved best-first by a Lagrangian lower bound on
``MCK(T)`` (:func:`_bounded_caps`), stopping as soon as the next cap's bound exceeds the best plan
found; this skips only caps that cannot win, so the answer stays exact, and it keeps hundreds of
distinct transient sizes to a handful of dynamic programmes. Each constraint is built by one
function:

- *one option per operator, padding excluded* (time ``+inf`` marks a padded or invalid option):
  :func:`_as_tables` turns ragged lists into rectangular arrays and a validity mask;
- *transient cap* ``r[i, j_i] <= T``: :func:`_allowed_options` (caps that cannot hold any plan are
  dropped by :func:`_bounded_caps`);
- *persistent memory in cells*: :func:`_persistent_cells` rounds every option's persistent bytes
  **up** to whole cells of ``g = granularity_bytes``, so a plan the search accepts never exceeds
  the limit in bytes. The rounding costs at most ``n * g`` bytes of the budget, so the search is
  exact for the discretised problem and conservative (never optimistic) for the byte-exact one;
  ``granularity_bytes=1`` makes it byte-exact;
- *budget* ``floor((L - B - T) / g)`` cells, inclusive: :func:`_budget_cells`;
- *operators that repeat*: :func:`_classes` groups operators with equal rows (times, cells,
  transient bytes) into one class with a multiplicity ``m``: the decoder layers of a
  transformer give each of their groups the same row. The problem is then a multiple-choice
  knapsack with multiplicities, solved over classes ([Note: classes]); the caps' bounds are
  computed per class too, each class counting its members;
- *objective*: :func:`_knapsack_min_time`, a dynamic programme over classes whose state is the
  number of cells still free, vectorised with numpy over that memory axis (one Python iteration
  per class and frontier point, none per cell). It keeps the arg-min point of every (class,
  free cells) state and reads the plan back, and :func:`_assign` gives each member its option;
- *nothing fits*: :func:`_least_peak_bytes` computes exactly (in bytes, without rounding) the least
  peak memory any choice needs, which the :class:`~osdp_fx.errors.PlanError` reports together
  with the operators that dominate it.

[Note: classes]
A class of ``m`` equal operators with options ``(cells c_j, time t_j)`` chooses how many of its
members take each option; its choices are the ``m``-fold sums of its options.
:func:`_frontier` builds them by doubling (the choices of ``2a`` members are the sums of two
choices of ``a``) and keeps, after each sum, only the choices no other beats: one that takes no
more cells and less time beats it (:func:`_pruned`). The programme then takes one point of each
class's frontier. It is exact: a beaten choice can never be the better one in any state,
because the least time of the other classes only falls as cells are freed. Its work is the
frontiers' sizes times the cells, against ``m`` times the options times the cells row by row;
the frontier of ``m`` members with two useful options has ``m + 1`` points, and options that
no choice needs (a larger and slower one) drop out at once. ``tests/planner/test_solver.py``
checks the answers against brute force over every operator separately.

[Note: members of a class]
The exact problem cannot tell the members of a class apart, but the memory timeline can: the
first blocks of a model run first in forward and last in backward, where a sharded parameter
is gathered again and a recomputed region runs again when most activations are already freed.
The rows the planner builds list first the option that holds the most memory (replicate; save
every activation) and after it those that hold less (the sharded strategies; recomputation),
so the members of a class take the chosen options in decreasing index, first member first:
the first blocks shard and recompute, the last keep.

Ties are broken deterministically: among the optimal plans (equal floating-point totals) the
one returned comes first when each class's members' options, sorted, are compared class by
class (classes in the order of their first operator); a tie between options goes to the lower
index. The same problem with no transient memory (``transient_bytes=None``), integer memory
tables and ``granularity_bytes`` equal to their unit is the OSDP reference scheduler's search
(``benchmarks/search_seed_table.py`` reproduces its published result).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, PlanError
from ..units import format_bytes, parse_bytes

logger = logging.getLogger(__name__)

DEFAULT_TARGET_CELLS = 16384
"""Cells the default granularity divides ``limit - base`` into: the dynamic programme's work is
operators x options x cells, small for graphs of hundreds of operators. Rounding to cells costs
at most ``n / 16384`` of the room left after the base memory."""

MAX_CELLS = 1 << 24
"""Largest memory axis the dynamic programme accepts; a smaller granularity is an input error."""

_BOUND_PRICES = 48
"""Prices per cell at which the Lagrangian lower bound of a transient cap is evaluated."""

_DOMINANT_SHOWN = 3
"""How many dominating operators a PlanError names."""

Table = Sequence[Sequence[float]] | np.ndarray


@dataclass(frozen=True)
class SearchResult:
    """The chosen option of every operator and what that choice costs."""

    choices: tuple[int, ...]
    """Option index chosen for each operator, in operator order."""
    total_time_s: float
    """Sum of the chosen options' times (seconds)."""
    peak_bytes: int
    """Exact peak memory of the choice: base + sum of persistent + largest transient (bytes)."""
    persistent_bytes: int
    """Sum of the chosen options' persistent memory (bytes, not rounded to cells)."""
    transient_bytes: int
    """Largest transient memory among the chosen options (bytes)."""
    limit_bytes: int
    """The memory limit searched under (bytes)."""
    granularity_bytes: int
    """Cell size the persistent memory was rounded up to (bytes)."""


@dataclass(frozen=True)
class _Tables:
    """Rectangular cost tables; padded entries have ``valid`` False and time ``+inf``."""

    time_s: np.ndarray
    """float64 (n, k)."""
    persistent_bytes: np.ndarray
    """int64 (n, k), 0 where padded."""
    transient_bytes: np.ndarray
    """int64 (n, k), 0 where padded."""
    valid: np.ndarray
    """bool (n, k)."""


@dataclass(frozen=True)
class _Class:
    """Operators whose rows are equal: one multiple-choice item with a multiplicity."""

    row: int
    """The first member, whose row stands for all."""
    members: np.ndarray
    """int64 operator indices, increasing."""


@dataclass(frozen=True)
class _Frontier:
    """Choices of the members of one class (how many take each option) that can be optimal,
    in tie-breaking order (:func:`_pruned`)."""

    cells: np.ndarray
    """int64 (P,): persistent cells of each choice."""
    time_s: np.ndarray
    """float64 (P,): its total time."""
    counts: np.ndarray
    """int64 (P, k): how many members take each option."""


@dataclass(frozen=True)
class _Cap:
    """One candidate value of the largest transient memory."""

    bound: float
    """Lower bound on the least total time under this cap (seconds)."""
    transient_bytes: int
    """The cap ``T``: every chosen option's transient memory is at most this."""
    budget_cells: int
    """Cells left for persistent memory: floor((limit - base - T) / granularity)."""


def default_granularity_bytes(
    limit_bytes: int | str, *, base_bytes: int | str = 0, target_cells: int = DEFAULT_TARGET_CELLS
) -> int:
    """Cell size that divides the memory left after ``base_bytes`` into about ``target_cells``."""
    room = parse_bytes(limit_bytes) - parse_bytes(base_bytes, what="base memory")
    return max(1, -(-room // target_cells)) if room > 0 else 1


def solve_min_time(
    time_s: Table,
    persistent_bytes: Table,
    transient_bytes: Table | None = None,
    *,
    limit_bytes: int | str,
    base_bytes: int | str = 0,
    granularity_bytes: int | None = None,
    names: Sequence[str] | None = None,
) -> SearchResult:
    """Choose one option per operator minimising total time with peak memory <= ``limit_bytes``.

    ``time_s[i][j]``, ``persistent_bytes[i][j]`` and ``transient_bytes[i][j]`` describe option
    ``j`` of operator ``i``; rows may have different lengths (ragged lists) but the three tables
    must agree. A time of ``+inf`` marks an invalid (or padding) option. Non-integer byte counts
    are rounded up to whole bytes. ``transient_bytes=None`` means no transient memory (the
    reference OSDP all-sum model). ``granularity_bytes`` defaults to
    :func:`default_granularity_bytes`. ``names`` name the operators in error messages.

    Raises :class:`PlanError` when no choice fits, :class:`InputError` for malformed tables.
    """
    limit = parse_bytes(limit_bytes)
    base = parse_bytes(base_bytes, what="base memory")
    tables = _as_tables(time_s, persistent_bytes, transient_bytes)
    n = tables.time_s.shape[0]
    if names is not None and len(names) != n:
        raise InputError(f"names has {len(names)} entries but there are {n} operators")
    gran = granularity_bytes
    if gran is None:
        gran = default_granularity_bytes(limit, base_bytes=base)
    if isinstance(gran, bool) or not isinstance(gran, (int, np.integer)) or gran < 1:
        raise InputError(f"granularity_bytes must be a positive int, got {granularity_bytes!r}")
    gran = int(gran)
    if n == 0:
        if base > limit:
            raise PlanError(_no_fit_message(tables, limit, base, gran, names))
        return SearchResult((), 0.0, base, 0, 0, limit, gran)
    width = _budget_cells(limit, base, 0, gran) + 1
    if width > MAX_CELLS:
        raise InputError(
            f"granularity_bytes={gran} divides the memory limit into {width} cells (at most "
            f"{MAX_CELLS} allowed): pass granularity_bytes >= {-(-(limit - base) // MAX_CELLS)} "
            "or leave it unset for the default"
        )
    cells = _persistent_cells(tables, gran)
    classes = _classes(tables, cells)
    rows = np.array([c.row for c in classes])
    caps = _bounded_caps(
        _Tables(tables.time_s[rows], tables.persistent_bytes[rows], tables.transient_bytes[rows],
                tables.valid[rows]), cells[rows], np.array([len(c.members) for c in classes]),
        limit=limit, base=base, granularity_bytes=gran)
    best: tuple[float, tuple[int, ...]] | None = None
    solved = 0
    for cap in caps:
        if best is not None and cap.bound > best[0] + 1e-9 * abs(best[0]):
            break  # caps are sorted by bound: none of the rest can beat the incumbent
        solved += 1
        allowed = _allowed_options(tables, cap.transient_bytes)
        frontiers = [_frontier(tables.time_s[c.row], cells[c.row], allowed[c.row], len(c.members),
                               cap.budget_cells) for c in classes]
        if any(f is None for f in frontiers):
            continue
        found = _knapsack_min_time(frontiers, cap.budget_cells)
        if found is None:
            continue
        value, picked = found
        choices = _assign(classes, frontiers, picked, n)
        if best is None or value < best[0] or (value == best[0] and _earlier(choices, best[1], classes)):
            best = (value, choices)
    logger.debug(
        "search: %d operators in %d classes, %d feasible transient caps, %d dynamic programmes, "
        "%d cells of %d bytes", n, len(classes), len(caps), solved, width, gran,
    )
    if best is None:
        raise PlanError(_no_fit_message(tables, limit, base, gran, names))
    return _result(tables, best[1], limit, base, gran)


def _as_tables(time_s: Table, persistent_bytes: Table, transient_bytes: Table | None) -> _Tables:
    """Pad ragged per-operator option lists into rectangular arrays and a validity mask."""
    time, lengths = _padded(time_s, np.inf, "time_s")
    persistent, lengths_p = _padded(persistent_bytes, 0.0, "persistent_bytes")
    if transient_bytes is None:
        transient, lengths_r = np.zeros_like(time), lengths
    else:
        transient, lengths_r = _padded(transient_bytes, 0.0, "transient_bytes")
    if not len(lengths) == len(lengths_p) == len(lengths_r):
        raise InputError(
            f"cost tables disagree on the number of operators: time_s {len(lengths)}, "
            f"persistent_bytes {len(lengths_p)}, transient_bytes {len(lengths_r)}"
        )
    for i in np.flatnonzero((lengths != lengths_p) | (lengths != lengths_r)):
        raise InputError(
            f"operator {i}: time_s has {lengths[i]} options, persistent_bytes {lengths_p[i]}, "
            f"transient_bytes {lengths_r[i]}; every table needs one entry per option"
        )
    for i in np.flatnonzero((np.isnan(time) | (time == -np.inf)).any(axis=1)):
        raise InputError(
            f"operator {i}: times must be numbers or +inf (invalid option), got {time[i].tolist()}"
        )
    valid = np.isfinite(time)
    for what, table in (("persistent_bytes", persistent), ("transient_bytes", transient)):
        bad = valid & ~(np.isfinite(table) & (table >= 0))
        for i in np.flatnonzero(bad.any(axis=1)):
            raise InputError(f"operator {i}: {what} must be finite and >= 0, got {table[i].tolist()}")
    for i in np.flatnonzero(~valid.any(axis=1)):
        raise InputError(f"operator {i} has no valid option (no options, or every time is +inf)")
    return _Tables(
        time,
        np.where(valid, np.ceil(persistent), 0).astype(np.int64),
        np.where(valid, np.ceil(transient), 0).astype(np.int64),
        valid,
    )


def _padded(table: Table, fill: float, what: str) -> tuple[np.ndarray, np.ndarray]:
    """``table`` as a float64 (n, k) array padded with ``fill``, and each operator's row length."""
    if isinstance(table, np.ndarray) and table.ndim == 2:
        return table.astype(np.float64), np.full(table.shape[0], table.shape[1])
    try:
        rows = [np.asarray(row, dtype=np.float64).reshape(-1) for row in table]
    except (TypeError, ValueError) as exc:
        raise InputError(
            f"{what} must be a sequence of per-operator sequences of numbers: {exc}"
        ) from exc
    lengths = np.array([len(row) for row in rows], dtype=np.int64)
    array = np.full((len(rows), int(lengths.max(initial=0))), fill)
    for i, row in enumerate(rows):
        array[i, : len(row)] = row
    return array, lengths


def _persistent_cells(tables: _Tables, granularity_bytes: int) -> np.ndarray:
    """Persistent bytes of every option rounded UP to whole cells, so a plan never exceeds the limit."""
    return -(-tables.persistent_bytes // granularity_bytes)


def _budget_cells(
    limit_bytes: int, base_bytes: int, transient_bytes: int, granularity_bytes: int
) -> int:
    """Whole cells left for persistent memory under transient cap ``T``: floor((L - B - T) / g)."""
    return (limit_bytes - base_bytes - transient_bytes) // granularity_bytes


def _transient_candidates(tables: _Tables) -> list[int]:
    """Sorted distinct transient values that can be the plan's largest one.

    Values below ``max_i min_j r[i, j]`` are skipped: under them some operator has no option.
    """
    least_per_op = np.where(tables.valid, tables.transient_bytes, np.iinfo(np.int64).max).min(axis=1)
    floor = int(least_per_op.max(initial=0))
    values = np.unique(tables.transient_bytes[tables.valid])
    return [int(v) for v in values if v >= floor]


def _allowed_options(tables: _Tables, transient_cap: int) -> np.ndarray:
    """Options that are valid and whose transient memory is at most ``transient_cap``."""
    return tables.valid & (tables.transient_bytes <= transient_cap)


def _bounded_caps(
    tables: _Tables, cells: np.ndarray, counts: np.ndarray, *, limit: int, base: int,
    granularity_bytes: int
) -> list[_Cap]:
    """Transient caps that can hold a plan, each with a lower bound on its optimum, best first.

    The bound is the Lagrangian relaxation of the memory constraint,
    ``max_l sum_i min_{j: r[i,j] <= T} (t[i,j] + l c[i,j]) - l budget(T)`` over the prices
    ``l >= 0`` of :func:`_prices` (weak duality: a valid bound for every price; ``l = 0`` is the
    memory-blind bound). Caps are swept in increasing ``T``, adding each option to its operator's
    running minimum once, so bounding all caps costs about one pass over the options per price.
    A cap is dropped when even each operator's smallest allowed option overflows its budget. The
    bound is lowered by a floating-point rounding allowance so that it never over-prunes.
    ``tables`` and ``cells`` hold one row per class of equal operators and ``counts`` its
    members: each row's terms count that many times.
    """
    candidates = _transient_candidates(tables)
    prices = _prices(tables.time_s, cells, tables.valid)
    priced = tables.time_s[None] + prices[:, None, None] * cells[None]
    first = _allowed_options(tables, candidates[0])
    least_priced = np.where(first[None], priced, np.inf).min(axis=2)
    least_cells = np.where(first, cells, np.iinfo(np.int64).max).min(axis=1)
    ops, opts = np.nonzero(tables.valid & ~first)
    order = np.argsort(tables.transient_bytes[ops, opts], kind="stable")
    ops, opts = ops[order], opts[order]
    added = 0
    caps = []
    for transient in candidates:
        while added < len(ops) and tables.transient_bytes[ops[added], opts[added]] <= transient:
            i, j = ops[added], opts[added]
            np.minimum(least_priced[:, i], priced[:, i, j], out=least_priced[:, i])
            least_cells[i] = min(least_cells[i], cells[i, j])
            added += 1
        budget = _budget_cells(limit, base, transient, granularity_bytes)
        if budget < 0:
            break  # larger transients only leave less room
        if int(least_cells @ counts) > budget:
            continue
        priced_total = least_priced @ counts
        rounding = 1e-12 * (np.abs(least_priced) @ counts + prices * budget)
        bound = float((priced_total - prices * budget - rounding).max())
        caps.append(_Cap(bound, transient, budget))
    caps.sort(key=lambda cap: (cap.bound, cap.transient_bytes))
    return caps


def _prices(time_s: np.ndarray, cells: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Prices (seconds per cell) at which :func:`_bounded_caps` evaluates its bound.

    Zero, and a geometric grid spanning every time-per-cell trade-off between two options of one
    operator. Any price >= 0 gives a valid bound; the grid only decides how tight it is.
    """
    finite = np.where(valid, time_s, 0.0)
    d_time = finite[:, :, None] - finite[:, None, :]
    d_cells = (cells[:, None, :] - cells[:, :, None]).astype(np.float64)
    pair = valid[:, :, None] & valid[:, None, :] & (d_cells > 0) & (d_time > 0)
    slopes = d_time[pair] / d_cells[pair]
    slopes = slopes[slopes > 0]  # a tiny time difference can underflow to 0
    if slopes.size == 0:
        return np.zeros(1)
    return np.concatenate([[0.0], np.geomspace(slopes.min(), slopes.max(), _BOUND_PRICES)])


def _classes(tables: _Tables, cells: np.ndarray) -> list[_Class]:
    """Operators with equal rows (time, persistent cells, transient bytes, validity) grouped
    into classes, in the order of each class's first operator."""
    rows = np.concatenate([tables.time_s, cells, tables.transient_bytes, tables.valid], axis=1)
    _, first, which = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    which = which.reshape(-1)
    order = np.argsort(first, kind="stable")
    return [_Class(int(first[c]), np.flatnonzero(which == c)) for c in order]


def _frontier(time_s: np.ndarray, cells: np.ndarray, allowed: np.ndarray, count: int,
              budget_cells: int) -> _Frontier | None:
    """The choices ``count`` operators with the option row (``time_s``, ``cells``, ``allowed``)
    can make within ``budget_cells``, pruned to those that can be optimal (:func:`_pruned`);
    None when no allowed option fits.

    The ``count``-fold sum is built by doubling: the choices of ``a + b`` operators are every
    choice of ``a`` plus every choice of ``b`` (a multiset of options splits into any two parts
    of sizes ``a`` and ``b``), so pruning after each sum loses nothing."""
    options = np.flatnonzero(allowed & (cells <= budget_cells))
    if options.size == 0:
        return None
    unit = np.zeros((options.size, len(time_s)), dtype=np.int64)
    unit[np.arange(options.size), options] = 1
    if count == 1:  # already in tie-breaking order; pruning would only shorten the loop
        return _Frontier(cells[options], time_s[options], unit)
    power = _pruned(cells[options], time_s[options], unit)
    result = None
    while True:
        if count & 1:
            result = power if result is None else _sum(result, power, budget_cells)
        count >>= 1
        if not count:
            return result
        power = _sum(power, power, budget_cells)


def _sum(a: _Frontier, b: _Frontier, budget_cells: int) -> _Frontier:
    """Every choice of ``a`` with every choice of ``b`` that fits ``budget_cells``, pruned."""
    cells = (a.cells[:, None] + b.cells[None, :]).reshape(-1)
    time = (a.time_s[:, None] + b.time_s[None, :]).reshape(-1)
    counts = (a.counts[:, None, :] + b.counts[None, :, :]).reshape(cells.size, -1)
    fits = cells <= budget_cells
    return _pruned(cells[fits], time[fits], counts[fits])


def _pruned(cells: np.ndarray, time_s: np.ndarray, counts: np.ndarray) -> _Frontier:
    """The choices no other choice beats, in tie-breaking order.

    A choice is dropped when another takes no more cells and less time, or no more cells, the
    same time and comes no later in tie-breaking order: since the least time of the other
    classes can only fall as cells are freed, the other is then at least as good in every
    state of the dynamic programme, and wins its ties. Tie-breaking order: a tie goes to the
    lower option index, so among equal choices the one with the most members at option 0,
    then at option 1, ... comes first."""
    rank = np.empty(len(cells), dtype=np.int64)
    rank[np.lexsort((-counts).T[::-1])] = np.arange(len(cells))
    order = np.lexsort((rank, time_s, cells))
    cells, time_s, counts, rank = cells[order], time_s[order], counts[order], rank[order]
    before = np.concatenate([[np.inf], np.minimum.accumulate(time_s)[:-1]])
    lower = time_s < before
    # Within a run of the least time so far (it starts where that time fell), the earliest
    # rank among the choices of that time seen before: a choice of the same time is kept
    # only if it comes earlier in tie-breaking order.
    run = np.cumsum(lower)
    at_least = np.where(time_s == np.minimum.accumulate(time_s), rank, len(rank))
    key = (run[-1] - run) * (len(rank) + 1) + at_least
    earliest = np.concatenate([[np.iinfo(np.int64).max], np.minimum.accumulate(key)[:-1]])
    same_run = earliest // (len(rank) + 1) == run[-1] - run
    keep = lower | ((time_s == before) & same_run & (rank < earliest % (len(rank) + 1)))
    keep = np.flatnonzero(keep)
    keep = keep[np.argsort(rank[keep], kind="stable")]
    return _Frontier(cells[keep], time_s[keep], counts[keep])


def _knapsack_min_time(
    frontiers: Sequence[_Frontier], budget_cells: int
) -> tuple[float, list[int]] | None:
    """Multiple-choice knapsack over classes: least total time using at most ``budget_cells``.

    ``best[v]`` is the least time of classes ``c .. C-1`` given ``v`` free cells; each class
    chooses one point of its frontier (how many of its members take each option). Classes are
    added last to first so that backtracking runs first to last and, with strict ``<`` over
    points in tie-breaking order, yields the first optimal plan in that order. Returns the
    optimum and the point chosen for each class, or None when nothing fits.

    Only the window of ``v`` that matters is computed: below the least cells classes
    ``c .. C-1`` need, ``best`` is ``+inf``; below ``budget - (most cells classes 0 .. c-1 can
    take)`` it is never read. ``choice`` is meaningful inside that window only.
    """
    width = budget_cells + 1
    least = np.array([f.cells.min() for f in frontiers], dtype=np.int64)
    least_after = np.cumsum(least[::-1])[::-1]
    most_before = np.concatenate([[0], np.cumsum([f.cells.max() for f in frontiers])[:-1]])
    if least_after[0] > budget_cells:
        return None
    choice = np.zeros((len(frontiers), width), dtype=np.int32)
    best = np.zeros(width)
    new = np.empty(width)
    cand = np.empty(width)
    better = np.empty(width, dtype=bool)
    for c in range(len(frontiers) - 1, -1, -1):
        low = max(int(least_after[c]), budget_cells - int(most_before[c]), 0)
        row = choice[c]
        new[:low] = np.inf
        front = frontiers[c]
        for p in range(len(front.cells)):
            w = int(front.cells[p])
            start = max(low, w)
            source = best[start - w : width - w]
            if p == 0:  # write straight into the window instead of comparing against +inf
                new[low:start] = np.inf
                np.add(source, front.time_s[p], out=new[start:])
                row[start:] = p
                continue
            np.add(source, front.time_s[p], out=cand[start:])
            np.less(cand[start:], new[start:], out=better[start:])
            np.copyto(new[start:], cand[start:], where=better[start:])
            np.copyto(row[start:], p, where=better[start:])
        if not np.isfinite(new[budget_cells]):
            return None
        best, new = new, best
    picked, free = [], budget_cells
    for c, front in enumerate(frontiers):
        p = int(choice[c, free])
        picked.append(p)
        free -= int(front.cells[p])
        assert free >= 0, f"backtracking overdrew the budget at class {c} (point {p})"
    return float(best[budget_cells]), picked


def _assign(classes: Sequence[_Class], frontiers: Sequence[_Frontier], picked: Sequence[int],
            n: int) -> tuple[int, ...]:
    """Each operator's option: the members of a class take its chosen counts in decreasing
    option index, first member first ([Note: members of a class])."""
    choices = np.zeros(n, dtype=np.int64)
    for cls, front, p in zip(classes, frontiers, picked):
        counts = front.counts[p]
        choices[cls.members] = np.repeat(np.arange(len(counts)), counts)[::-1]
    return tuple(int(j) for j in choices)


def _earlier(a: tuple[int, ...], b: tuple[int, ...], classes: Sequence[_Class]) -> bool:
    """Whether plan ``a`` comes before ``b`` in tie-breaking order: the sorted options of the
    first class's members, then the next class's, compared as sequences."""
    def key(plan: tuple[int, ...]) -> list[list[int]]:
        return [sorted(plan[i] for i in c.members) for c in classes]

    return key(a) < key(b)


def _result(tables: _Tables, choices: tuple[int, ...], limit: int, base: int, gran: int) -> SearchResult:
    """Exact costs of a choice."""
    ops = np.arange(len(choices))
    picked = np.asarray(choices, dtype=np.int64)
    persistent = int(tables.persistent_bytes[ops, picked].sum())
    transient = int(tables.transient_bytes[ops, picked].max(initial=0))
    total = math.fsum(float(x) for x in tables.time_s[ops, picked])
    peak = base + persistent + transient
    assert peak <= limit, f"search returned a plan of {peak} bytes over the {limit}-byte limit"
    return SearchResult(choices, total, peak, persistent, transient, limit, gran)


def _least_peak_bytes(tables: _Tables, base: int) -> tuple[int, int, np.ndarray]:
    """Exact least peak any choice needs: ``min_T B + T + sum_i min_{r[i,j] <= T} p[i, j]``.

    Returns the peak, the transient cap attaining it and each operator's least persistent bytes
    under that cap.
    """
    big = np.iinfo(np.int64).max
    result: tuple[int, int, np.ndarray] | None = None
    for transient in _transient_candidates(tables):
        least = np.where(_allowed_options(tables, transient), tables.persistent_bytes, big).min(axis=1)
        peak = base + transient + int(least.sum())
        if result is None or peak < result[0]:
            result = (peak, transient, least)
    if result is None:  # no operators
        return base, 0, np.zeros(0, dtype=np.int64)
    return result


def _no_fit_message(
    tables: _Tables, limit: int, base: int, gran: int, names: Sequence[str] | None
) -> str:
    """PlanError text: the least memory any choice needs, what dominates it, what to do."""
    peak, transient, least = _least_peak_bytes(tables, base)
    persistent = int(least.sum())
    order = sorted(range(len(least)), key=lambda i: (-int(least[i]), i))[:_DOMINANT_SHOWN]
    labels = list(names) if names is not None else [f"operator {i}" for i in range(len(least))]
    dominant = ", ".join(f"{labels[i]} ({format_bytes(int(least[i]))})" for i in order)
    need = (
        f"the least peak memory any choice of options needs is {format_bytes(peak)} ({peak} bytes): "
        f"base {format_bytes(base)} + persistent {format_bytes(persistent)} + largest transient "
        f"{format_bytes(transient)}"
    )
    if peak <= limit:
        return (
            f"no plan fits the memory limit of {format_bytes(limit)} ({limit} bytes) after rounding: "
            f"{need}, which fits, but the search rounds each operator's persistent memory up to "
            f"cells of {gran} bytes (up to {len(least)} x {gran} bytes in all). Pass a smaller "
            "granularity_bytes, or raise the memory limit."
        )
    dominated = ""
    if len(least):
        dominated = f"; the operators holding most of it, even at their smallest option: {dominant}"
    return (
        f"no plan fits the memory limit of {format_bytes(limit)} ({limit} bytes): {need}{dominated}. "
        f"To fix: raise the memory limit to at least {format_bytes(peak)}, shard more (more ranks, "
        "or offer sharded options for those operators), or use a smaller batch size."
    )

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
- *objective*: :func:`_knapsack_min_time`, a dynamic programme over operators whose state is the
  number of cells still free, vectorised with numpy over that memory axis (one Python iteration
  per operator and option, none per cell). It keeps the arg-min option of every (operator, free
  cells) state, and :func:`_backtrack` reads the plan back;
- *nothing fits*: :func:`_least_peak_bytes` computes exactly (in bytes, without rounding) the least
  peak memory any choice needs, which the :class:`~osdp_fx.errors.PlanError` reports together
  with the operators that dominate it.

Ties are broken deterministically toward the lowest option index, operator 0 first: among the
optimal plans (equal floating-point totals) the lexicographically smallest ``choices`` is
returned. The same problem with no transient memory (``transient_bytes=None``), integer memory
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
    caps = _bounded_caps(tables, cells, limit=limit, base=base, granularity_bytes=gran)
    best: tuple[float, tuple[int, ...]] | None = None
    solved = 0
    for cap in caps:
        if best is not None and cap.bound > best[0] + 1e-9 * abs(best[0]):
            break  # caps are sorted by bound: none of the rest can beat the incumbent
        solved += 1
        allowed = _allowed_options(tables, cap.transient_bytes)
        found = _knapsack_min_time(tables.time_s, cells, allowed, cap.budget_cells)
        if found is None:
            continue
        value, choice_table = found
        choices = _backtrack(choice_table, cells, cap.budget_cells)
        if best is None or value < best[0] or (value == best[0] and choices < best[1]):
            best = (value, choices)
    logger.debug(
        "search: %d operators, %d feasible transient caps, %d dynamic programmes, %d cells of %d bytes",
        n, len(caps), solved, width, gran,
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
    tables: _Tables, cells: np.ndarray, *, limit: int, base: int, granularity_bytes: int
) -> list[_Cap]:
    """Transient caps that can hold a plan, each with a lower bound on its optimum, best first.

    The bound is the Lagrangian relaxation of the memory constraint,
    ``max_l sum_i min_{j: r[i,j] <= T} (t[i,j] + l c[i,j]) - l budget(T)`` over the prices
    ``l >= 0`` of :func:`_prices` (weak duality: a valid bound for every price; ``l = 0`` is the
    memory-blind bound). Caps are swept in increasing ``T``, adding each option to its operator's
    running minimum once, so bounding all caps costs about one pass over the options per price.
    A cap is dropped when even each operator's smallest allowed option overflows its budget. The
    bound is lowered by a floating-point rounding allowance so that it never over-prunes.
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
        if int(least_cells.sum()) > budget:
            continue
        priced_total = least_priced.sum(axis=1)
        rounding = 1e-12 * (np.abs(least_priced).sum(axis=1) + prices * budget)
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


def _knapsack_min_time(
    time_s: np.ndarray, cells: np.ndarray, allowed: np.ndarray, budget_cells: int
) -> tuple[float, np.ndarray] | None:
    """Multiple-choice knapsack: least total time using at most ``budget_cells`` cells.

    ``best[v]`` is the least time of operators ``i .. n-1`` given ``v`` free cells; operators are
    added last to first so that backtracking runs first to last and, with strict ``<`` over
    options in increasing index, yields the lexicographically smallest optimal plan. Returns the
    optimum and ``choice[i, v]`` (the arg-min option of operator ``i`` with ``v`` free cells), or
    None when nothing fits.

    Only the window of ``v`` that matters is computed: below the least cells operators
    ``i .. n-1`` need, ``best`` is ``+inf``; below ``budget - (most cells operators 0 .. i-1 can
    take)`` it is never read. ``choice`` is meaningful inside that window only.
    """
    n, k = time_s.shape
    width = budget_cells + 1
    usable = allowed & (cells <= budget_cells)
    if not usable.any(axis=1).all():
        return None
    least_after = np.cumsum(np.where(usable, cells, budget_cells + 1).min(axis=1)[::-1])[::-1]
    most_before = np.concatenate([[0], np.cumsum(np.where(usable, cells, 0).max(axis=1))[:-1]])
    if least_after[0] > budget_cells:
        return None
    choice = np.zeros((n, width), dtype=np.int8 if k <= 127 else np.int32)
    best = np.zeros(width)
    new = np.empty(width)
    cand = np.empty(width)
    better = np.empty(width, dtype=bool)
    for i in range(n - 1, -1, -1):
        low = max(int(least_after[i]), budget_cells - int(most_before[i]), 0)
        row = choice[i]
        new[:low] = np.inf
        first = True
        for j in np.flatnonzero(usable[i]):
            w = int(cells[i, j])
            start = max(low, w)
            source = best[start - w : width - w]
            if first:  # write straight into the window instead of comparing against +inf
                new[low:start] = np.inf
                np.add(source, time_s[i, j], out=new[start:])
                row[start:] = j
                first = False
                continue
            np.add(source, time_s[i, j], out=cand[start:])
            np.less(cand[start:], new[start:], out=better[start:])
            np.copyto(new[start:], cand[start:], where=better[start:])
            np.copyto(row[start:], j, where=better[start:])
        if not np.isfinite(new[budget_cells]):
            return None
        best, new = new, best
    return float(best[budget_cells]), choice


def _backtrack(choice: np.ndarray, cells: np.ndarray, budget_cells: int) -> tuple[int, ...]:
    """Read the chosen options back from the arg-min table, operator 0 first."""
    free = budget_cells
    picked = []
    for i in range(choice.shape[0]):
        j = int(choice[i, free])
        picked.append(j)
        free -= int(cells[i, j])
        assert free >= 0, f"backtracking overdrew the budget at operator {i} (option {j})"
    return tuple(picked)


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

"""Tests of the exact search (osdp_fx.planner.solver) against brute force and the OSDP seed tables."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from osdp_fx.errors import InputError, PlanError
from osdp_fx.planner.solver import (
    SearchResult,
    default_granularity_bytes,
    solve_min_time,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark():
    """benchmarks/search_seed_table.py as a module (benchmarks/ is not a package)."""
    path = REPO_ROOT / "benchmarks" / "search_seed_table.py"
    spec = importlib.util.spec_from_file_location("search_seed_table", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


seed = _load_benchmark()


# ---------------------------------------------------------------- brute force


def _padded(rows, fill):
    width = max(len(row) for row in rows)
    return np.array([list(row) + [fill] * (width - len(row)) for row in rows], dtype=np.float64)


def brute_force(time_s, persistent, transient, *, limit, base, gran):
    """Every choice via itertools.product, with the solver's discretisation.

    Returns (least time, first choice reaching it in tie-breaking order, exact least peak of
    any choice); the first two are None when nothing fits. Tie-breaking order: operators with
    equal rows (times, persistent cells, transient bytes) form a class; the sorted options of
    each class's members are compared class by class (classes in the order of their first
    operator), and the members then take them in decreasing index, first member first.
    """
    combos = np.array(list(itertools.product(*(range(len(row)) for row in time_s))), dtype=np.int64)
    ops = np.arange(len(time_s))
    t = _padded(time_s, np.inf)[ops, combos]
    p = _padded(persistent, 0).astype(np.int64)[ops, combos]
    r = _padded(transient, 0).astype(np.int64)[ops, combos]
    valid = np.isfinite(t).all(axis=1)
    total = t.sum(axis=1)
    top = r.max(axis=1)
    fits = valid & (base + top + gran * (-(-p // gran)).sum(axis=1) <= limit)
    least_peak = int((base + p.sum(axis=1) + top)[valid].min())
    if not fits.any():
        return None, None, least_peak
    best = total[fits].min()
    optimal = combos[fits & (total == best)]
    classes = _classes(time_s, persistent, transient, gran)
    first = min(optimal, key=lambda plan: [sorted(plan[members]) for members in classes])
    chosen = np.empty(len(time_s), dtype=np.int64)
    for members in classes:
        chosen[members] = sorted(first[members], reverse=True)
    return float(best), tuple(int(j) for j in chosen), least_peak


def _classes(time_s, persistent, transient, gran):
    """Operator indices with equal rows (persistent bytes in cells, invalid options zeroed),
    in the order of each class's first operator."""
    t = _padded(time_s, np.inf)
    valid = np.isfinite(t)
    cells = np.where(valid, -(-_padded(persistent, 0).astype(np.int64) // gran), 0)
    held = np.where(valid, _padded(transient, 0), 0)
    classes = {}
    for i in range(len(time_s)):
        classes.setdefault((tuple(t[i]), tuple(cells[i]), tuple(held[i])), []).append(i)
    return [np.array(members) for members in classes.values()]


@st.composite
def instances(draw):
    n = draw(st.integers(1, 8))
    integral = draw(st.booleans())  # integer times make exact ties, to check tie-breaking
    value = st.integers(0, 20).map(float) if integral else st.floats(0.0, 10.0, allow_nan=False)
    time_s, persistent, transient = [], [], []
    for _ in range(n):
        k = draw(st.integers(2, 5))
        row = [draw(value) if draw(st.integers(0, 9)) else math.inf for _ in range(k)]
        if all(math.isinf(x) for x in row):
            row[draw(st.integers(0, k - 1))] = draw(value)
        time_s.append(row)
        persistent.append(draw(st.lists(st.integers(0, 1000), min_size=k, max_size=k)))
        transient.append(draw(st.lists(st.integers(0, 400), min_size=k, max_size=k)))
    if draw(st.booleans()):
        transient = None
    base = draw(st.integers(0, 300))
    most = base + sum(max(row) for row in persistent) + 400
    limit = draw(st.integers(0, most))
    gran = draw(st.sampled_from([1, 3, 16, 100, None]))
    return time_s, persistent, transient, limit, base, gran, integral


@st.composite
def repeated_instances(draw):
    """Instances whose operators repeat a few distinct rows (the layers of a model), with
    integer times half of the time so that exact ties between classes occur."""
    time_s, persistent, transient, _, base, gran, integral = draw(instances())
    kinds = draw(st.integers(1, min(3, len(time_s))))
    order = draw(st.lists(st.integers(0, kinds - 1), min_size=kinds, max_size=7))
    most = base + sum(max(persistent[i]) for i in order) + 400
    return ([time_s[i] for i in order], [persistent[i] for i in order],
            None if transient is None else [transient[i] for i in order],
            draw(st.integers(0, most)), base, gran, integral)


def _feasible_cells(result: SearchResult, persistent, transient, base: int) -> bool:
    """The plan fits the limit with persistent memory rounded up to the result's cells."""
    g = result.granularity_bytes
    cells = sum(-(-persistent[i][j] // g) for i, j in enumerate(result.choices))
    top = max((transient[i][j] for i, j in enumerate(result.choices)), default=0) if transient else 0
    return base + top + g * cells <= result.limit_bytes


# ---------------------------------------------------------------- (a) exactness


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(instances())
@example(([[5e-324, math.inf, math.inf, math.inf, 0.0]], [[0, 0, 0, 0, 2]], [[0, 0, 0, 0, 0]],
          0, 0, 1, False))  # a time difference that underflows to 0 (found by CI)
def test_matches_brute_force(case):
    _check_against_brute_force(case)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(repeated_instances())
def test_repeated_operators_are_searched_as_classes_with_the_same_answer(case):
    """Equal rows are searched as one class with a multiplicity: the same least time, and the
    same plan in tie-breaking order, as choosing every operator's option separately."""
    _check_against_brute_force(case)


def _check_against_brute_force(case):
    time_s, persistent, transient, limit, base, gran, integral = case
    effective = default_granularity_bytes(limit, base_bytes=base) if gran is None else gran
    zeros = [[0] * len(row) for row in time_s]
    want, want_choices, least_peak = brute_force(
        time_s, persistent, transient or zeros, limit=limit, base=base, gran=effective
    )
    kwargs = dict(limit_bytes=limit, base_bytes=base, granularity_bytes=gran)
    if want is None:
        with pytest.raises(PlanError) as err:
            solve_min_time(time_s, persistent, transient, **kwargs)
        assert f"({least_peak} bytes)" in str(err.value)
        return
    got = solve_min_time(time_s, persistent, transient, **kwargs)
    assert got.granularity_bytes == effective
    assert math.isclose(got.total_time_s, want, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(got.total_time_s, math.fsum(time_s[i][j] for i, j in enumerate(got.choices)))
    assert _feasible_cells(got, persistent, transient, base)
    assert got.peak_bytes <= limit
    assert got.peak_bytes == base + got.persistent_bytes + got.transient_bytes
    if integral:  # exact sums: the lexicographically smallest optimal plan
        assert got.choices == want_choices


# ---------------------------------------------------------------- (b) the OSDP seed table


@pytest.fixture(scope="module")
def profile():
    if seed.find_profile() is None:
        pytest.skip("osdp-seed-profile.json not found (set OSDP_SEED_PROFILE)")
    return seed.load_profile()


def test_seed_table_reproduces_published_result(profile):
    published = profile["reference_result"]
    result = seed.solve_seed_case(seed.seed_case(profile, hidden=1536, batch_index=1, num_layers=48))
    assert round(result.total_time_s, 6) == 2.901937
    assert math.isclose(result.total_time_s, published["min_total_time_s"], rel_tol=1e-12)
    counts = Counter(str(j) for j in result.choices)
    assert counts == Counter(published["plan_strategy_counts"])
    assert result.peak_bytes <= result.limit_bytes


def test_seed_table_pure_python_loop_agrees(profile):
    case = seed.seed_case(profile)
    cells = [[b // case.granularity_bytes for b in row] for row in case.persistent_bytes]
    budget = (case.limit_bytes - case.base_bytes) // case.granularity_bytes
    total, plan = seed.pure_python_min_time(case.time_s, cells, budget)
    assert math.isclose(total, seed.solve_seed_case(case).total_time_s, rel_tol=1e-12)
    assert sum(row[j] for row, j in zip(cells, plan)) <= budget


@pytest.mark.parametrize("hidden, batch_index", [(1536, 2), (1536, 3), (2048, 1), (2048, 2), (2048, 3)])
def test_seed_table_published_infeasible_cases(profile, hidden, batch_index):
    with pytest.raises(PlanError, match="no plan fits"):
        seed.solve_seed_case(seed.seed_case(profile, hidden=hidden, batch_index=batch_index))


# ---------------------------------------------------------------- (c) error messages


def test_plan_error_states_least_memory_dominant_operators_and_fix():
    time_s = [[1.0, 2.0], [1.0, 3.0], [1.0, 1.5]]
    persistent = [[900, 500], [400, 300], [50, 10]]
    transient = [[0, 200], [0, 100], [0, 5]]
    names = ["embed", "mlp", "norm"]
    _, _, least = brute_force(time_s, persistent, transient, limit=10**9, base=100, gran=1)
    with pytest.raises(PlanError) as err:
        solve_min_time(time_s, persistent, transient, limit_bytes=least - 1, base_bytes=100, names=names)
    message = str(err.value)
    assert f"({least} bytes)" in message
    assert message.index("embed") < message.index("mlp") < message.index("norm")
    for advice in ("raise the memory limit", "shard more", "smaller batch"):
        assert advice in message
    assert solve_min_time(
        time_s, persistent, transient, limit_bytes=least, base_bytes=100, granularity_bytes=1
    ).peak_bytes == least


def test_plan_error_blames_rounding_when_exact_plan_would_fit():
    with pytest.raises(PlanError, match="granularity_bytes") as err:
        solve_min_time([[1.0], [1.0]], [[10], [10]], limit_bytes=20, granularity_bytes=16)
    assert "(20 bytes)" in str(err.value)


def test_input_errors():
    with pytest.raises(InputError, match="operator 1"):
        solve_min_time([[1.0, 2.0], [1.0]], [[1, 2], [1, 2]], limit_bytes=10)
    with pytest.raises(InputError, match="no valid option"):
        solve_min_time([[math.inf, math.inf]], [[1, 2]], limit_bytes=10)
    with pytest.raises(InputError, match=">= 0"):
        solve_min_time([[1.0]], [[-1]], limit_bytes=10)
    with pytest.raises(InputError, match="granularity_bytes"):
        solve_min_time([[1.0]], [[1]], limit_bytes=1 << 40, granularity_bytes=1)


# ---------------------------------------------------------------- (d) determinism


def test_deterministic_and_input_form_independent():
    rng = np.random.default_rng(0)
    time_s = rng.integers(1, 4, size=(40, 4)).astype(float)  # many exact ties
    persistent = rng.integers(0, 1 << 20, size=(40, 4))
    transient = rng.integers(0, 1 << 18, size=(40, 4))
    limit = int(persistent.mean(axis=1).sum())
    runs = [solve_min_time(time_s, persistent, transient, limit_bytes=limit) for _ in range(3)]
    as_lists = (time_s.tolist(), persistent.tolist(), transient.tolist())
    runs.append(solve_min_time(*as_lists, limit_bytes=limit))
    assert all(run == runs[0] for run in runs)


def test_ties_go_to_lowest_option_index():
    same = solve_min_time([[1.0, 1.0, 1.0]] * 4, [[5, 5, 5]] * 4, limit_bytes=100, granularity_bytes=1)
    assert same.choices == (0, 0, 0, 0)
    # one of three equal operators can take the memory-hungry option 0; the last one gets it
    # (the members of a class take their options in decreasing index, first member first)
    tied = solve_min_time([[1.0, 1.0]] * 3, [[10, 0]] * 3, limit_bytes=10, granularity_bytes=1)
    assert tied.choices == (1, 1, 0)
    # operators that differ are compared in order: operator 0 gets the lower index first
    apart = solve_min_time([[1.0, 1.0], [1.0, 1.0]], [[10, 0], [10, 1]], limit_bytes=11,
                           granularity_bytes=1)
    assert apart.choices == (0, 1)

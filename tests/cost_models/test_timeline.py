"""Unit tests of the timeline memory model's pieces that need no profiled graph."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from osdp_fx.cost_models.timeline import BATCH, Category, _envelope, _Timeline


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 200)), min_size=1, max_size=15),
    st.integers(1, 8),
)
def test_envelope_equals_the_max_over_all_time_points(lines, profiled_batch):
    expr = _envelope(list(lines), profiled_batch)
    for b in (1, 2, 3, 7, 16, 100, 10_000):
        expected = max(Fraction(s * b, profiled_batch) + f for s, f in lines)
        assert Fraction(str(expr.subs(BATCH, b))) == expected


def test_sweep_reads_the_peak_after_allocations_and_before_frees():
    tl = _Timeline()
    tl.alive(0, 2, 100, Category.ACTIVATIONS, scaled=True)  # an activation from t=0 to t=2
    tl.alive(1, 1, 50, Category.TEMPORARIES, scaled=False)  # a transient at t=1
    tl.alive(2, 3, 30, Category.GRADIENTS, scaled=False)  # allocated while the activation lives
    points = {t: (sum(s for s, _ in by.values()), sum(f for _, f in by.values()))
              for t, by in tl.sweep({Category.PARAMETERS: 7})}
    assert points == {0: (100, 7), 1: (100, 57), 2: (100, 37), 3: (0, 37)}
    by_category = dict(tl.sweep({Category.PARAMETERS: 7}))[2]
    assert by_category[Category.GRADIENTS] == (0, 30)
    assert by_category[Category.ACTIVATIONS] == (100, 0)
    assert by_category[Category.PARAMETERS] == (0, 7)

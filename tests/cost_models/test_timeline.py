"""Unit tests of the timeline memory model's pieces that need no profiled graph."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from osdp_fx.cost_models.timeline import BATCH, _envelope, _Timeline


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 200)), min_size=1, max_size=15),
    st.integers(1, 8),
)
def test_envelope_equals_the_max_over_all_time_points(lines, profiled_batch):
    expr = _envelope([(0, s, f) for s, f in lines], profiled_batch)
    for b in (1, 2, 3, 7, 16, 100, 10_000):
        expected = max(Fraction(s * b, profiled_batch) + f for s, f in lines)
        assert Fraction(str(expr.subs(BATCH, b))) == expected


def test_sweep_reads_the_peak_after_allocations_and_before_frees():
    tl = _Timeline()
    tl.alive(0, 2, 100, scaled=True)     # an activation from t=0 to t=2
    tl.alive(1, 1, 50, scaled=False)     # a transient at t=1
    tl.alive(2, 3, 30, scaled=False)     # allocated at t=2 while the activation is still alive
    points = {t: (s, f) for t, s, f in tl.sweep(base=7)}
    assert points == {0: (100, 7), 1: (100, 57), 2: (100, 37), 3: (0, 37)}

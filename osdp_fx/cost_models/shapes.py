"""Peak memory as a function of the per-rank batch size and the sequence length.

Per node, the elements of its output, of its inputs that are not parameters, and of both are
known at three sequence lengths ``s0 > s1 > s2`` (``passes/sequence.py``; ``s0`` the profiled
one). Through each runs one quadratic in ``s`` (projections are linear in ``s``, attention
scores and masks quadratic), so a node's bytes at ``s`` are its profiled bytes times
``q(s) / q(s0)`` (:func:`node_factors`): its output and the outputs it saves by the output's
quadratic, the inputs it saves as those inputs' outputs, what else it saves and its forward and
backward temporaries each by its own quadratic, measured at the three lengths too (an eager
attention saves (b, h, s, s) probabilities, which outgrow its (b, 1, s, s) mask: scaled as its
inputs and output together they fell short above ``s0`` and were too large below). The
timeline (``timeline.py``) is linear in every amount it is given, so each of its time points
holds ``b / b0 * Q_t(s) + F_t`` bytes with ``Q_t`` a quadratic too:
predicting the step at ``s0``, ``s1`` and ``s2`` gives ``Q_t`` at three points, hence
everywhere (:func:`peak_lines`). The peak at any (b, s) is the largest point
(``Prediction.peak_bytes_at``); :func:`peak_expr` writes it as a sympy ``Max`` in ``b`` and ``s``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import sympy

from .envelope import BATCH

SEQ = sympy.Symbol("s", positive=True, integer=True)
"""The sequence length in ``Prediction.peak_memory_expr``."""

Line = tuple[Fraction, Fraction, Fraction, int]
"""A time point's live bytes at batch b0: ``c0 + c1 s + c2 s^2`` scaled, plus fixed bytes."""


@functools.lru_cache(maxsize=16)
def _lagrange_weights(points: tuple[int, ...]) -> tuple[tuple[Fraction, ...], ...]:
    """w[k][i]: the quadratic through (points[i], y[i]) has c_k = sum_i y[i] w[k][i]."""
    weights: list[list[Fraction]] = [[], [], []]
    for i, xi in enumerate(points):
        a, b = (x for j, x in enumerate(points) if j != i)
        denom = Fraction((xi - a) * (xi - b))
        weights[0].append(a * b / denom)
        weights[1].append(-(a + b) / denom)
        weights[2].append(1 / denom)
    return tuple(map(tuple, weights))


def quadratic(points: Sequence[int], values: Sequence[float]) -> tuple[Fraction, ...]:
    """(c0, c1, c2) of the quadratic through (points[i], values[i]), exactly (Lagrange)."""
    ys = [Fraction(y) for y in values]
    return tuple(sum((y * w for y, w in zip(ys, row)), Fraction(0))
                 for row in _lagrange_weights(tuple(points)))


def _at(c: Sequence[Fraction], s: int) -> Fraction:
    return c[0] + c[1] * s + c[2] * s * s


def sequence_points(seq_len: int) -> tuple[int, ...]:
    """The profiled sequence length and two shorter ones (distinct, >= 2) the model's tensors
    are measured at; () if there are too few (a sequence shorter than 4 is not modelled)."""
    step = max(1, seq_len // 4)
    points = (seq_len, seq_len - step, seq_len - 2 * step)
    return points if points[-1] >= 2 else ()


def node_factors(numels: Mapping[str, Sequence[tuple[int, ...]]] | None, seq_len: int | None,
                 seq: int | None) -> dict[str, tuple[float, ...]] | None:
    """Node name -> (output, inputs, both, saved, forward temporaries, backward temporaries)
    factors at sequence length ``seq``: how the elements of its output, of its non-parameter
    inputs and of both, and the bytes it saves that are neither and its temporaries, compare
    with those at the profiled ``seq_len``; ``numels`` at :func:`sequence_points`
    (``passes/sequence.py``). None: nothing to scale."""
    if numels is None or seq_len is None or seq is None or seq == seq_len:
        return None
    points = sequence_points(seq_len)
    fitted: dict[tuple[tuple[int, ...], ...], tuple[float, ...]] = {}  # repeated blocks' nodes
    out: dict[str, tuple[float, ...]] = {}
    for name, per_point in numels.items():
        key = tuple(per_point)
        if key not in fitted:
            fitted[key] = _factors(per_point, points, seq)
        out[name] = fitted[key]
    return out


def _factors(per_point: Sequence[tuple[int, ...]], points: tuple[int, ...],
             seq: int) -> tuple[float, ...]:
    """One node's factors (:func:`node_factors`)."""
    factors: list[float] = []
    for k in range(len(per_point[0])):
        values = [p[k] for p in per_point]
        if values[0] == 0 and k > 2:  # not seen at the profiled length: as the node's tensors
            factors.append(factors[2])
        elif values[0] == 0 or len(set(values)) == 1:
            factors.append(1.0)
        else:
            factors.append(max(0.0, float(_at(quadratic(points, values), seq) / values[0])))
    return tuple(factors)


def peak_lines(lines_by_point: Sequence[Sequence[tuple[int, int]]],
               points: Sequence[int]) -> tuple[Line, ...]:
    """Every time point's quadratic, from its (scaled, fixed) bytes predicted at each of
    ``points`` (the same time points in the same order at each)."""
    out = []
    fitted: dict[tuple[int, ...], tuple[Fraction, ...]] = {}  # time points often repeat
    for per_point in zip(*lines_by_point):
        scaled = tuple(sc for sc, _ in per_point)
        c = fitted.get(scaled)
        if c is None:
            c = fitted[scaled] = quadratic(points, scaled)
        out.append((c[0], c[1], c[2], per_point[0][1]))
    return tuple(dict.fromkeys(out))


def peak_expr(lines: Sequence[Line], profiled_batch: int,
              shapes: Sequence[tuple[int, int]]) -> sympy.Expr:
    """The peak as a sympy ``Max`` in ``BATCH`` and ``SEQ`` over the time points that are the
    largest at one of ``shapes`` (the exact maximum over all of them is
    ``Prediction.peak_bytes_at``)."""
    approx = np.array([[float(x) for x in line] for line in lines])
    keep = {_largest(lines, approx, profiled_batch, b, s) for b, s in shapes}
    terms = [(sympy.Rational(line[0].numerator, line[0].denominator)
              + sympy.Rational(line[1].numerator, line[1].denominator) * SEQ
              + sympy.Rational(line[2].numerator, line[2].denominator) * SEQ ** 2)
             * BATCH / profiled_batch + line[3]
             for line in (lines[i] for i in sorted(keep))]
    return sympy.Max(*terms, evaluate=False) if len(terms) > 1 else terms[0]


def _largest(lines: Sequence[Line], approx: np.ndarray, profiled_batch: int, b: int,
             s: int) -> int:
    """The index of the first of ``lines`` with the most bytes at (b, s), exactly: the lines
    within float rounding of the largest (bounded per line; ``approx``: the lines as floats)
    are compared as fractions."""
    c = approx
    terms = np.stack([c[:, 0], c[:, 1] * s, c[:, 2] * s * s], axis=1) * (b / profiled_batch)
    value = terms.sum(axis=1) + c[:, 3]
    error = 1e-9 * (np.abs(terms).sum(axis=1) + np.abs(c[:, 3])) + 1.0
    close = np.flatnonzero(value + error >= (value - error).max())
    return max(close.tolist(),
               key=lambda i: _at(lines[i], s) * b / profiled_batch + lines[i][3])


def rescaled(prof: Mapping[Any, Any],
             seq_scale: Mapping[str, tuple[float, ...]]) -> dict[Any, Any]:
    """Node profiles with activation bytes scaled to another sequence length by the factors
    :func:`node_factors` gives (parameters keep their bytes)."""
    out, by_name = {}, {n.name: n for n in prof}
    for n, p in prof.items():
        factors = seq_scale.get(n.name, (1.0,) * 6)
        f_out, f_in, f_all = factors[:3]
        # what it saves beyond its inputs and outputs and its transients, by their own
        # quadratics (an attention's (b, h, s, s) probabilities outgrow its (b, 1, s, s) mask)
        f_saved, f_fwd, f_bwd = factors[3:6] if len(factors) >= 6 else (f_all,) * 3
        if n.op == "get_attr" or all(f == 1.0 for f in factors):
            out[n] = p
            continue
        # the inputs it saves: as their own outputs scale (the rest of its inputs may not)
        saved = [by_name[i] for i in p.saved_inputs if i in by_name]
        before = sum(prof[i].output_bytes for i in saved)
        if before:
            f_in = sum(prof[i].output_bytes * seq_scale.get(i.name, (1.0,))[0]
                       for i in saved) / before
        saved_out, saved_in = p.saved_output_bytes * f_out, p.saved_input_bytes * f_in
        internal = (p.saved_bytes - p.saved_output_bytes - p.saved_input_bytes) * f_saved
        out[n] = dataclasses.replace(
            p, output_bytes=round(p.output_bytes * f_out), saved_output_bytes=round(saved_out),
            saved_input_bytes=round(saved_in), saved_bytes=round(saved_out + saved_in + internal),
            fwd_transient_bytes=round(p.fwd_transient_bytes * f_fwd),
            bwd_transient_bytes=round(p.bwd_transient_bytes * f_bwd))
    return out


def peak_in_seq(lines_at: Callable[[int], Sequence[tuple[int, int]]], points: Sequence[int],
                profiled_batch: int, shapes: Sequence[tuple[int, int]],
                ) -> tuple[tuple[Line, ...], sympy.Expr] | None:
    """(every time point's line, the peak as a ``Max`` in b and s) from ``lines_at(s)``, the
    timeline's (scaled, fixed) bytes at each of ``points``; None if the timelines differ in
    their time points."""
    per_point = [lines_at(s) for s in points]
    if len({len(ls) for ls in per_point}) != 1:
        return None
    lines = peak_lines(per_point, points)
    return lines, peak_expr(lines, profiled_batch, shapes)

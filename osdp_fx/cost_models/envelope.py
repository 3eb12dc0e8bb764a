"""The upper envelope of a step's memory lines, as a function of the per-rank batch size.

Every time point of the memory timeline is a line ``scaled * b / profiled_batch + fixed`` in the
batch size ``b`` (activations scale with it, parameters do not); the peak at any batch size is
their maximum, of which only the lines on the upper envelope matter.
"""

from __future__ import annotations

import sympy

BATCH = sympy.Symbol("b", positive=True, integer=True)
"""The per-rank batch size in ``MemoryPrediction.peak_bytes_expr``."""


def envelope(points: list[tuple[int, int]], profiled_batch: int) -> sympy.Expr:
    """``Max`` over time points of ``scaled * b / profiled_batch + fixed`` for batch sizes b >= 1,
    keeping only the lines on the upper envelope (an upper convex hull over the slopes)."""
    best: dict[int, int] = {}
    for s, f in points:  # for equal slopes only the highest intercept matters
        best[s] = max(best.get(s, f), f)
    hull: list[tuple[int, int]] = []  # lines by increasing slope, each maximal somewhere on b >= 1

    def at(line: tuple[int, int], b: float) -> float:
        return line[0] * b / profiled_batch + line[1]

    for line in sorted(best.items()):
        while hull:
            top = hull[-1]
            # b where the new, steeper line overtakes the top line
            cross = (top[1] - line[1]) * profiled_batch / (line[0] - top[0])
            start = max(1.0, cross)
            if len(hull) >= 2:
                prev = hull[-2]
                prev_cross = max(1.0, (prev[1] - top[1]) * profiled_batch / (top[0] - prev[0]))
                if start <= prev_cross:
                    hull.pop()
                    continue
            elif cross <= 1.0:
                hull.pop()
                continue
            break
        if not hull or at(line, 1e18) > at(hull[-1], 1e18):
            hull.append(line)
    lines = [sympy.Rational(s, profiled_batch) * BATCH + f for s, f in hull]
    return sympy.Max(*lines, evaluate=False) if len(lines) > 1 else lines[0]

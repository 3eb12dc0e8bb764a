"""The predicted memory of one training step, drawn stacked by category (matplotlib).

``python -m osdp_fx plan ... --memory-plot FILE.png`` and ``python -m osdp_fx demo --memory-plot
FILE.png`` call :func:`plot_memory_timeline`; ``benchmarks/memory_timeline.py`` passes the curve
a live-storage tracker measured, which is drawn over the prediction.

The horizontal axis is the step's timeline as the memory model walks it
(``cost_models/timeline.py``): the forward of node ``i`` at ``i``, its backward at ``2N - 1 - i``,
then the end of backward and the optimizer step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..errors import InputError
from ..units import format_bytes
from .plan import Plan

__all__ = ["plot_memory_timeline"]

MiB = 2**20

_COLORS = {
    "parameters": "#4C72B0", "optimizer state": "#8172B2", "gradients": "#C44E52",
    "gathered parameters": "#DD8452", "communication buffers": "#937860",
    "activations": "#55A868", "recomputed activations": "#2E7D32",
    "activation gradients": "#8DBF8B",
    "operator temporaries": "#CCB974", "optimizer temporaries": "#DA8BC3", "inputs": "#8C8C8C",
}


def plot_memory_timeline(
    plan: Plan, path: str | os.PathLike[str], *, title: str | None = None,
    measured: Sequence[tuple[float, int]] | None = None, measured_label: str = "measured",
) -> str:
    """Draw ``plan``'s predicted live bytes per rank over one steady-state step, stacked by
    category, with its memory limit as a line; ``measured``: (time point, bytes) pairs drawn on
    top. Writes ``path`` (PNG, SVG, PDF by its suffix) and returns it."""
    pr = plan.prediction
    if pr is None or not pr.memory_timeline:
        raise InputError("this plan has no predicted memory timeline: plan it with the model "
                         "(compile_osdp or python -m osdp_fx plan), not from a file alone")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise InputError("drawing the memory plot needs matplotlib: pip install "
                         "'osdp-fx[bench]' (or pip install matplotlib)") from e
    points = pr.memory_timeline
    ts = [p.t for p in points]
    categories = [c for c, _ in points[0].bytes_by_category
                  if any(dict(p.bytes_by_category)[c] for p in points)]
    stacks = [[dict(p.bytes_by_category)[c] / MiB for p in points] for c in categories]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    ax.stackplot(ts, stacks, labels=categories, step="post",
                 colors=[_COLORS.get(c, "#999999") for c in categories], alpha=0.85)
    n_nodes = (max(ts) - 1) / 2 if ts else 0
    for x, label in ((0, "forward"), (n_nodes, "backward"), (2 * n_nodes, "optim.")):
        ax.axvline(x, color="black", lw=0.6, ls=":")
        ax.text(x, 0.01, f" {label}", transform=ax.get_xaxis_transform(), va="bottom",
                fontsize=8, color="white")
    if plan.memory_limit_bytes:
        ax.axhline(plan.memory_limit_bytes / MiB, color="red", lw=1.2, ls="--",
                   label=f"limit {format_bytes(plan.memory_limit_bytes)}")
    if measured:
        ax.plot([t for t, _ in measured], [b / MiB for _, b in measured], color="black", lw=1.0,
                label=measured_label)
    ax.set_xlim(min(ts), max(ts) + 2)
    ax.set_xlabel("step timeline (graph nodes: forward, then backward in reverse, then the "
                  "optimizer)")
    ax.set_ylabel("MiB per rank")
    counts = ", ".join(f"{n} {s}" for s, n in plan.counts().items() if n)
    ax.set_title(title or f"predicted memory per rank: {counts}; peak "
                          f"{format_bytes(pr.peak_memory_bytes)} at {pr.peak_at}", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def phase_positions(n_samples: dict[str, int], n_nodes: int) -> dict[str, Any]:
    """Where a measured phase's k-th of n samples goes on the timeline's axis: forward spread
    over ``[0, N)``, backward over ``[N, 2N)``, the optimizer step over ``[2N, 2N + 2)``."""
    spans = {"forward": (0.0, n_nodes), "backward": (n_nodes, 2.0 * n_nodes),
             "optimizer": (2.0 * n_nodes, 2.0 * n_nodes + 2)}
    return {phase: (lo, (hi - lo) / max(1, n_samples.get(phase, 1)))
            for phase, (lo, hi) in spans.items()}

"""Reproduce the OSDP reference scheduler's published result with osdp-fx's exact search.

The OSDP reference implementation (Youhe-Jiang/IJCAI2023-OptimalShardedDataParallel) ships
per-layer profile tables (time and memory of GPT-2 layers for 8 hidden sizes, 5 batch indices and
4 strategies; see the "about" field of ``benchmarks/data/osdp-seed-profile.json``, a copy of
them kept with the repository). Its scheduler gives every one
of ``num_layers`` identical layers one of the 4 strategies by a knapsack dynamic programme:

- memory per (layer, strategy) is **truncated toward zero** to whole MB (``np.trunc``) before the
  search, so its plans can really use up to 1 MB per layer more than the budget;
- the budget is ``device_memory_mb - extra_overhead_mb`` MB, **inclusive** (its table has
  ``budget + 1`` cells, 0 .. budget, and the answer is read at the last one);
- it minimises the **summed per-layer time**; there is no transient (gathered-parameter) term.

That is :func:`osdp_fx.planner.solver.solve_min_time` with ``transient_bytes=None``, persistent
memory ``trunc(mem_mb)`` MiB, ``base_bytes`` = the overhead, ``limit_bytes`` = the device memory
and ``granularity_bytes`` = 1 MiB (exact: whole-MiB memory rounds up to itself). The published
case, 48 layers of hidden 1536 at batch index 1 on 8192 MB minus 800 MB, has minimum total time
2.901937 s.

The script also runs a plain pure-Python loop version of the same dynamic programme (one Python
iteration per layer, memory cell and strategy, like the reference's) and prints one JSON line::

    {"min_total_time_s": ..., "search_seconds": ..., "pure_python_seconds": ..., "speedup": ...}

Run from the repository root: ``python benchmarks/search_seed_table.py [--profile PATH]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

from osdp_fx.planner.solver import SearchResult, solve_min_time  # noqa: E402

MIB = 1 << 20
"""One reference "MB" cell, as bytes."""

PROFILE_PATHS = (
    REPO_ROOT / "benchmarks" / "data" / "osdp-seed-profile.json",
    REPO_ROOT.parent / "shared" / "reference" / "osdp-seed-profile.json",
)
"""Where the published tables are looked for when neither --profile nor OSDP_SEED_PROFILE is set."""


@dataclass(frozen=True)
class SeedCase:
    """One search of the reference scheduler, in the units ``solve_min_time`` takes."""

    time_s: tuple[tuple[float, ...], ...]
    """Per-layer time of each strategy (seconds), one row per layer."""
    persistent_bytes: tuple[tuple[int, ...], ...]
    """Per-layer memory of each strategy, truncated to whole MB as the reference does (bytes)."""
    base_bytes: int
    """The reference's extra overhead (bytes)."""
    limit_bytes: int
    """Device memory (bytes)."""
    granularity_bytes: int
    """One MB cell (bytes)."""


def find_profile(path: str | Path | None = None) -> Path | None:
    """The profile file: ``path``, else $OSDP_SEED_PROFILE, else the first of PROFILE_PATHS found."""
    if path is not None:
        return Path(path)
    if os.environ.get("OSDP_SEED_PROFILE"):
        return Path(os.environ["OSDP_SEED_PROFILE"])
    return next((candidate for candidate in PROFILE_PATHS if candidate.is_file()), None)


def load_profile(path: str | Path | None = None) -> dict[str, Any]:
    """The published tables as a dict (keys: hidden_sizes, time_s, mem_mb, extra_overhead_mb, ...)."""
    found = find_profile(path)
    if found is None or not found.is_file():
        raise FileNotFoundError(
            f"OSDP seed profile not found (looked at {path or [str(p) for p in PROFILE_PATHS]}); "
            "pass --profile PATH or set OSDP_SEED_PROFILE"
        )
    return json.loads(found.read_text())


def seed_case(
    profile: dict[str, Any],
    *,
    hidden: int = 1536,
    batch_index: int = 1,
    num_layers: int = 48,
    device_memory_mb: int = 8192,
) -> SeedCase:
    """The reference scheduler's search for ``num_layers`` identical layers of size ``hidden``."""
    h = profile["hidden_sizes"].index(hidden)
    times = tuple(float(t) for t in profile["time_s"][h][batch_index])
    mem = tuple(math.trunc(m) * MIB for m in profile["mem_mb"][h][batch_index])
    return SeedCase(
        time_s=(times,) * num_layers,
        persistent_bytes=(mem,) * num_layers,
        base_bytes=int(profile["extra_overhead_mb"]) * MIB,
        limit_bytes=device_memory_mb * MIB,
        granularity_bytes=MIB,
    )


def solve_seed_case(case: SeedCase) -> SearchResult:
    """osdp-fx's exact search on one reference case (raises PlanError when nothing fits)."""
    return solve_min_time(
        case.time_s,
        case.persistent_bytes,
        limit_bytes=case.limit_bytes,
        base_bytes=case.base_bytes,
        granularity_bytes=case.granularity_bytes,
    )


def pure_python_min_time(
    time_s: Sequence[Sequence[float]], cells: Sequence[Sequence[int]], budget_cells: int
) -> tuple[float, list[int]]:
    """The same knapsack as loops over layers, memory cells and strategies, for timing only.

    ``best[v]``: least time of the layers added so far within ``v`` cells. Returns the optimum
    and the plan (``math.inf`` and an empty plan when nothing fits).
    """
    best = [0.0] * (budget_cells + 1)
    picks: list[list[int]] = []
    for times, sizes in zip(time_s, cells):
        new = [math.inf] * (budget_cells + 1)
        pick = [-1] * (budget_cells + 1)
        for v in range(budget_cells + 1):
            for j, (t, w) in enumerate(zip(times, sizes)):
                if w <= v and best[v - w] + t < new[v]:
                    new[v] = best[v - w] + t
                    pick[v] = j
        best = new
        picks.append(pick)
    if best[budget_cells] == math.inf:
        return math.inf, []
    plan, free = [], budget_cells
    for layer in range(len(picks) - 1, -1, -1):
        j = picks[layer][free]
        plan.append(j)
        free -= cells[layer][j]
    return best[budget_cells], plan[::-1]


def _best_seconds(fn: Any, repeats: int) -> tuple[float, Any]:
    """Least wall time of ``repeats`` calls of ``fn`` and its last result."""
    seconds, out = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        seconds = min(seconds, time.perf_counter() - start)
    return seconds, out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--profile", help="osdp-seed-profile.json (default: $OSDP_SEED_PROFILE, then PROFILE_PATHS)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs of the numpy search (the best is kept)"
    )
    parser.add_argument(
        "--python-repeats", type=int, default=3, help="timed runs of the pure-Python loop (best kept)"
    )
    args = parser.parse_args(argv)

    case = seed_case(load_profile(args.profile))
    search_seconds, result = _best_seconds(lambda: solve_seed_case(case), args.repeats)

    cells = [[b // case.granularity_bytes for b in row] for row in case.persistent_bytes]
    budget = (case.limit_bytes - case.base_bytes) // case.granularity_bytes
    python_seconds, (python_time_s, python_plan) = _best_seconds(
        lambda: pure_python_min_time(case.time_s, cells, budget), args.python_repeats
    )
    if not math.isclose(python_time_s, result.total_time_s, rel_tol=1e-12):
        raise SystemExit(
            f"pure-Python DP found {python_time_s} s but solve_min_time {result.total_time_s} s"
        )
    python_peak = case.base_bytes + sum(row[j] for row, j in zip(case.persistent_bytes, python_plan))
    assert python_peak <= case.limit_bytes, "pure-Python plan over the limit"

    print(json.dumps({
        "min_total_time_s": result.total_time_s,
        "search_seconds": search_seconds,
        "pure_python_seconds": python_seconds,
        "speedup": python_seconds / search_seconds,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""In a process group every rank plans with the same node times, at the slowest rank's pace."""

from __future__ import annotations

import pytest
from harness import cases


def test_every_rank_gets_the_mean_node_times_scaled_to_the_slowest_rank(worlds):
    r0, r1 = worlds(2).run(cases.slowest_rank_times)
    assert r0["after"] == r1["after"]
    assert len(r0["after"]) == len(r0["before"]) > 5
    slowest = max(sum(map(sum, r0["before"])), sum(map(sum, r1["before"])))
    assert sum(map(sum, r0["after"])) == pytest.approx(slowest, rel=1e-12)
    scale = slowest / (sum(map(sum, r0["before"])) + sum(map(sum, r1["before"])))
    for mine, theirs, after in zip(r0["before"], r1["before"], r0["after"]):
        assert after == pytest.approx(((mine[0] + theirs[0]) * scale,
                                       (mine[1] + theirs[1]) * scale), rel=1e-12)


def test_ranks_with_different_graphs_fail_instead_of_hanging(worlds):
    for r in worlds(2).run(cases.slowest_rank_times, mismatch=True):
        assert "every rank must compile the same model" in r["error"]

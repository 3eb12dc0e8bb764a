"""In a process group every rank plans with the slowest rank's measured node times."""

from __future__ import annotations

from harness import cases


def test_every_rank_gets_the_slowest_ranks_time_of_every_node(worlds):
    r0, r1 = worlds(2).run(cases.slowest_rank_times)
    assert r0["after"] == r1["after"]
    assert len(r0["after"]) == len(r0["before"]) > 5
    for mine, theirs, after in zip(r0["before"], r1["before"], r0["after"]):
        assert after == (max(mine[0], theirs[0]), max(mine[1], theirs[1]))


def test_ranks_with_different_graphs_fail_instead_of_hanging(worlds):
    for r in worlds(2).run(cases.slowest_rank_times, mismatch=True):
        assert "every rank must compile the same model" in r["error"]

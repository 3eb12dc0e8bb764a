"""What ``python -m osdp_fx plan`` writes to stderr when it is not a terminal (a log file, CI):
at most one line per stage, and the search's candidates only at DEBUG, labelled as such."""

from __future__ import annotations

import logging
import re
from collections import Counter

from osdp_fx.cli import main

PLAN = ["plan", "osdp_fx/examples.py:tiny_gpt", "--world-size", "2", "--memory", "96MiB"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_plan_off_a_terminal_writes_one_line_per_stage(capsys):
    assert main(PLAN) == 0  # capsys: stderr is not a terminal, so plain log lines
    err = capsys.readouterr().err.splitlines()
    lines = [line for line in err if line.startswith("[osdp-fx] ")]
    # stage lines ('plan (profile, search) > profile: done in ...'): one per stage
    stages = Counter(m.group(1) for line in lines
                     if (m := re.match(r"\[osdp-fx\] ([^:]+?): (done in |\d+/\d+ |[\d.]+ s$)",
                                       line)))
    for stage in ("build model", "capture", "plan (profile, search) > profile",
                  "plan (profile, search)"):
        assert stages[stage] == 1, (stage, err)
    assert max(stages.values()) == 1, stages
    assert len(set(lines)) == len(lines), err  # no line twice
    assert not [line for line in lines if line.startswith("[osdp-fx] search")
                or "candidate" in line], err
    assert len(lines) <= 20, err  # a dozen now: no flood


def test_the_search_candidates_are_logged_at_debug_as_candidates(capsys):
    logger = logging.getLogger("osdp_fx.planner.search")
    handler, level, propagate = Records(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # kept off stderr
    try:
        assert main([*PLAN, "--quiet"]) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    capsys.readouterr()
    searched = [r for r in handler.records if "search" in r.getMessage()]
    assert searched, handler.records
    candidates = [r for r in searched if r.getMessage().startswith("search candidate: ")]
    assert candidates and all(r.levelno == logging.DEBUG for r in candidates)
    assert not [r for r in searched if r.getMessage().startswith("search:")
                and r.levelno >= logging.INFO]

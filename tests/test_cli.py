"""The command line as a user meets it: what ``python -m osdp_fx plan`` writes to stderr when it
is not a terminal (a log file, CI): at most one line per stage, and the search's candidates
only at DEBUG, labelled as such; ``python -m osdp_fx demo`` as the README runs it; and the
table ``python -m osdp_fx profile`` prints."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections import Counter

from osdp_fx.cli import main
from osdp_fx.core import progress

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = ["plan", "osdp_fx/examples.py:tiny_gpt", "--world-size", "2", "--memory", "96MiB"]


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_plan_off_a_terminal_writes_one_line_per_stage(capsys, monkeypatch):
    # a stage that outlasts the interval also logs its elapsed time every interval (tested in
    # tests/core/test_progress.py); here no stage may, whatever the machine's speed
    monkeypatch.setenv(progress.INTERVAL_ENV, "3600")
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


def test_the_demo_runs_as_the_readme_says(tmp_path):
    """``python -m osdp_fx demo``, the README's first command, in a subprocess: a 2-rank world
    searches a plan under 12 MiB, prints it and the rewritten graph, and trains 5 steps."""
    env = {**os.environ, "OSDP_FX_PLAN_CACHE": str(tmp_path / "plan-cache"),
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "osdp_fx", "demo"], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:]
    plan = out.split("== plan ==", 1)[1].split("== rewritten graph (rank 0) ==", 1)[0]
    assert "Plan for world size 2" in plan and "memory limit 12.0 MiB" in plan, plan
    assert "full_shard" in plan or "shard_grad_op" in plan, plan  # 12 MiB forces sharding
    graph = out.split("== rewritten graph (rank 0) ==", 1)[1].split("== training", 1)[0]
    assert "def forward(" in graph and "all_gather" in graph, graph[-3000:]
    losses = [float(v) for v in re.findall(r"^step \d+: loss (\S+)$", out, re.MULTILINE)]
    assert len(losses) == 5 and losses[-1] < losses[0], out[-2000:]
    held = [int(n.replace(",", "")) for n in
            re.findall(r"rank \d+: ([\d,]+)", out.rsplit("parameter elements held", 1)[1])]
    assert len(held) == 2 and held[0] == held[1] > 0, out[-500:]


def test_profile_prints_each_operator_and_the_prediction_beside_the_measured_step(capsys):
    assert main(["profile", "osdp_fx/examples.py:tiny_gpt", "--repeats", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    table, totals = out.split("\ntotals: ", 1)
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert len(rows) > 20, table
    targets = {row[1] for row in rows}
    assert {"embedding", "linear", "cross_entropy"} <= targets, targets  # names, no addresses
    assert not [t for t in targets if "0x" in t or t.startswith("<")], targets
    flops = re.match(r"([\d.e+]+) forward FLOPs, ([\d.e+]+) backward", totals)
    forward, backward = (float(v) for v in flops.groups())
    assert forward > 0 and 1.5 <= backward / forward <= 2.5, totals  # backward: about twice
    step = re.search(r"^step time \(SGD, one process\) +([\d.]+) ms +([\d.]+) ms", totals,
                     re.MULTILINE)
    assert step and float(step.group(1)) > 0 and float(step.group(2)) > 0, totals
    peak = re.search(r"^peak memory .* ([+-][\d.]+)%$", totals, re.MULTILINE)
    assert peak and -10 <= float(peak.group(1)) <= 5, totals  # the memory promise

"""Progress of long work (osdp_fx/core/progress.py): the command line shows a bar on a terminal and
plain log lines otherwise, --quiet silences both; compile_osdp logs its stages' seconds through
logging and draws nothing when stderr is not a terminal."""

from __future__ import annotations

import io
import logging
import os
import pty
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from osdp_fx import compile_osdp
from osdp_fx.core import progress
from osdp_fx.errors import InputError
from osdp_fx.examples import MLP

ROOT = Path(__file__).resolve().parents[2]
PLAN = [sys.executable, "-m", "osdp_fx", "plan", "osdp_fx/examples.py:tiny_gpt",
        "--world-size", "8", "--memory", "96MiB", "--fake"]
MEASURED_PLAN = PLAN[:-1]
"""PLAN profiled by running (about a second): long enough for the profile to be reported while
it runs, where the fake profile of the repeated blocks may end between two reports."""


def run_cli(args: list[str], *, terminal: bool, interval_s: float | None = None) -> str:
    """stderr of the command line run as a subprocess, on a pseudo-terminal when ``terminal``."""
    env = {**os.environ}
    env.pop(progress.INTERVAL_ENV, None)
    if interval_s is not None:
        env[progress.INTERVAL_ENV] = str(interval_s)
    if not terminal:
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # the terminal closed with the process
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read)
    reader.start()
    proc.communicate(timeout=300)
    reader.join(timeout=10)
    os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")


def test_plain_log_lines_report_progress_when_not_a_terminal():
    err = run_cli(MEASURED_PLAN, terminal=False, interval_s=0.05)
    counts = [line for line in err.splitlines()
              if line.startswith("[osdp-fx] plan (profile, search) > profile: ")
              and " nodes (" in line]
    assert counts, err  # periodic 'n/N nodes (p %), t s' lines while profiling
    done = [int(line.split(": ")[1].split("/")[0]) for line in counts]
    assert done == sorted(done)
    for stage in ("build model", "capture", "plan (profile, search)"):
        assert f"[osdp-fx] {stage}: done in " in err, err
    assert "\r" not in err  # no bar drawn into a file


def test_quiet_silences_progress():
    err = run_cli([*PLAN, "--quiet"], terminal=False, interval_s=0.05)
    assert "[osdp-fx]" not in err and "done in" not in err, err
    err = run_cli([*PLAN, "--quiet"], terminal=True)
    assert "\r" not in err.replace("\r\n", "\n") and "done in" not in err, err


def test_a_terminal_gets_a_bar():
    err = run_cli(MEASURED_PLAN, terminal=True, interval_s=0.05)  # shown after 0.05 s
    assert "\rplan (profile, search) > profile: [#" in err, err  # redrawn in place
    assert "nodes (" in err and "plan (profile, search): done in" in err
    assert "[osdp-fx]" not in err  # no log lines under the bar


def test_compile_osdp_logs_its_stages_and_draws_nothing_off_a_terminal(caplog, capfd):
    caplog.set_level(logging.INFO, logger="osdp_fx.api")
    torch.manual_seed(0)
    compile_osdp(MLP((32, 64, 10)), (torch.randn(4, 32),), plan="replicate")
    messages = [r.getMessage() for r in caplog.records if r.name == "osdp_fx.api"]
    for stage in ("capture", "plan (profile)", "aliases", "shard"):
        line = next((m for m in messages if m.startswith(f"{stage}: ")), None)
        assert line is not None and line.endswith(" s"), messages
        float(line.split(": ")[1][:-2])
    assert any(m.startswith("compile_osdp: ") and "capture" in m for m in messages)
    err = capfd.readouterr().err
    assert "\r" not in err and "done in" not in err


def test_modes_resolve_and_report(caplog, monkeypatch):
    try:
        with pytest.raises(InputError, match="progress mode"):
            progress.configure("loud")
        progress.configure("auto", stream=io.StringIO())
        assert progress.mode() == "off"  # not a terminal
        master, slave = pty.openpty()
        with os.fdopen(slave, "w") as terminal:
            progress.configure("auto", stream=terminal)
            monkeypatch.setenv("RANK", "0")
            assert progress.mode() == "bar"
            monkeypatch.setenv("RANK", "1")
            assert progress.mode() == "off"  # only rank 0 draws
        os.close(master)

        caplog.set_level(logging.INFO, logger="osdp_fx.core.progress")
        progress.configure("log", interval_s=0.05)
        with progress.task("work", total=10, unit="items") as task:
            for _ in range(10):
                time.sleep(0.03)
                task.advance()
        lines = [r.getMessage() for r in caplog.records if r.name == "osdp_fx.core.progress"]
        assert any(m.startswith("work: ") and "/10 items (" in m for m in lines), lines
        assert lines[-1].startswith("work: done in ") and lines[-1].endswith("(10 items)")

        caplog.clear()
        progress.configure("off")
        with progress.task("silent", total=3):
            time.sleep(0.2)
        assert not [r for r in caplog.records if r.name == "osdp_fx.core.progress"]
    finally:
        progress.configure("auto")

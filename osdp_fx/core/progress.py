"""Progress of long work: a bar on a terminal, plain log lines otherwise, nothing when quiet.

[Note: progress]
Capture, profiling, the search and sharding can take tens of seconds on a large model; a user
must be able to tell progress from a hang. Long work runs inside :func:`task` (nested tasks
form a stack: ``plan > profile``); a task with a ``total`` is advanced as its items finish
(the profile pass advances once per node), one without shows its elapsed time. A daemon thread
reports the innermost task while any runs, in one of the modes:

- ``"bar"``: one line redrawn in place on ``stream`` (stderr) every ``BAR_REFRESH_S``, shown
  once a task has run ``BAR_DELAY_S`` (both: or the interval below, if shorter); a finished
  task that was shown leaves a line with its time;
- ``"log"``: a line through this module's logger (INFO) every ``interval_s`` seconds (5 s, or
  the ``OSDP_FX_PROGRESS_INTERVAL_S`` environment variable), and one when each task ends;
- ``"off"``: nothing;
- ``"auto"`` (the default, what ``compile_osdp`` sees): ``"bar"`` when ``stream`` is a
  terminal and this is rank 0 (of torch.distributed when initialised, else ``RANK``), else
  ``"off"``.

``python -m osdp_fx`` uses ``"bar"`` on a terminal, ``"log"`` otherwise and ``"off"`` with
``--quiet``; in Python, :func:`configure` sets the mode. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

from ..errors import InputError

log = logging.getLogger(__name__)

__all__ = ["MODES", "Task", "configure", "mode", "stage", "task"]

MODES = ("auto", "bar", "log", "off")
"""Progress modes (see [Note: progress])."""
INTERVAL_ENV = "OSDP_FX_PROGRESS_INTERVAL_S"
"""Environment variable: seconds between log-mode lines."""
DEFAULT_INTERVAL_S = 5.0
"""Seconds between log-mode lines by default."""
BAR_DELAY_S = 0.5
"""A bar appears only for a task that has run this long (short work draws nothing)."""
BAR_REFRESH_S = 0.2
"""Seconds between redraws of the bar."""


@dataclasses.dataclass
class Task:
    """One piece of long work being reported."""

    label: str
    """What it is, e.g. 'profile'."""
    total: int | None
    """Items to do (None: unknown; its elapsed time is shown instead)."""
    unit: str
    """What the items are, e.g. 'nodes'."""
    start_s: float = dataclasses.field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when it began."""
    done: int = 0
    """Items finished so far."""
    shown: bool = False
    """Whether the bar has drawn it."""

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more items done."""
        self.done += n

    @property
    def elapsed_s(self) -> float:
        """Seconds since it began."""
        return time.perf_counter() - self.start_s

    def describe(self) -> str:
        """'1200/2397 nodes (50 %), 12.3 s' or '12.3 s'."""
        if self.total:
            return (f"{self.done}/{self.total} {self.unit} ({100 * self.done // self.total} %), "
                    f"{self.elapsed_s:.1f} s")
        return f"{self.elapsed_s:.1f} s"


class _Reporter:
    """The process's one reporter: the task stack and the thread that shows it."""

    def __init__(self) -> None:
        self.mode = "auto"
        self.stream: TextIO | None = None
        self.interval_s: float | None = None
        self.tasks: list[Task] = []
        self.lock = threading.RLock()
        self.thread: threading.Thread | None = None
        self.active = "off"
        self.last_line_s = 0.0
        self.drawn = False

    def out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def resolved(self) -> str:
        if self.mode != "auto":
            return self.mode
        try:
            tty = self.out().isatty()
        except (AttributeError, ValueError):
            tty = False
        return "bar" if tty and _rank() == 0 else "off"

    def interval(self) -> float:
        if self.interval_s is not None:
            return self.interval_s
        try:
            return max(0.01, float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)))
        except ValueError:
            return DEFAULT_INTERVAL_S

    def label(self) -> str:
        return " > ".join(t.label for t in self.tasks)

    def push(self, t: Task) -> None:
        with self.lock:
            if not self.tasks:
                self.active = self.resolved()
                self.last_line_s = time.perf_counter()
            self.tasks.append(t)
            if self.active != "off" and self.thread is None:
                self.thread = threading.Thread(target=self.run, name="osdp-fx-progress",
                                               daemon=True)
                self.thread.start()

    def pop(self, t: Task) -> None:
        with self.lock:
            label = self.label()
            self.tasks.remove(t)
            if self.active == "bar" and t.shown:
                self.write(f"{label}: done in {t.elapsed_s:.1f} s"
                           + (f" ({t.done} {t.unit})" if t.total else ""), end=True)
            elif self.active == "log":
                log.info("%s: done in %.1f s%s", label, t.elapsed_s,
                         f" ({t.done} {t.unit})" if t.total else "")
                self.last_line_s = time.perf_counter()

    def write(self, text: str, *, end: bool = False) -> None:
        """Redraw the bar's line (``end``: leave it and start a new line)."""
        width = shutil.get_terminal_size((100, 20)).columns - 1
        stream = self.out()
        stream.write("\r" + text[:width] + "\x1b[K" + ("\n" if end else ""))
        stream.flush()
        self.drawn = not end

    def run(self) -> None:
        while True:
            time.sleep(min(BAR_REFRESH_S if self.active == "bar" else 0.5, self.interval()))
            with self.lock:
                if not self.tasks:
                    if self.drawn:  # clear the bar's line
                        self.out().write("\r\x1b[K")
                        self.out().flush()
                        self.drawn = False
                    self.thread = None
                    return
                top = self.tasks[-1]
                if self.active == "bar" and self.tasks[0].elapsed_s >= min(BAR_DELAY_S,
                                                                           self.interval()):
                    for t in self.tasks:
                        t.shown = True
                    self.write(f"{self.label()}: {_bar(top)}{top.describe()}")
                elif self.active == "log" and time.perf_counter() - self.last_line_s >= \
                        self.interval():
                    log.info("%s: %s", self.label(), top.describe())
                    self.last_line_s = time.perf_counter()


def _rank() -> int:
    """This process's rank: torch.distributed's when it is initialised (never imported here),
    else the RANK environment variable torchrun sets, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def _bar(t: Task, width: int = 24) -> str:
    if not t.total:
        return ""
    filled = min(width, width * t.done // t.total)
    return "[" + "#" * filled + "." * (width - filled) + "] "


_REPORTER = _Reporter()


def configure(mode: str = "auto", *, stream: TextIO | None = None,
              interval_s: float | None = None) -> None:
    """Set how long work reports progress: ``mode`` one of MODES ([Note: progress]),
    ``stream`` where the bar goes (default stderr), ``interval_s`` between log-mode lines
    (default ``OSDP_FX_PROGRESS_INTERVAL_S`` or 5 s)."""
    if mode not in MODES:
        raise InputError(f"progress mode {mode!r} is unknown; use one of {', '.join(MODES)}")
    _REPORTER.mode, _REPORTER.stream, _REPORTER.interval_s = mode, stream, interval_s


def mode() -> str:
    """The mode tasks started now report in ('bar', 'log' or 'off')."""
    return _REPORTER.resolved()


@contextlib.contextmanager
def task(label: str, total: int | None = None, *, unit: str = "") -> Iterator[Task]:
    """Report the work done inside as ``label`` (``total`` items of ``unit``, advanced with
    ``Task.advance``, or None for elapsed time only)."""
    t = Task(label, total, unit)
    _REPORTER.push(t)
    try:
        yield t
    finally:
        _REPORTER.pop(t)


@contextlib.contextmanager
def stage(label: str, logger: logging.Logger, times: dict[str, float] | None = None,
          ) -> Iterator[Task]:
    """A :func:`task` whose seconds are also logged at INFO through ``logger`` whatever the
    progress mode (and added to ``times[label]`` when given)."""
    with task(label) as t:
        yield t
    seconds = t.elapsed_s
    if times is not None:
        times[label] = times.get(label, 0.0) + seconds
    logger.info("%s: %.2f s", label, seconds)

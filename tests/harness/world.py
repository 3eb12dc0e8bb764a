"""A persistent world of gloo ranks that runs test cases on demand.

Starting a world costs seconds, so one world serves many cases: each rank is a process (forked
from a server that has imported the libraries once, ``forkserver_context``) that waits for
tasks (an importable function and its arguments), runs them, and writes the result to a file.
A task that does not finish in time kills the world (the next use starts a
fresh one) and fails the test instead of hanging it.
"""

from __future__ import annotations

import gc
import itertools
import os
import queue
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from osdp_fx.runtime.launch import free_port, init_world


class CaseFailed(AssertionError):
    """A case raised on some rank; ``args[1]`` maps each failing rank to its error report."""

    def __str__(self) -> str:
        return str(self.args[0])


def freeze_imported_objects() -> None:
    """Import the heavy libraries the cases use and move every object alive now out of the
    cyclic collector's generations (``gc.freeze``): modules are never garbage, and with them
    frozen a collection (``compile_osdp`` runs one) takes milliseconds instead of about 0.25 s.
    Objects created later, the cases' models and tensors, are collected and found by
    ``gc.get_objects()`` as before; no tensor a case measures exists yet."""
    import torch._dynamo  # noqa: F401
    import torch.export  # noqa: F401
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    gc.collect()
    gc.freeze()


RANK_PRELOAD = ("harness.rank_preload",)
"""What the forkserver imports before it forks ranks (``forkserver_context``)."""


def forkserver_context() -> Any:
    """The ``forkserver`` multiprocessing context, its server preloading ``RANK_PRELOAD``.

    A spawned rank imports torch, torch._dynamo, transformers and osdp_fx itself: about 8 s of
    CPU, 20-100 s of wall time per world on a busy 2-core machine. With a forkserver, one
    process per test process imports them once (``harness.rank_preload``) and every rank is a
    fork of it. The server only imports (no torch op, no thread pool, no process group), so
    forking it is safe; each rank then joins its own gloo world as before. The server is one
    per process: ``fault_cases`` forks its ranks from it too.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    _start_forkserver()
    return ctx


def _start_forkserver() -> None:
    """Start the forkserver (if it is not running) with this process's ``sys.path`` as its
    ``PYTHONPATH``: before Python 3.12 the server ignores the path it is given, so its preload
    (the harness, which ``conftest.py`` puts on the path, and osdp_fx from a checkout) failed
    to import, silently, and every rank imported everything itself."""
    from multiprocessing import forkserver

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _worker(rank: int, world_size: int, port: int, tasks: Any, done: Any, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_world(rank, world_size, port, backend="gloo", timeout_s=60.0)
    freeze_imported_objects()
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args, kwargs = task
        path = os.path.join(out_dir, f"{task_id}.rank{rank}.pt")
        try:
            torch.save({"ok": True, "result": fn(rank, world_size, *args, **kwargs)}, path)
        except BaseException as exc:
            torch.save({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                        "type": type(exc).__name__, "traceback": traceback.format_exc()}, path)
        done.put((task_id, rank))


class World:
    """``size`` ranks of a gloo world; ``run(fn, ...)`` calls ``fn(rank, size, ...)`` on each."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ctx = forkserver_context()
        self._dir = tempfile.mkdtemp(prefix=f"osdp-world{size}-")
        self._tasks = [self._ctx.SimpleQueue() for _ in range(size)]
        self._done = self._ctx.Queue()
        port = free_port()
        self._procs = [
            self._ctx.Process(target=_worker, args=(r, size, port, self._tasks[r], self._done,
                                                    self._dir), daemon=True)
            for r in range(size)
        ]
        for p in self._procs:
            p.start()
        self._ids = itertools.count()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 240.0,
            **kwargs: Any) -> list[Any]:
        """Run ``fn`` on every rank; return the per-rank results or raise CaseFailed."""
        task_id = next(self._ids)
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        finished: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(finished) < self.size:
            try:
                tid, rank = self._done.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"ranks {dead} died" if dead else f"not finished in {timeout_s} s"
                    raise CaseFailed(f"{fn.__name__} on ranks "
                                     f"{sorted(set(range(self.size)) - finished)}: {why}")
                continue
            assert tid == task_id, (tid, task_id)
            finished.add(rank)
        reports = [torch.load(os.path.join(self._dir, f"{task_id}.rank{r}.pt"), weights_only=False)
                   for r in range(self.size)]
        failed = [(r, rep) for r, rep in enumerate(reports) if not rep["ok"]]
        if failed:
            if len(failed) < self.size:  # the others may be out of step in their collectives
                self.close()
            raise CaseFailed("\n".join(f"rank {r}: {rep['traceback']}" for r, rep in failed),
                             {r: rep for r, rep in failed})
        return [rep["result"] for rep in reports]

    def run_expecting_error(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[int, dict]:
        """Run ``fn``, which must fail on every rank; return each rank's error report."""
        try:
            self.run(fn, *args, **kwargs)
        except CaseFailed as exc:
            if len(exc.args) > 1 and len(exc.args[1]) == self.size:
                return exc.args[1]
            raise
        raise AssertionError(f"{fn.__name__} succeeded on every rank; expected an error")

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

"""Fault injection: a 2-rank gloo world in which rank 1 fails in the middle of a training step.

The persistent test worlds (``harness.world``) cannot be used: a fault breaks the world, and a
rank must be able to die. :func:`run_fault` spawns its own two processes, with a short process
group timeout, and reports what the surviving rank 0 saw and when.

Faults (all injected on rank 1 after the forward of step 2, before its backward: rank 0 goes on
into the backward's collectives and finds nobody there):

* ``"raise"``: rank 1 raises and its process exits, as a training script with an uncaught
  exception does.
* ``"raise_and_linger"``: rank 1 raises, catches it and stays alive without joining any further
  collective (a rank stuck elsewhere, or a caller that swallows the error). Only the process
  group timeout can end rank 0's wait.
* ``"kill"``: rank 1 is killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from osdp_fx import clip_grad_norm_, compile_osdp
from osdp_fx.runtime.launch import free_port, init_world

from .clip_cases import batches, build
from .models import local

FAULTS = ("raise", "raise_and_linger", "kill")


class InjectedFault(RuntimeError):
    pass


def _write(path: str, report: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def fault_worker(rank: int, world: int, port: int, out_dir: str, timeout_s: float, fault: str,
                 plan: str) -> None:
    """One rank: two SGD steps with clipping; rank 1 fails in the second (module docstring)."""
    torch.set_num_threads(1)
    report: dict[str, Any] = {"rank": rank, "ok": False}
    try:
        init_world(rank, world, port, timeout_s=timeout_s)
        net, loss_fn = build("gpt")
        data = [local(b, rank, world) for b in batches("gpt", global_batch=2 * world, steps=2)]
        compiled = compile_osdp(net, data[0][:1], plan=plan)
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
        for step, batch in enumerate(data):
            loss = loss_fn(compiled(*batch[:1]), batch)
            if step == 1 and rank == 1:
                _write(os.path.join(out_dir, "fault_at"), {"time": time.time()})
                if fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise InjectedFault(f"injected fault on rank 1 ({fault})")
            report["entered_backward"] = time.time()
            loss.backward()
            clip_grad_norm_(compiled, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        report["ok"] = True
    except BaseException as exc:
        report.update(error_at=time.time(), type=type(exc).__name__, error=str(exc),
                      traceback=traceback.format_exc())
    _write(os.path.join(out_dir, f"rank{rank}.json"), report)
    if rank == 1 and fault == "raise_and_linger":
        time.sleep(10 * timeout_s)  # alive, in no collective; the parent kills it when done
    if rank == 1 and fault == "raise":
        os._exit(1)  # as an uncaught exception would end a script


def run_fault(fault: str, *, timeout_s: float, bound_s: float,
              plan: str = "full_shard") -> dict[str, Any]:
    """Run a 2-rank world with ``fault`` on rank 1; return rank 0's and rank 1's reports.

    ``bound_s`` is a hang guard: if rank 0 has not reported by then, every process is killed and
    the result says ``hung``.
    """
    assert fault in FAULTS, fault
    ctx = mp.get_context("spawn")
    out_dir = tempfile.mkdtemp(prefix="osdp-fault-")
    port = free_port()
    procs = [ctx.Process(target=fault_worker, args=(r, 2, port, out_dir, timeout_s, fault, plan),
                         daemon=True) for r in range(2)]
    start = time.monotonic()
    try:
        for p in procs:
            p.start()
        rank0 = os.path.join(out_dir, "rank0.json")
        while not os.path.exists(rank0) and time.monotonic() - start < bound_s:
            if not procs[0].is_alive() and not os.path.exists(rank0):
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        procs[0].join(timeout=5)  # does the survivor exit by itself after its error?
        exit0 = procs[0].exitcode
        reports = {}
        for name in ("rank0", "rank1", "fault_at"):
            path = os.path.join(out_dir, f"{name}.json" if name != "fault_at" else name)
            if os.path.exists(path):
                with open(path) as f:
                    reports[name] = json.load(f)
        return {"hung": not os.path.exists(rank0), "elapsed_s": elapsed, "rank0_exitcode": exit0,
                "rank1_exitcode": procs[1].exitcode, **reports}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(out_dir, ignore_errors=True)

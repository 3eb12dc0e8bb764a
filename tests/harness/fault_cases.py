"""Fault injection: a 2-rank gloo world in which rank 1 fails in the middle of a training step.

The persistent test worlds (``harness.world``) cannot be used: a fault breaks the world, and a
rank must be able to die. :func:`run_faults` spawns its own processes (two per fault), with a short process
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

from osdp_fx import Devices, clip_grad_norm_, compile_osdp
from osdp_fx.runtime.launch import free_port, init_world

from .clip_cases import batches, build
from .models import local
from .world import forkserver_context

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
    report: dict[str, Any] = {"rank": rank, "ok": False, "started": time.time()}
    try:
        init_world(rank, world, port, backend="gloo", timeout_s=timeout_s)
        report["joined"] = time.time()
        net, loss_fn = build("gpt")
        data = [local(b, rank, world) for b in batches("gpt", global_batch=2 * world, steps=2)]
        # given devices: the faults, not a measurement of the machine, are under test
        compiled = compile_osdp(net, data[0][:1], Devices(), plan=plan)
        opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
        report["compiled"] = time.time()
        for step, batch in enumerate(data):
            loss = loss_fn(compiled(*batch[:1]), batch)
            if step == 1 and rank == 1:
                _write(os.path.join(out_dir, "fault_at.json"), {"time": time.time()})
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


def run_faults(faults: tuple[str, ...], *, timeout_s: float, bound_s: float,
               plan: str = "full_shard") -> dict[str, dict[str, Any]]:
    """Run one 2-rank world per fault, all at once; return what each world's ranks reported.

    Per fault: ``hung`` (rank 0 had not reported after ``bound_s``, a hang guard: every process
    is then killed), ``elapsed_s`` (start to rank 0's report), ``detect_s`` (rank 1's fault to
    rank 0's error), the exit codes, and the reports ``rank0``, ``rank1`` (type, error, ...).
    """
    assert all(f in FAULTS for f in faults), faults
    # forkserver: one process imports torch, osdp_fx and torch._dynamo (which the profiler
    # imports on first use, ~2 s), and every rank is a fork of it: spawning six fresh
    # interpreters costs ~30 s on a busy 2-core machine.
    ctx = forkserver_context()
    dirs = {f: tempfile.mkdtemp(prefix=f"osdp-fault-{f}-") for f in faults}
    ports = {f: free_port() for f in faults}
    procs = {f: [ctx.Process(target=fault_worker,
                             args=(r, 2, ports[f], dirs[f], timeout_s, f, plan), daemon=True)
                 for r in range(2)] for f in faults}
    start = time.monotonic()
    done: dict[str, float] = {}
    try:
        for f in faults:
            for p in procs[f]:
                p.start()
        while len(done) < len(faults) and time.monotonic() - start < bound_s:
            for f in faults:
                if f not in done and (os.path.exists(os.path.join(dirs[f], "rank0.json"))
                                      or not procs[f][0].is_alive()):
                    done[f] = time.monotonic() - start
            time.sleep(0.05)
        out: dict[str, dict[str, Any]] = {}
        for f in faults:
            procs[f][0].join(timeout=5)  # does the survivor exit by itself after its error?
            result: dict[str, Any] = {
                "elapsed_s": done.get(f, time.monotonic() - start),
                "rank0_exitcode": procs[f][0].exitcode, "rank1_exitcode": procs[f][1].exitcode,
            }
            for name in ("rank0", "rank1", "fault_at"):
                path = os.path.join(dirs[f], f"{name}.json")
                if os.path.exists(path):
                    with open(path) as fh:
                        result[name] = json.load(fh)
            result["hung"] = "rank0" not in result
            if "fault_at" in result and "error_at" in result.get("rank0", {}):
                result["detect_s"] = result["rank0"]["error_at"] - result["fault_at"]["time"]
            out[f] = result
        return out
    finally:
        for f in faults:
            for p in procs[f]:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
            shutil.rmtree(dirs[f], ignore_errors=True)


def backward_fails_then_trains(rank: int, world: int) -> dict[str, Any]:
    """A backward that raises on every rank (caught, as an OOM-skip loop would) must not stop
    later steps from averaging replicated gradients."""
    from osdp_fx import compile_osdp
    from osdp_fx.examples import MLP

    torch.manual_seed(0)
    net = MLP((6, 8, 3))
    x = torch.randn(4, 6) + rank
    compiled = compile_osdp(net, (x,), plan="replicate")

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    handle = compiled.get_parameter("layers.1.weight").register_hook(boom)
    try:
        compiled(x).sum().backward()
    except RuntimeError:
        pass
    handle.remove()
    for p in compiled.parameters():
        p.grad = None
    compiled(x).sum().backward()
    return {"grad": compiled.get_parameter("layers.0.weight").grad.clone()}

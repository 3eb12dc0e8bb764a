"""Start a local multi-process torch.distributed world (for the demo, benchmarks and tests).

Production jobs are launched by torchrun; this helper exists so that ``python -m osdp_fx demo``
and the benchmarks can start a CPU gloo world by themselves. Results travel through files (child
processes lose unflushed prints and large queue messages can deadlock a join).
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import OSDPError


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpus_for(world_size: int) -> bool:
    """Whether a local world of ``world_size`` ranks gets one GPU per rank (NCCL refuses two
    ranks on one GPU, so a larger world than there are GPUs runs on the CPU, with gloo)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def local_device(rank: int, world_size: int = 1, *, backend: str | None = None) -> torch.device:
    """The device a local rank uses: its GPU (made current) when every rank of the world has
    one, or when ``backend`` is ``"nccl"``; else the CPU."""
    if backend == "nccl" or (backend is None and gpus_for(world_size)):
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_world(rank: int, world_size: int, port: int, *, backend: str | None = None,
               timeout_s: float = 60.0) -> torch.device:
    """Join a world rendezvousing on 127.0.0.1:port; collectives time out after ``timeout_s``.
    ``backend`` None means NCCL when there is one GPU per rank and gloo otherwise. Returns the
    rank's device (:func:`local_device`)."""
    device = local_device(rank, world_size, backend=backend)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if backend == "nccl" else {}),
    )
    return device


def _child(rank: int, world_size: int, port: int, out_dir: str, timeout_s: float,
           threads: int, backend: str | None, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(threads)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        init_world(rank, world_size, port, backend=backend, timeout_s=timeout_s)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException as exc:  # reported to the parent, which raises
        torch.save({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()}, path)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 300.0,
              collective_timeout_s: float = 60.0, backend: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks (gloo on CPU, NCCL on
    GPUs, see :func:`init_world`; ``backend`` overrides); return each result.

    ``fn`` must be importable by name (spawned children import it). Raises OSDPError naming the
    first rank that failed, or when the world has not finished after ``timeout_s``.
    """
    threads = 1 if gpus_for(world_size) else max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="osdp-world-") as out_dir:
        ctx = mp.start_processes(
            _child, args=(world_size, free_port(), out_dir, collective_timeout_s, threads, backend, fn,
                             args),
            nprocs=world_size, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise OSDPError(f"the {world_size}-rank world did not finish in {timeout_s:.0f} s")
        results = []
        for rank in range(world_size):
            report = torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False)
            if not report["ok"]:
                raise OSDPError(f"rank {rank} failed: {report['error']}\n{report['traceback']}")
            results.append(report["result"])
        return results

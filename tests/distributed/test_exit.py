"""A process that trained a compiled model and called ``destroy_process_group`` lets go of its
process groups at exit while the interpreter still runs: the model's and optimizer's DTensors,
alive until the interpreter's shutdown, hold a DeviceMesh that holds the groups, and a gloo group
destroyed during that shutdown can abort the process (``terminate called without an active
exception``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from osdp_fx.runtime.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = """
import atexit, os, sys
def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                  for t in os.listdir("/proc/self/task"))
atexit.register(lambda: print("at exit:", threads(), flush=True))  # runs after osdp-fx's own
import torch
import torch.distributed as dist
from torch import nn
from osdp_fx import compile_osdp
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                        world_size=1)
compiled = compile_osdp(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), (torch.randn(4, 8),),
                        plan="full_shard")
opt = torch.optim.AdamW(compiled.parameters())
compiled(torch.randn(4, 8)).sum().backward()
opt.step()
print("trained:", threads(), type(next(compiled.parameters())).__name__, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_the_groups_are_destroyed_before_the_interpreters_shutdown():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(free_port())], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    trained = next(line for line in proc.stdout.splitlines() if line.startswith("trained:"))
    at_exit = next(line for line in proc.stdout.splitlines() if line.startswith("at exit:"))
    assert "pt_gloo_runloop" in trained and trained.endswith("DTensor")
    assert "pt_gloo_runloop" not in at_exit and "gloo_tcp_loop" not in at_exit, at_exit

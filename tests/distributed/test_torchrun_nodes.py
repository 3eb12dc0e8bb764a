"""Two torchrun launchers on this machine, joined by a c10d rendezvous, act as 2 nodes x 2 ranks:
the mesh comes from the LOCAL_WORLD_SIZE torchrun sets, and hierarchical training matches one
process on the global batch (the multi-node launch of docs/multi-node.md, on one machine)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from harness import cases

import osdp_fx
from osdp_fx.runtime.launch import free_port

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "harness",
                      "torchrun_train.py")


def test_two_launchers_make_a_two_node_mesh(tmp_path):
    port = free_port()
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(osdp_fx.__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "osdp-test",
             SCRIPT, str(tmp_path), "gpt", "hierarchical"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    logs = []
    for launcher in launchers:
        try:
            logs.append(launcher.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for other in launchers:
                other.kill()
            raise
    assert all(launcher.returncode == 0 for launcher in launchers), "\n".join(logs)[-4000:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert [r["local_world_size"] for r in results] == ["2"] * 4
    assert results[0]["plan"]["ranks_per_node"] == 2
    cases.assert_matches_single_process(results, "gpt", 4)

"""Run by ``torchrun`` (one launcher per emulated node): train under a plan, save the results.

Usage: ``python -m torch.distributed.run ... torchrun_train.py OUT_DIR MODEL PLAN``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import cases  # noqa: E402

from osdp_fx import Devices  # noqa: E402


def main(out_dir: str, model: str, plan: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        # Devices that name no ranks per node: the mesh comes from LOCAL_WORLD_SIZE (not
        # measured: a 4-rank measurement on 2 cores takes longer than the rest of the test)
        result = cases.train(rank, world, model=model, plan=plan, devices=Devices())
        result["local_world_size"] = os.environ.get("LOCAL_WORLD_SIZE")
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

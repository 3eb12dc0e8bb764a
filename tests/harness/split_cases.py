"""Cases for operator splitting on real worlds."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from osdp_fx import compile_osdp


class Dominant(nn.Module):
    """A model whose parameters are almost all in one square linear."""

    def __init__(self, width: int = 4096) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.big = nn.Linear(width, width, bias=False)
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.out(F.relu(self.big(F.relu(self.inp(x))))), y)


def split_memory(rank: int, world: int, *, plan_dir: str, width: int = 4096) -> dict[str, Any]:
    """Measured and predicted step peaks: unsplit full_shard against 'big' split in 4."""
    from osdp_fx.runtime.memory import measure_step_peak_bytes

    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, 64, generator=gen), torch.randn(8, 8, generator=gen))
    split_plan = f"{plan_dir}/split4.json"
    if rank == 0:
        with open(split_plan, "w") as f:
            json.dump({"format": "osdp-fx-plan", "version": 1, "splits": {"big.weight": 4},
                       "default": "full_shard", "params": {}}, f)
    torch.distributed.barrier()
    out = {}
    for label, plan in (("unsplit", "full_shard"), ("split4", split_plan)):
        torch.manual_seed(0)
        compiled = compile_osdp(Dominant(width), batch, plan=plan, optimizer="sgd")
        params = list(compiled.parameters())
        opt = torch.optim.SGD(params, lr=1e-3)

        def step() -> None:
            compiled(*batch).backward()
            opt.step()

        measured = measure_step_peak_bytes(step, params, opt, warmup_steps=1,
                                           zero_grad=lambda: opt.zero_grad(set_to_none=True))
        out[label] = {"measured": measured, "predicted": compiled.plan.peak_memory_bytes,
                      "code": compiled.code if rank == 0 else ""}
    return out


def searched_split(rank: int, world: int, *, width: int = 2048) -> dict[str, Any]:
    """Search under a limit the unsplit full_shard plan misses by half a gathered weight."""
    gen = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, 64, generator=gen), torch.randn(8, 8, generator=gen))
    torch.manual_seed(0)
    unsplit = compile_osdp(Dominant(width), batch, plan="full_shard", optimizer="sgd").plan
    limit = unsplit.peak_memory_bytes - width * width * 4 // 2
    torch.manual_seed(0)
    compiled = compile_osdp(Dominant(width), batch, memory_limit=limit, optimizer="sgd")
    loss = compiled(*batch)
    loss.backward()
    return {"limit": limit, "unsplit_peak": unsplit.peak_memory_bytes, "plan": compiled.plan,
            "loss": loss.item(), "unsplit_compute_s": unsplit.prediction.compute_s}

"""Command line: ``python -m osdp_fx demo``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist


def _demo_rank(rank: int, world_size: int, steps: int, plan: str | None) -> dict[str, Any]:
    from . import compile_osdp
    from .examples import TinyGPT, lm_loss

    torch.manual_seed(0)
    model = TinyGPT(vocab=512, dim=128, depth=4, heads=4, max_seq=64)
    local_batch, seq = 4, 32
    gen = torch.Generator().manual_seed(1)
    # Learnable data: each sequence counts up from a random start (mod the vocabulary).
    batches = [
        (torch.randint(0, 512, (world_size * local_batch, 1), generator=gen)
         + torch.arange(seq)) % 512
        for _ in range(steps)
    ]
    mine = [b[rank * local_batch:(rank + 1) * local_batch] for b in batches]
    compiled = compile_osdp(model, (mine[0],), plan=plan)
    del model
    opt = torch.optim.AdamW(compiled.parameters(), lr=3e-3)
    losses = []
    for x in mine:
        loss = lm_loss(compiled(x), x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    shard_numel = sum(p.numel() for p in compiled.parameters())
    return {"plan": str(compiled.plan), "code": compiled.code, "losses": losses,
            "local_param_numel": shard_numel}


def demo(args: argparse.Namespace) -> int:
    from .runtime.launch import run_world

    print(f"osdp-fx demo: a {args.world_size}-rank gloo world on the CPU trains a GPT-style "
          f"model (tied embeddings) for {args.steps} steps", flush=True)
    results = run_world(args.world_size, _demo_rank, args.steps, args.plan)
    first = results[0]
    print("\n== plan ==\n" + first["plan"])
    print("\n== rewritten graph (rank 0) ==" + first["code"])
    print("== training (mean loss over ranks) ==")
    for step, loss in enumerate(first["losses"]):
        print(f"step {step}: loss {loss:.4f}")
    per_rank = ", ".join(f"rank {r}: {res['local_param_numel']:,}" for r, res in enumerate(results))
    print(f"parameter elements held per rank: {per_rank}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m osdp_fx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="train a small GPT on a local 2-rank gloo world")
    p_demo.add_argument("--world-size", type=int, default=2)
    p_demo.add_argument("--steps", type=int, default=5)
    p_demo.add_argument("--plan", default=None,
                        help="replicate, full_shard, shard_grad_op or a plan JSON file")
    p_demo.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

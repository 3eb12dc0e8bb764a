"""What an optimizer step costs over a compiled module's parameters, by the optimizer's
implementation: torch's AdamW over the parameters as the module presents them (``DTensor``
parameters under a plan that shards some, as FSDP2's), stepped as the module steps them and
through DTensor's dispatch, and over their local tensors.

A sharded plan's parameters are DTensors; torch's elementwise optimizers step them over their
local tensors ([Note: local optimizer steps] in ``osdp_fx/runtime/local_step.py``), and
``over_dtensors()`` makes every operation of the step go through DTensor's dispatch instead, as
it would without that (as FSDP2's parameters step). A plan that replicates every parameter
presents plain tensors. This times ``optimizer.step()`` alone, with the gradients of one step
in place, under each of torch's implementations (``foreach=False``, the default on the CPU;
``foreach=True``, the default on a GPU; ``fused=True``): over the parameters as the module
steps them, over them through DTensor's dispatch, and over the same parameters' local tensors
as plain parameters (``p.to_local()``, their gradients' local tensors as gradients: what an
elementwise optimizer computes on each rank either way). Round-robin, the median of the
rounds.

    python benchmarks/optimizer_step.py [--plan full_shard] [--depth 8] [--dim 64]
        [--rounds 30] [--world-size 1]

Prints one row per implementation: milliseconds per step each way, and per parameter in
microseconds what the module's step and the step through DTensor's dispatch take beyond the
plain local tensors'.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from osdp_fx.runtime.launch import run_world  # noqa: E402
from osdp_fx.runtime.local_step import over_dtensors  # noqa: E402

WAYS = ("as the module steps", "through DTensor's dispatch", "over local tensors")
"""The ways each implementation is timed (:func:`time_steps`)."""
IMPLEMENTATIONS = {"foreach=False": {"foreach": False}, "foreach=True": {"foreach": True},
                   "fused=True": {"fused": True}}
"""The AdamW implementations timed, and the arguments that choose each."""


def _locals(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each parameter's local tensor as a leaf of its own, its gradient's local tensor as its
    gradient (a DTensor's ``to_local()``; a plain tensor as it is)."""
    out = []
    for p in params:
        if not hasattr(p, "to_local"):
            out.append(p)
            continue
        local = p.to_local().detach().requires_grad_(p.requires_grad)
        local.grad = None if p.grad is None else p.grad.to_local()
        out.append(local)
    return out


def time_steps(rank: int, world: int, plan: str, depth: int, dim: int,
               rounds: int) -> dict[str, Any]:
    """On each rank: the compare.py GPT compiled under ``plan``, one step for its gradients,
    then each implementation's step each way of :data:`WAYS`, round-robin; the medians in
    seconds (rank 0's)."""
    import compare as bench

    from osdp_fx import compile_osdp

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cfg = bench.Config(vocab=512, dim=dim, depth=depth, heads=4, seq=16, batch=2)
    x = bench.local_batch(cfg, rank, device)
    model = compile_osdp(bench.build_model(cfg, device), (x,), plan=plan)
    model(x).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    steps = {}
    for name, kwargs in IMPLEMENTATIONS.items():
        for where, tensors in zip(WAYS, (params, params, _locals(params))):
            try:
                steps[(name, where)] = torch.optim.AdamW(tensors, lr=1e-4, **kwargs)
            except RuntimeError as exc:  # an implementation this device lacks
                steps[(name, where)] = exc
    times: dict[tuple[str, str], list[float]] = {k: [] for k, v in steps.items()
                                                 if not isinstance(v, Exception)}
    for r in range(rounds + 2):
        keys = list(times)
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            if key[1] == WAYS[1]:
                with over_dtensors():
                    steps[key].step()
            else:
                steps[key].step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r >= 2:  # the first two create the state
                times[key].append(time.perf_counter() - start)
    return {"params": len(params), "dtensor": hasattr(params[0], "to_local"),
            "medians": {f"{n} / {w}": statistics.median(t) for (n, w), t in times.items()},
            "failed": {f"{n} / {w}": str(v) for (n, w), v in steps.items()
                       if isinstance(v, Exception)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", default="full_shard")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=1)
    args = parser.parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    out = run_world(args.world_size, time_steps, args.plan, args.depth, args.dim, args.rounds,
                    backend=backend, timeout_s=600)[0]
    n = out["params"]
    print(f"{args.plan}, {n} parameters ({'DTensor' if out['dtensor'] else 'plain tensors'}), "
          f"world {args.world_size}, median of {args.rounds} rounds")
    print("| AdamW | " + " | ".join(f"{w} (ms)" for w in WAYS) + " | beyond the local "
          "tensors, per parameter (us): as the module steps / through DTensor's dispatch |")
    print("|---|---|---|---|---|")
    for name in IMPLEMENTATIONS:
        t = [out["medians"].get(f"{name} / {w}") for w in WAYS]
        if None in t:
            failed = next((v for k, v in out["failed"].items() if k.startswith(name)), "")
            print(f"| {name} | {failed or 'not run'} | | | |")
            continue
        beyond = " / ".join(f"{(x - t[2]) / n * 1e6:.1f}" for x in t[:2])
        print(f"| {name} | " + " | ".join(f"{x * 1e3:.2f}" for x in t) + f" | {beyond} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

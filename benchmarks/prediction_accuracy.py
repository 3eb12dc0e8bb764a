"""How well the cost models predict a training step: time and peak memory, per rank.

Starts a gloo world on the CPU (default 2 ranks, one thread each), and for an MLP, a GPT with
tied embeddings and (when transformers is installed) a tiny Hugging Face GPT-2, under replicate,
shard_grad_op and full_shard, with SGD and AdamW: compiles the model with measured Devices
(`detect_devices()`), then measures the median step time over several steps and the peak memory
of one step with the live-tensor tracker, and prints the predicted against the measured value.

    python benchmarks/prediction_accuracy.py [--world-size 2] [--steps 20]

Prints a Markdown table and, last, one JSON line with the worst absolute errors. The targets:
memory within 10 %, step time within 30 %.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from osdp_fx import Devices, compile_osdp, detect_devices  # noqa: E402
from osdp_fx.examples import MLP, GPTWithLoss, TinyGPT  # noqa: E402
from osdp_fx.runtime.launch import run_world  # noqa: E402
from osdp_fx.runtime.memory import measure_step_peak_bytes  # noqa: E402


class MLPWithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP((512, 1024, 1024, 1024, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.mlp(x), x)


class HFWithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.model = GPT2LMHeadModel(GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=64, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx, labels=idx).loss


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    if name == "mlp":
        return MLPWithLoss(), (torch.randn(16, 512),)
    if name == "gpt":
        return GPTWithLoss(TinyGPT(vocab=1024, dim=128, depth=2, heads=4, max_seq=64)), (
            torch.randint(0, 1024, (8, 64)),)
    return HFWithLoss(), (torch.randint(0, 1024, (8, 64)),)


def measure(rank: int, world: int, models: list[str], steps: int) -> list[dict[str, Any]]:
    devices = detect_devices()
    rows = []
    for name in models:
        for plan in ("replicate", "shard_grad_op", "full_shard"):
            for optimizer in ("sgd", "adamw"):
                rows.append(measure_case(name, plan, optimizer, devices, steps))
                gc.collect()  # the next case starts (and profiles) without this one's memory
    return rows


def measure_case(name: str, plan: str, optimizer: str, devices: Devices,
                 steps: int) -> dict[str, Any]:
    """Predicted and measured step time (and its phases) and peak memory of one case."""
    model, inputs = build(name)
    compiled = compile_osdp(model, inputs, devices, plan=plan, optimizer=optimizer)
    del model
    params = list(compiled.parameters())
    opt = (torch.optim.AdamW(params, lr=1e-4) if optimizer == "adamw"
           else torch.optim.SGD(params, lr=1e-3))
    times, phases = [], []
    for _ in range(steps + 2):
        torch.distributed.barrier()
        start = time.perf_counter()
        loss = compiled(*inputs)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
        phases.append((forward - start, backward - forward, start + times[-1] - backward))
        opt.zero_grad(set_to_none=True)

    def step() -> None:
        compiled(*inputs).backward()
        opt.step()

    peak = measure_step_peak_bytes(step, params, opt, warmup_steps=0,
                                   zero_grad=lambda: opt.zero_grad(set_to_none=True))
    pr = compiled.plan.prediction
    return {
        "model": name, "plan": plan, "optimizer": optimizer,
        "predicted_s": pr.step_time_s, "measured_s": statistics.median(times[2:]),
        "predicted_parts_s": (pr.compute_s, pr.comm_s, pr.optim_s),
        "measured_parts_s": tuple(statistics.median(p[i] for p in phases[2:]) for i in range(3)),
        "predicted_bytes": pr.peak_memory_bytes, "measured_bytes": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    models = ["mlp", "gpt"]
    try:
        import transformers  # noqa: F401

        models.append("hf_gpt2")
    except ImportError:
        pass
    rows = run_world(args.world_size, measure, models, args.steps, timeout_s=1800)[0]
    print("| model | plan | optimizer | step ms predicted | measured | error | peak MiB "
          "predicted | measured | error | predicted compute / comm / optimizer ms | measured "
          "forward / backward / optimizer ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    worst_time = worst_memory = 0.0
    for r in rows:
        t_err = r["predicted_s"] / r["measured_s"] - 1
        m_err = r["predicted_bytes"] / r["measured_bytes"] - 1
        worst_time, worst_memory = max(worst_time, abs(t_err)), max(worst_memory, abs(m_err))
        print(f"| {r['model']} | {r['plan']} | {r['optimizer']} | {r['predicted_s'] * 1e3:.2f} | "
              f"{r['measured_s'] * 1e3:.2f} | {t_err:+.1%} | {r['predicted_bytes'] / 2**20:.2f} | "
              f"{r['measured_bytes'] / 2**20:.2f} | {m_err:+.1%} | "
              f"{' / '.join(f'{x * 1e3:.1f}' for x in r['predicted_parts_s'])} | "
              f"{' / '.join(f'{x * 1e3:.1f}' for x in r['measured_parts_s'])} |")
    print(json.dumps({"world_size": args.world_size, "cases": len(rows),
                      "worst_time_error": round(worst_time, 4),
                      "worst_memory_error": round(worst_memory, 4)}))


if __name__ == "__main__":
    main()

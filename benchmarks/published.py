"""Predicted against published: FSDP training throughput from llm-foundry's and torchtitan's tables.

The rows are MosaicML's published MPT benchmarks (github.com/mosaicml/llm-foundry,
``scripts/train/benchmarking/README.md``, read at commit ``061f2c7c``), every row of the tables
"H100 80GB BF16" and "A100 40GB with 1600 Gbps node-node interconnect (RoCE)" run without
gradient accumulation (GradAccum 1), as published: the model, the sequence length, the GPUs, the
micro batch per GPU, whether every block checkpoints its activations, the mixed precision
(``amp_bf16`` reduces gradients in fp32, ``bf16`` ``PURE`` in bf16) and the throughput in tokens
per second per GPU; and the eager FSDP rows of torchtitan's Llama 3.1 8B tables
(github.com/pytorch/torchtitan, ``benchmarks/llama3_h100_202412_torchtitan.md``, tables 1 and 3:
8 and 128 H100s, local batch 2, sequence 8192, selective activation checkpointing).

For each llm-foundry row, an MPT-shaped GPT (``osdp_fx.examples.mpt_meta``: learned positions,
biases, a tied embedding; its parameter count is the table's) is built on the meta device,
profiled under fake tensors and planned ``full_shard`` (FSDP FULL_SHARD) for the preset of the
row's GPU (``h100-sxm-8x``, ``a100-sxm-40gb-8x``: 8 GPUs a node) at the row's world size and
precision, with every block recomputed where the row checkpoints activations, and AdamW (MPT's
yamls use decoupled AdamW). A torchtitan row is a Hugging Face Llama of Llama 3.1 8B's shape
(``examples/llama_shapes.py``, 8,030,261,248 parameters) planned the same way with every block
under the ``selective`` policy, bf16 parameters and fp32 gradient reduction (torchtitan's
defaults), on ``h100-sxm-8x`` with the published GPUs' 96 GB of HBM2e at 2.4 TB/s
(:func:`torchtitan_gpus`). The script prints the predicted and the published step, and predicted
over published throughput per row.

One constant is fitted to these rows, the share of the matmul rate a fused attention kernel
reaches (``presets.ATTENTION_EFFICIENCY``), on the five rows of :data:`FIT_ROWS`; every other
row is validation, and the table says which is which. ``--fit`` fits it again (the share that
minimises the squared log error of the five rows' throughput) and prints it.

    python benchmarks/published.py [--table h100|a100-40gb|torchtitan|all] [--rows N] [--fit]

Prints a Markdown table and, last, one JSON line: per row the ratio, and how many rows are
within 20 % of their published throughput (of the validation rows and of all).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from osdp_fx import Devices  # noqa: E402
from osdp_fx.core.precision import MixedPrecision  # noqa: E402
from osdp_fx.core.setting import StepSetting  # noqa: E402
from osdp_fx.examples import HFCausalLMWithLoss, mpt_meta  # noqa: E402
from osdp_fx.passes.capture import capture  # noqa: E402
from osdp_fx.planner.make import SearchOptions, plan_model, predict  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

TOLERANCE = 0.20
"""The share of the published throughput a prediction should fall within (issue 57)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One published benchmark row (the table's columns of the same name)."""

    table: str
    model: str
    seq: int
    gpus: int
    micro_batch: int
    recompute: str
    """Every block's recompute policy: "none", "full" (llm-foundry's activation checkpointing)
    or "selective" (torchtitan's)."""
    pure_bf16: bool
    """``bf16`` ``PURE`` (gradients reduced in bf16) rather than ``amp_bf16``."""
    tokens_per_s_per_gpu: float
    num_params: int

    def devices(self) -> Devices:
        """The row's GPUs: its table's preset at the row's world size."""
        if self.table == "torchtitan":
            return torchtitan_gpus(self.gpus)
        preset = {"h100": "h100-sxm-8x", "a100-40gb": "a100-sxm-40gb-8x"}[self.table]
        return Devices.preset(preset, world_size=self.gpus)

    @property
    def published_step_s(self) -> float:
        return self.micro_batch * self.seq / self.tokens_per_s_per_gpu


def _rows() -> list[Row]:
    h100 = [  # model, seq, GPUs, micro batch, checkpointing, T/s/GPU, NumParams
        ("13b", 2048, 64, 2, False, 4800, 12853954560),
        ("13b", 2048, 32, 2, False, 4811, 12853954560),
        ("13b", 2048, 16, 2, False, 4767, 12853954560),
        ("13b", 2048, 8, 2, False, 4792, 12853954560),
        ("7b", 2048, 8, 6, False, 10643, 6658859008),
        ("1b", 2048, 64, 20, False, 44402, 1315950592),
        ("1b", 2048, 32, 20, False, 45130, 1315950592),
        ("1b", 2048, 16, 20, False, 46037, 1315950592),
        ("1b", 2048, 8, 14, False, 45455, 1315950592),
        ("760m", 2048, 32, 24, False, 67971, 760470528),
        ("760m", 2048, 16, 24, False, 68551, 760470528),
    ]
    a100 = [
        ("70b", 2048, 128, 4, True, 376, 64862437376),
        ("70b", 2048, 64, 2, True, 276, 64862437376),
        ("30b", 2048, 128, 6, True, 865, 29975214080),
        ("30b", 2048, 32, 4, True, 857, 29975214080),
        ("13b", 2048, 128, 16, True, 1972, 12853954560),
        ("13b", 2048, 64, 16, True, 1976, 12853954560),
        ("13b", 2048, 32, 14, True, 1998, 12853954560),
        ("13b", 2048, 16, 10, True, 1993, 12853954560),
        ("7b", 2048, 128, 18, True, 3623, 6658859008),
        ("7b", 2048, 64, 18, True, 3665, 6658859008),
        ("7b", 2048, 32, 18, True, 3725, 6658859008),
        ("7b", 2048, 16, 16, True, 3645, 6658859008),
        ("3b", 2048, 128, 6, False, 9538, 2651837440),
        ("3b", 2048, 64, 6, False, 9736, 2651837440),
        ("3b", 2048, 32, 6, False, 9914, 2651837440),
        ("3b", 2048, 16, 5, False, 9750, 2651837440),
        ("1b", 2048, 128, 10, False, 18647, 1315950592),
        ("1b", 2048, 64, 10, False, 19001, 1315950592),
        ("1b", 2048, 32, 10, False, 15555, 1315950592),
        ("1b", 2048, 16, 8, False, 19085, 1315950592),
        ("760m", 2048, 128, 12, False, 28940, 760470528),
        ("760m", 2048, 64, 12, False, 29344, 760470528),
        ("760m", 2048, 32, 12, False, 29648, 760470528),
        ("760m", 2048, 16, 12, False, 29607, 760470528),
        ("350m", 2048, 128, 18, False, 51934, 355985408),
        ("350m", 2048, 64, 18, False, 52689, 355985408),
        ("350m", 2048, 32, 18, False, 53811, 355985408),
        ("350m", 2048, 16, 18, False, 55413, 355985408),
        ("125m", 2048, 128, 26, False, 123936, 125311488),
        ("125m", 2048, 64, 26, False, 125234, 125311488),
        ("125m", 2048, 32, 26, False, 127122, 125311488),
        ("125m", 2048, 16, 26, False, 130535, 125311488),
    ]
    titan = [  # Llama 3.1 8B, "FSDP" (eager) rows of tables 1 and 3
        ("8b", 8192, 8, 2, "selective", 5762, 8030261248),
        ("8b", 8192, 128, 2, "selective", 5605, 8030261248),
    ]
    policy = {True: "full", False: "none"}
    return ([Row("h100", m, s, g, b, policy[c], False, t, n) for m, s, g, b, c, t, n in h100]
            + [Row("a100-40gb", m, s, g, b, policy[c], True, t, n)
               for m, s, g, b, c, t, n in a100]
            + [Row("torchtitan", m, s, g, b, c, False, t, n) for m, s, g, b, c, t, n in titan])


def torchtitan_gpus(world_size: int) -> Devices:
    """The GPUs of torchtitan's published runs: Grand Teton hosts of 8 H100s on NVLink with
    400 Gb/s of RDMA network per GPU (``h100-sxm-8x``'s links), 96 GB of HBM2e at 2.4 TB/s
    (the preset's memory bandwidth scaled to it) and a 500 W power limit. The published page
    puts their peak matmul rate between the SXM's and the NVL's without a figure; the SXM's is
    kept, so the compute of these rows is predicted at the upper of the two."""
    sxm = Devices.preset("h100-sxm-8x", world_size=world_size, memory_limit="96GB")
    return dataclasses.replace(
        sxm, memory_bandwidth_bytes_per_s=sxm.memory_bandwidth_bytes_per_s * 2.4e12 / 3.35e12)


FIT_ROWS = (("a100-40gb", "125m", 16), ("a100-40gb", "125m", 128), ("a100-40gb", "350m", 64),
            ("h100", "760m", 16), ("h100", "1b", 8))
"""(table, model, GPUs) of the rows ``presets.ATTENTION_EFFICIENCY`` is fitted on: the smallest
models of both tables, where attention is the largest share of the step."""


def is_fit_row(row: Row) -> bool:
    return (row.table, row.model, row.gpus) in FIT_ROWS


def plan_row(row: Row) -> tuple[Any, Any]:
    """The row's model profiled and planned ``full_shard`` (module docstring): the planned
    model and its plan, every block recomputed where the row checkpoints."""
    if row.table == "torchtitan":
        from llama_shapes import llama_shape

        llama, inputs = llama_shape(f"llama3_{row.model}", seq_len=row.seq, batch=row.micro_batch)
        model = HFCausalLMWithLoss(llama)
    else:
        model, inputs = mpt_meta(row.model, seq=row.seq, batch=row.micro_batch)
    assert sum(p.numel() for p in model.parameters()) == row.num_params, row
    precision = MixedPrecision(torch.bfloat16,
                               torch.bfloat16 if row.pure_bf16 else torch.float32)
    setting = StepSetting(row.devices(), optimizer="adamw", precision=precision)
    planned = plan_model(capture(model, inputs), inputs, "full_shard", setting,
                         SearchOptions(fake=True))
    plan = planned.plan
    if row.recompute != "none":
        regions = planned.analysis.facts.regions
        plan = dataclasses.replace(plan, recompute=tuple((r, row.recompute) for r in regions))
    return planned, plan


def step_at(planned: Any, plan: Any, attention_efficiency: float) -> float:
    """The planned row's predicted step with fused attention at ``attention_efficiency``."""
    setting = planned.setting
    devices = dataclasses.replace(setting.devices, attention_efficiency=attention_efficiency)
    return predict(planned.analysis, plan, dataclasses.replace(setting, devices=devices)
                   ).prediction.step_time_s


def fit_attention_efficiency(rows: list[Row]) -> float:
    """The attention efficiency that minimises the squared log error of ``rows``' predicted
    throughput (golden-section search over (0.05, 1]: the error is unimodal in it)."""
    planned = [(row, *plan_row(row)) for row in rows]

    def error(e: float) -> float:
        return sum(math.log(row.published_step_s / step_at(p, plan, e)) ** 2
                   for row, p, plan in planned)

    low, high = 0.05, 1.0
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        a, b = high - golden * (high - low), low + golden * (high - low)
        if error(a) < error(b):
            high = b
        else:
            low = a
    return (low + high) / 2


def predict_row(row: Row) -> dict[str, float]:
    """The row's predicted step under ``full_shard`` (module docstring)."""
    planned, plan = plan_row(row)
    if plan is not planned.plan:
        plan = predict(planned.analysis, plan, planned.setting)
    pr = plan.prediction
    return {"step_s": pr.step_time_s, "compute_s": pr.compute_s, "comm_s": pr.comm_s,
            "optim_s": pr.optim_s, "peak_bytes": pr.peak_memory_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=["h100", "a100-40gb", "torchtitan", "all"], default="all")
    parser.add_argument("--rows", type=int, default=None, help="only the first N rows")
    parser.add_argument("--fit", action="store_true",
                        help="fit presets.ATTENTION_EFFICIENCY on FIT_ROWS and print it")
    args = parser.parse_args()
    if args.fit:
        fitted = fit_attention_efficiency([r for r in _rows() if is_fit_row(r)])
        print(json.dumps({"attention_efficiency": round(fitted, 3), "rows": FIT_ROWS}))
        return
    rows = [r for r in _rows() if args.table in ("all", r.table)][:args.rows]
    print("| table | model | seq | GPUs | micro batch | recompute | published step ms | predicted "
          "step ms (compute / comm / optimizer) | predicted / published throughput | predicted "
          "peak GiB | row |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios, validation = [], []
    for row in rows:
        start = time.perf_counter()
        p = predict_row(row)
        ratio = row.published_step_s / p["step_s"]
        ratios.append(ratio)
        if not is_fit_row(row):
            validation.append(ratio)
        print(f"| {row.table} | {row.model} | {row.seq} | {row.gpus} | {row.micro_batch} | "
              f"{row.recompute} | {row.published_step_s * 1e3:.1f} | "
              f"{p['step_s'] * 1e3:.1f} ({p['compute_s'] * 1e3:.1f} / {p['comm_s'] * 1e3:.1f} / "
              f"{p['optim_s'] * 1e3:.1f}) | {ratio:.2f} | {p['peak_bytes'] / 2**30:.1f} | "
              f"{'fit' if is_fit_row(row) else 'validation'} |", flush=True)
        print(f"  planned in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    within = sum(abs(r - 1) <= TOLERANCE for r in ratios)
    print(json.dumps({"rows": len(rows), "within_20_percent": within,
                      "validation_rows": len(validation),
                      "validation_within_20_percent": sum(abs(r - 1) <= TOLERANCE
                                                          for r in validation),
                      "ratios": [round(r, 3) for r in ratios]}))


if __name__ == "__main__":
    main()

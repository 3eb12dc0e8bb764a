"""benchmarks/gpu_check.py: its comparison on the CPU; its CUDA parity where there is a GPU
(skipped cleanly without one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_check  # noqa: E402

from osdp_fx.runtime.launch import run_world  # noqa: E402


def _run(losses: list[float], weight: float) -> dict:
    return {"losses": losses, "state": {"w": torch.tensor([weight])}, "strategies": {}}


def test_compare_flags_loss_and_parameter_differences():
    ref = {"losses": [2.0, 1.0], "state": {"w": torch.tensor([0.5])}}
    same = [{plan: _run([2.0, 1.0], 0.5) for plan in gpu_check.PLANS}] * 2
    assert all(r["ok"] for r in gpu_check.compare(same, ref, gpu_check.FP32_TOL).values())
    off = [{**same[0], "full_shard": _run([2.0, 1.0 + 3e-5], 0.5),
            "searched": _run([2.0, 1.0], 0.5 + 3e-4)}] * 2
    rows = gpu_check.compare(off, ref, gpu_check.FP32_TOL)
    assert rows["replicate"]["ok"] and not rows["full_shard"]["ok"] and not rows["searched"]["ok"]
    assert rows["full_shard"]["loss_diff"] == pytest.approx(3e-5, rel=1e-2)
    failed = [{**same[0], "searched": {"error": "no plan fits"}}] * 2
    assert gpu_check.compare(failed, ref, gpu_check.FP32_TOL)["searched"] == {
        "ok": False, "error": "no plan fits"}


def _memory_row(predicted: int, measured: int, first: tuple[int, int] | None = None) -> dict:
    p1, m1 = first or (predicted, measured)
    return {"model": "gpt", "world": 1, "plan": "full_shard", "strategies": {"full_shard": 2},
            "predicted_first": p1, "measured_first": m1, "predicted_steady": predicted,
            "measured_steady": measured, "reserved_steady": measured, "compile_s": 1.0}


def test_memory_promise_is_minus_ten_to_plus_five_percent_from_the_first_step():
    inside = [_memory_row(95, 100), _memory_row(104, 100), _memory_row(90, 100)]
    above, below = _memory_row(106, 100), _memory_row(100, 100, first=(89, 100))
    assert gpu_check.memory_off(inside + [above, below, {"error": "x"}]) == [above, below]
    assert gpu_check.memory_off([_memory_row(100, 0)]) == []  # the CPU dry run measures 0


def test_report_keeps_the_parts_that_ran_beside_one_that_failed(tmp_path):
    report = gpu_check.Report(tmp_path, "test device")
    report.add("memory gpt world 1 (nccl)", [_memory_row(95, 100)], 1.0)
    report.add("memory lora world 1 (nccl)", {"error": "OSDPError: the world did not finish"},
               2.0)
    text = (tmp_path / "gpu-check.md").read_text()
    assert "memory lora world 1 (nccl): failed: OSDPError" in text
    assert "| gpt | 1 | full_shard | full_shard 2 |" in text and "-5.0%" in text
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert set(saved["parts"]) == {"memory gpt world 1 (nccl)", "memory lora world 1 (nccl)"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_cuda_training_matches_single_process(model):
    """World 1 over NCCL on the GPU: every plan equals single-process CUDA training."""
    args = (model, None, 3, 4, 32, 256, 0.05)
    ref = gpu_check.train_reference(*args)
    results = run_world(1, gpu_check.train_compiled, *args, backend="nccl", timeout_s=600.0)
    rows = gpu_check.compare(results, ref, gpu_check.FP32_TOL)
    assert all(r["ok"] for r in rows.values()), rows

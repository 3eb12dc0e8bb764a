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


def test_a_failed_parity_row_names_its_worst_element():
    ref = {"losses": [2.0], "state": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}}
    off = torch.zeros(2, 3)
    off[1, 2] = 1e-2
    runs = [{plan: {"losses": [2.0], "state": {"w": off, "b": torch.zeros(3)},
                    "strategies": {"replicate": 2}} for plan in gpu_check.PLANS}]
    row = gpu_check.compare(runs, ref, gpu_check.BF16_TOL)["replicate"]
    assert not row["ok"] and row["worst_param"] == "w" and row["worst_index"] == (1, 2)
    table = gpu_check.parity_table([{**row, "model": "phi3", "precision": "bf16", "world": 1,
                                     "backend": "nccl", "plan": "replicate"}])
    assert "1.0e-02 (w[1, 2])" in table


def _memory_row(predicted: int, measured: int, first: tuple[int, int] | None = None, *,
                reserved: int | None = None, limit: int | None = None,
                allocator: str = "default") -> dict:
    p1, m1 = first or (predicted, measured)
    reserved = measured if reserved is None else reserved
    return {"model": "gpt", "world": 1, "plan": "full_shard", "strategies": {"full_shard": 2},
            "predicted_first": p1, "measured_first": m1, "predicted_steady": predicted,
            "measured_steady": measured, "reserved_first": reserved, "reserved_steady": reserved,
            "limit": limit,
            "reserved_within_limit": None if limit is None else reserved <= limit,
            "allocator": allocator, "compile_s": 1.0}


def test_memory_promise_is_minus_ten_to_plus_five_percent_from_the_first_step():
    inside = [_memory_row(95, 100), _memory_row(104, 100), _memory_row(90, 100)]
    above, below = _memory_row(106, 100), _memory_row(100, 100, first=(89, 100))
    assert gpu_check.memory_off(inside + [above, below, {"error": "x"}]) == [above, below]
    assert gpu_check.memory_off([_memory_row(100, 0)]) == []  # the CPU dry run measures 0


def test_reserved_above_the_limit_is_reported_and_counted():
    mib = gpu_check.MiB
    over = _memory_row(100 * mib, 100 * mib, reserved=130 * mib, limit=120 * mib,
                       allocator="expandable_segments")
    under = _memory_row(100 * mib, 100 * mib, reserved=110 * mib, limit=120 * mib)
    no_limit = _memory_row(100 * mib, 100 * mib, reserved=130 * mib)
    rows = [over, under, no_limit, {"model": "gpt", "world": 1, "plan": "x", "error": "y"}]
    assert gpu_check.reserved_over_limit(rows) == [over]
    assert gpu_check.memory_off(rows) == []  # predicted against allocated: unchanged
    lines = gpu_check.memory_table(rows).splitlines()
    cells = [[c.strip() for c in line[1:-1].split("|")] for line in lines]
    header = cells[0]
    assert all(len(row) == len(header) for row in cells)
    column = {name: header.index(name) for name in (
        "reserved max (MiB)", "limit (MiB)", "reserved <= limit", "allocator")}
    over_cells, under_cells, no_limit_cells = cells[2], cells[3], cells[4]
    assert [over_cells[column[k]] for k in column] == ["130", "120", "NO", "expandable_segments"]
    assert [under_cells[column[k]] for k in column] == ["110", "120", "yes", "default"]
    assert [no_limit_cells[column[k]] for k in column] == ["130", "", "", "default"]


def test_reserved_above_the_limit_makes_main_fail(monkeypatch, tmp_path, capsys):
    over = _memory_row(100, 100, reserved=130, limit=120)
    report = gpu_check.Report(tmp_path, "test device")
    report.add("memory gpt world 1 (nccl)", [over], 1.0)
    monkeypatch.setattr(gpu_check, "run", lambda args: report)
    assert gpu_check.main(["--cpu", "--out-dir", str(tmp_path)]) == 1
    assert "reserved above the memory limit: 1" in capsys.readouterr().out
    report.data["parts"]["memory gpt world 1 (nccl)"]["value"] = [
        _memory_row(100, 100, reserved=110, limit=120)]
    assert gpu_check.main(["--cpu", "--out-dir", str(tmp_path)]) == 0


def test_binding_plan_is_searched_at_replicates_predicted_peak():
    assert gpu_check._plan_arg("binding", {"replicate": 1000, "full_shard": 600}) == {
        "plan": None, "memory_limit": 1000}
    with pytest.raises(gpu_check.OSDPError):
        gpu_check._plan_arg("binding", {})


def test_host_profile_splits_a_cpu_step_into_categories():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(32, 64)

    def step() -> None:
        layer(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    host = gpu_check.host_profile(step, steps=3)
    assert set(host) == set(gpu_check.HOST_CATEGORIES)
    assert all(v >= 0.0 for v in host.values()), host
    assert host["step wall"] > 0.0
    parts = sum(v for k, v in host.items() if k != "step wall")
    assert parts <= host["step wall"] * 1.1, host  # self times are exclusive
    assert host["compute"] > 0.0 and host["autograd"] > 0.0, host


def test_host_categories_by_event_name():
    category = gpu_check.host_category
    assert category("c10d::allreduce_") == category("nccl:all_gather") == "collectives"
    assert category("aten::_foreach_copy_") == category("aten::_to_copy") == "copies and casts"
    assert category("aten::view") == category("aten::t") == "views"
    assert category("aten::_foreach_add_") == category("Optimizer.step#SGD.step") == "optimizer"
    assert category("autograd::engine::evaluate_function: MmBackward0") == "autograd"
    assert category("torch::autograd::AccumulateGrad") == "autograd"
    assert category("aten::mm") == "compute"
    assert category("DistributedDataParallel.forward") == "other ops"


def test_host_table_has_a_column_per_category():
    host = dict.fromkeys(gpu_check.HOST_CATEGORIES, 0.001)
    rows = [{"system": "DDP (autocast bf16)", "plan": "-", "host_s": host},
            {"system": "osdp-fx (bf16)", "plan": "replicate", "host_s": {"error": "boom"}}]
    lines = gpu_check.host_table(rows).splitlines()
    assert lines[0].startswith("| system | plan | step wall | python and dispatch outside ops")
    assert lines[2] == "| DDP (autocast bf16) | - | " + " | ".join(["1.0"] * 9) + " |"
    assert "| osdp-fx (bf16) | replicate | boom |" in lines[3]


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

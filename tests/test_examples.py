"""The scripts in examples/ run as a user runs them: as subprocesses, on the CPU."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

import osdp_fx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
ENV = {**os.environ,
       "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(osdp_fx.__file__)),
                                      os.environ.get("PYTHONPATH", "")])}


def run(cmd: list[str], cwd, timeout: float = 240) -> str:
    """Run ``cmd`` in ``cwd`` (searched plans cached there, not in ~/.cache); its stdout and
    stderr, after asserting that it succeeded."""
    env = {**ENV, "OSDP_FX_PLAN_CACHE": os.path.join(cwd, "plan-cache")}
    proc = subprocess.run(cmd, check=False, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}"
    return proc.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, *args: str, cwd) -> str:
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                os.path.join(EXAMPLES, script), *args], cwd)


def losses(log: str) -> dict[int, str]:
    """step -> the loss printed for it (as printed: equal strings mean equal to 6 decimals)."""
    found = re.findall(r"^step (\d+) .*?loss (\S+)", log, re.MULTILINE)
    return {int(step): loss for step, loss in found}


@pytest.mark.slow
def test_train_gpt_resumes_where_it_stopped(tmp_path):
    # 48 sequences, 2 ranks, 8 per batch: 3 steps per epoch, so a run resumed at step 4 is in
    # the middle of epoch 1 and must skip that epoch's first batch. The uninterrupted run saves
    # step-4 and step-8; with step-8 gone (as if the job had died before it), a second run
    # resumes from the newest left, step-4 (its plan found in the plan cache).
    common = ["--num-sequences", "48", "--batch-size", "8", "--log-every", "1",
              "--ckpt-dir", str(tmp_path / "ckpt")]
    whole = torchrun("train_gpt.py", *common, "--steps", "8", "--ckpt-every", "4", cwd=tmp_path)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-4", "step-8"]
    shutil.rmtree(tmp_path / "ckpt" / "step-8")
    resumed = torchrun("train_gpt.py", *common, "--steps", "8", "--resume", cwd=tmp_path)

    assert "at step 4 (epoch 1)" in resumed, resumed[-3000:]
    expected = losses(whole)
    assert sorted(expected) == list(range(8))
    assert sorted(losses(resumed)) == [4, 5, 6, 7]
    # Bitwise equal under the same plan; 1e-5 leaves room for a search that chose another plan
    # (another order of the gradient sums).
    for step, loss in losses(resumed).items():
        assert math.isfinite(float(loss))
        assert float(loss) == pytest.approx(float(expected[step]), abs=1e-5), (step, loss)
    assert float(expected[7]) < float(expected[0])  # it learns


@pytest.mark.slow
def test_finetune_lora_trains_only_the_adapters(tmp_path):
    log = run([sys.executable, os.path.join(EXAMPLES, "finetune_lora.py"), "--steps", "4"],
              tmp_path)
    assert sorted(losses(log)) == [0, 1, 2, 3]
    assert all(math.isfinite(float(v)) for v in losses(log).values())
    changed = re.search(r"changed (\d+) of (\d+) tensors; all LoRA adapters: (\w+)", log)
    assert changed, log[-3000:]
    # q_proj and v_proj of 2 layers, lora_A and lora_B each: 8 tensors, nothing else
    assert (int(changed[1]), changed[3]) == (8, "True"), changed[0]


@pytest.mark.slow
def test_plan_cluster_saves_a_plan_for_64_gpus(tmp_path):
    run(["bash", os.path.join(EXAMPLES, "plan_cluster.sh"), str(tmp_path / "plan.json")],
        tmp_path)
    with open(tmp_path / "plan.json") as f:
        plan = json.load(f)
    assert plan["format"] == "osdp-fx-plan"
    assert (plan["world_size"], plan["ranks_per_node"]) == (64, 8)
    assert plan["mixed_precision"]["param_dtype"] == "bfloat16"
    sys.path.insert(0, EXAMPLES)
    try:
        from gpt_meta import gpt_300m
    finally:
        sys.path.remove(EXAMPLES)
    model, _ = gpt_300m()
    names = {n for n, _ in model.named_parameters()}  # tied head.weight: one name, tok.weight
    assert set(plan["params"]) == names


@pytest.mark.slow
def test_llama70b_lora_is_planned_for_a_node_of_h100s(tmp_path):
    """``examples/llama70b_lora.py`` through ``python -m osdp_fx plan`` as
    ``docs/finetuning.md`` runs it, with 2 of its 80 layers and 512 tokens: the bf16 base frozen
    (its groups marked so), the adapters trained, the searched plan fitting the H100's 80 GiB."""
    pytest.importorskip("peft")
    (tmp_path / "two_layers.py").write_text(
        f"import sys\nsys.path.insert(0, {EXAMPLES!r})\n"
        "from llama70b_lora import llama70b_lora\n\n\n"
        "def two_layers():\n    return llama70b_lora(layers=2, seq_len=512)\n")
    out = run([sys.executable, "-m", "osdp_fx", "plan", "two_layers.py:two_layers", "--devices",
               "h100-sxm-8x", "--mixed-precision", "bf16", "--save", "plan.json", "--quiet"],
              tmp_path)
    assert "Plan for world size 8" in out and "compute in bfloat16" in out, out[-3000:]
    rows = [line for line in out.splitlines() if "lora_" in line or "_proj.base_layer" in line]
    assert len(rows) == 2 * 4 * 3, out[-3000:]  # q, k, v, o of 2 layers: base, lora_A, lora_B
    for row in rows:
        assert ("(frozen)" in row) == ("base_layer" in row), row
    frozen = re.search(r"^parameters per rank: .* \(([\d.]+ \w+) of them frozen\)", out,
                       re.MULTILINE)
    assert frozen, out[-3000:]
    searched = re.search(r"^searched \(osdp-fx\) .* (\S+)$", out, re.MULTILINE)
    assert searched and searched.group(1) == "yes", out[-2000:]
    with open(tmp_path / "plan.json") as f:
        plan = json.load(f)
    assert (plan["world_size"], plan["mixed_precision"]["param_dtype"]) == (8, "bfloat16")


@pytest.mark.parametrize("factory, parameters", [
    ("llama3_1b", 1_235_814_400), ("llama3_8b", 8_030_261_248), ("llama3_70b", 70_553_706_496)])
def test_llama_shapes_have_the_published_parameter_counts(factory, parameters):
    """``examples/llama_shapes.py`` (what ``benchmarks/plan_scale.py`` plans) builds Llama-3.2-1B,
    Llama-3-8B and Llama-3-70B: their model cards' parameter counts, on the meta device."""
    pytest.importorskip("transformers")
    from osdp_fx.cli import load_factory

    model, (ids,) = load_factory(os.path.join(EXAMPLES, f"llama_shapes.py:{factory}"))
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert tuple(ids.shape) == (1, 2048)


def test_finetune_qlora_trains_a_4bit_base_and_saves_peft_adapters(tmp_path):
    """bitsandbytes nf4 through from_pretrained, peft LoRA, full_shard, in one process (world 2
    runs the same path: tests/distributed/test_qlora.py, test_frozen.py); the saved adapters,
    loaded with peft onto a fresh 4-bit base, give the compiled model's loss."""
    out = tmp_path / "adapters"
    log = run([sys.executable, os.path.join(EXAMPLES, "finetune_qlora.py"), "--steps", "3",
               "--out", str(out)], tmp_path)
    assert sorted(losses(log)) == [0, 1, 2]
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    found = re.search(r"eval loss compiled (\S+) reloaded with peft (\S+)", log)
    assert found, log[-3000:]
    assert float(found[1]) == pytest.approx(float(found[2]), rel=1e-3)

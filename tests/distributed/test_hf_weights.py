"""Hugging Face weights in (osdp_fx/training/hf_weights.py): a Llama built on the meta device,
compiled, and filled from a save_pretrained directory of several safetensors files trains like
the same model loaded by from_pretrained, each rank reading only its own rows."""

from __future__ import annotations

import json

import pytest
import torch
from harness import meta_cases as mc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf_llama")
    mc.save_hf_checkpoint(str(directory))
    return str(directory)


def split_plan(tmp_path) -> str:
    path = tmp_path / "split.json"
    path.write_text(json.dumps({
        "format": "osdp-fx-plan", "version": 1, "default": "full_shard",
        "splits": {"model.layers.0.mlp.up_proj.weight": 3},
        "params": {"model.layers.0.mlp.up_proj.weight_part1": "replicate",
                   "model.embed_tokens.weight": "shard_grad_op",
                   "model.norm.weight": "replicate"}}))
    return str(path)


@pytest.mark.parametrize("plan", ["full_shard", "split"])
def test_meta_model_filled_from_the_checkpoint_trains_like_from_pretrained(
        worlds, checkpoint, tmp_path, plan):
    split = plan == "split"
    if split:
        plan = split_plan(tmp_path)
    results = worlds(2).run(mc.hf_weights_from_checkpoint, directory=checkpoint, plan=plan)
    for r in results:
        assert r["files"] >= 3  # the checkpoint spans several files
        assert r["missing"] == [] and r["unexpected"] == []
        assert r["losses"] == r["ref_losses"]  # bitwise: same values, same plan
        assert list(r["final"]) == list(r["ref_final"])
        for key, value in r["ref_final"].items():
            torch.testing.assert_close(r["final"][key], value, rtol=0, atol=0, msg=key)
        # each rank reads its own rows: never more than its parameters and one file, and
        # under full_shard not half the model (a split weight is read whole, one at a time)
        assert r["peak"] <= r["param_bytes"] + r["largest_file"], r
        if not split:
            assert r["peak"] < r["model_bytes"] / 2, r


def test_a_lora_model_takes_its_base_from_the_checkpoint(worlds, checkpoint):
    """peft's names (base_model.model. ..., base_layer) are read as the checkpoint's; the
    adapters, not in it, are reported missing and keep their initialisation."""
    results = worlds(2).run(mc.hf_weights_from_checkpoint, directory=checkpoint,
                            plan="full_shard", lora=True)
    for r in results:
        assert r["unexpected"] == []
        assert r["missing"] and all(".lora_" in k for k in r["missing"])
        assert len(r["missing"]) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
        assert r["losses"] == r["ref_losses"]
        for key, value in r["ref_final"].items():
            torch.testing.assert_close(r["final"][key], value, rtol=0, atol=0, msg=key)

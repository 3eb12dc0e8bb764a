"""A model built on the meta device compiles, materialising only this rank's shards, with the
values it would have had on the CPU (or those of a user init function)."""

from __future__ import annotations

import json

import pytest
import torch
from harness import meta_cases as mc

MIB = 2**20


def plan_file(tmp_path, name: str, contents: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, **contents}))
    return str(path)


def check_same_as_cpu(results):
    for r in results:
        assert r["devices"] == {"cpu"}
        assert list(r["meta_state"]) == list(r["cpu_state"])
        for key, value in r["cpu_state"].items():
            torch.testing.assert_close(r["meta_state"][key], value, rtol=0, atol=0, msg=key)
        for key, value in r["cpu_buffers"].items():
            torch.testing.assert_close(r["meta_buffers"][key], value, rtol=0, atol=0, msg=key)
        assert r["meta_losses"] == r["cpu_losses"]  # bitwise: same values, same plan


@pytest.mark.parametrize("model,plan", [("mlp", "full_shard"), ("mlp", "mixed"),
                                        ("mlp", "split"), ("tied", "full_shard"),
                                        ("tied", "replicate")])
def test_meta_model_gets_the_values_it_has_on_the_cpu(worlds, tmp_path, model, plan):
    if plan == "mixed":
        plan = plan_file(tmp_path, "mixed", {"default": "full_shard", "params": {
            "layers.0.weight": "replicate", "layers.1.bias": "shard_grad_op"}})
    elif plan == "split":
        plan = plan_file(tmp_path, "split", {"splits": {"layers.1.weight": 3},
                                             "default": "full_shard",
                                             "params": {"layers.1.weight_part1": "replicate"}})
    results = worlds(2).run(mc.meta_equals_cpu, model=model, plan=plan)
    check_same_as_cpu(results)
    if model == "tied":
        assert "head.weight" not in results[0]["strategies"]  # one tied group
        assert results[0]["meta_buffers"]["norm.scale"][0] == 0.5  # reset_parameters set it


@pytest.mark.parametrize("plan", ["hybrid_shard", "hierarchical"])
def test_meta_model_on_a_two_node_mesh(worlds, plan):
    """World 4 as 2 nodes x 2 ranks: each rank materialises the chunk its layout holds."""
    from osdp_fx import Devices

    results = worlds(4).run(mc.meta_equals_cpu, model="tied", plan=plan,
                            devices=Devices(world_size=4, ranks_per_node=2))
    check_same_as_cpu(results)
    assert set(results[0]["strategies"].values()) == {plan}


def test_init_fn_initialises_the_meta_model(worlds):
    results = worlds(2).run(mc.meta_equals_cpu, model="mlp", plan="full_shard", init="normal")
    check_same_as_cpu(results)
    state = results[0]["meta_state"]
    assert torch.count_nonzero(state["layers.0.bias"]) == 0  # normal_init's zeros
    assert abs(state["layers.1.weight"].std().item() - 0.02) < 0.005


def test_materialisation_peak_is_one_layer_plus_the_shards(worlds):
    for r in worlds(2).run(mc.materialize_peak):
        # 8 layers of 4 MiB at 2 ranks: 16 MiB of shards stay; one layer is full at a time
        assert r["shards"] == r["full"] // 2
        assert r["after"] <= r["shards"] + MIB, r
        assert r["peak"] <= r["shards"] + r["layer"] + MIB // 4, {k: v / MIB for k, v in r.items()}
        print({k: round(v / MIB, 2) for k, v in r.items()})


def test_meta_errors_name_the_fix(worlds):
    results = worlds(2).run(mc.meta_errors)
    for r in results:
        assert "InputError" in r["no_reset"] and "<root> (Unresettable: gain)" in r["no_reset"]
        assert "init_fn=" in r["no_reset"]
        assert "cache" in r["unset_buffer"] and "init_fn=f" in r["unset_buffer"]
        assert "random states differ" in r["different_seeds"]
        assert "torch.manual_seed" in r["different_seeds"]
        assert "no meta tensors" in r["cpu_with_init_fn"]
        assert "InputError" in r["meta_rejects_inputs"]
        assert "rejected the example inputs (Tensor(2, 4):float32)" in r["meta_rejects_inputs"]
        assert "torch.export failed too" in r["meta_rejects_inputs"]
        assert r["with_init_fn"] == "compiled"
    assert results[0] == results[1]


@pytest.mark.parametrize("plan", ["full_shard", "replicate"])
def test_hugging_face_model_on_meta_trains_like_one_process(worlds, plan):
    """GPT-2 from transformers, built on the meta device: captured by export, initialised by
    its own _init_weights the same on every rank, then trained like a single process."""
    from harness.models import batches, build

    results = worlds(2).run(mc.hf_on_meta, plan=plan)
    initial = results[0]["initial"]
    for r in results:
        assert r["method"] == "export" and r["devices"] == {"cpu"}
        for key, value in initial.items():
            torch.testing.assert_close(r["initial"][key], value, rtol=0, atol=0, msg=key)
    assert all(torch.isfinite(v).all() for v in initial.values())
    assert initial["transformer.wte.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(initial["transformer.ln_f.weight"], torch.ones(32))
    assert torch.count_nonzero(initial["transformer.h.0.attn.c_attn.bias"]) == 0

    net, loss_fn = build("hf_gpt2")
    net.load_state_dict(initial)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for batch in batches("hf_gpt2", global_batch=4, steps=3):
        loss = loss_fn(net(batch[0]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(losses), atol=1e-5, rtol=0)
    for key, expected in net.state_dict().items():
        torch.testing.assert_close(results[0]["final"][key], expected, atol=1e-4, rtol=0, msg=key)

"""Frozen weights take every strategy (issue 39): a LoRA-style model whose frozen base is
sharded trains like one process, holds its share of the base, runs no gradient collective for a
frozen group and re-gathers a frozen weight in backward only where backward reads it. A base
packed in int8 is sharded and gathered packed."""

from __future__ import annotations

import pytest
import torch
from harness import cases, frozen_cases

from osdp_fx import Devices

PLANS = ("full_shard", "shard_grad_op", "frozen_sharded", "one_bucket", "searched")


INT8_PLANS = ("full_shard", "searched")


@pytest.fixture(scope="module")
def trained(worlds):
    return worlds(2).run(frozen_cases.train, timeout_s=600)


@pytest.fixture(scope="module")
def trained_int8(worlds):
    return worlds(2).run(frozen_cases.train, model="int8", timeout_s=600)


def _assert_trained_like_one_process(trained, plan):
    ref = trained[0]["reference"]
    cases.assert_trained_like([r[plan] for r in trained], ref["losses"], ref["state"],
                              label=plan)
    for r in trained:
        for key, expected in ref["frozen_state"].items():  # unchanged, bitwise
            assert torch.equal(r[plan]["frozen_state"][key], expected), (plan, key)


@pytest.mark.parametrize("plan", PLANS)
def test_a_sharded_frozen_base_trains_like_one_process(trained, plan):
    _assert_trained_like_one_process(trained, plan)


MESH_PLANS = ("hybrid_shard", "hierarchical", "searched")


@pytest.fixture(scope="module")
def trained_mesh(worlds):
    """The LoRA model on 4 ranks as 2 nodes x 2."""
    return worlds(4).run(frozen_cases.train, plans=MESH_PLANS,
                         devices=Devices(world_size=4, ranks_per_node=2), timeout_s=600)


@pytest.mark.parametrize("plan", MESH_PLANS)
def test_a_frozen_base_sharded_over_a_mesh_trains_like_one_process(trained_mesh, plan):
    _assert_trained_like_one_process(trained_mesh, plan)
    result = trained_mesh[0][plan]
    if plan != "searched":
        assert set(result["strategies"].values()) == {plan}
    else:
        assert all(peak <= result["limit"] for r in trained_mesh for peak in r[plan]["peaks"])
    for name in frozen_cases.FROZEN:  # a frozen group's collectives: gathers alone
        assert result["notes"][name] == "frozen"
        assert all(st.collective == "all_gather"
                   for st in result["backward_collectives"][name]), (plan, name)


@pytest.mark.parametrize("plan", INT8_PLANS)
def test_an_int8_base_trains_like_one_process(trained_int8, plan):
    _assert_trained_like_one_process(trained_int8, plan)


def test_an_int8_base_is_sharded_and_gathered_packed(trained_int8):
    ref = trained_int8[0]["reference"]
    world = len(trained_int8)
    for r in trained_int8:
        result = r["full_shard"]
        for name in frozen_cases.PACKED:
            assert result["strategies"][name] == "full_shard"
            assert result["notes"][name] == "frozen"
        # forward gathers the int8 weights as int8, once each; backward reads the dequantized
        # weight autograd saved, never the packed one
        assert result["forward"]["gathered torch.int8"] == sum(
            result["padded"][n] for n in frozen_cases.PACKED), result["forward"]
        assert "gathered torch.int8" not in result["backward"], result["backward"]
        # the adapters' gradients (gloo's reduce-scatter runs as an all-reduce)
        assert result["backward"].get("all_reduce", 0) >= 1, result["backward"]
        padding = sum(result["padded"].values()) * 4 // world  # at most
        assert result["local_bytes"] <= ref["model_bytes"] / world + ref["adapter_bytes"] + padding


def test_named_plans_shard_frozen_groups_and_say_so(trained):
    for plan in ("full_shard", "shard_grad_op"):
        result = trained[0][plan]
        assert set(result["strategies"].values()) == {plan}
        assert {n for n, note in result["notes"].items() if note == "frozen"} == \
            frozen_cases.FROZEN
        for name in frozen_cases.FROZEN:  # the plan's own collectives: no gradient ones
            assert all(st.collective == "all_gather"
                       for st in result["backward_collectives"][name]), (plan, name)


def test_full_shard_holds_a_share_of_the_base(trained):
    ref = trained[0]["reference"]
    world = len(trained)
    padding = sum(trained[0]["full_shard"]["padded"].values()) * 4 // world  # at most
    for r in trained:
        held = r["full_shard"]["local_bytes"]
        assert held <= ref["model_bytes"] / world + ref["adapter_bytes"] + padding, held
        assert held < 0.6 * ref["model_bytes"]


def test_frozen_groups_run_no_gradient_collective_and_regather_only_what_backward_reads(
        trained):
    for r in trained:
        result = r["frozen_sharded"]
        counts = result["backward"]
        assert counts.get("reduce_scatter", 0) == 0, counts  # only frozen groups are sharded
        assert counts.get("all_reduce", 0) >= 1, counts  # the adapters' gradients
        assert result["regathered"] == sorted(frozen_cases.REGATHERED)
        # backward gathered exactly the frozen weights it reads, nothing of emb or up.base
        assert counts["gathered_numel"] == sum(result["padded"][n]
                                               for n in frozen_cases.REGATHERED), counts


def test_frozen_and_trainable_parameters_share_a_bucket(trained):
    """As FSDP2 gathers a module's parameters, frozen or not: one all-gather of the whole model
    in forward, one reduce-scatter in backward that moves the adapters' gradients alone (on
    gloo an all-reduce of the flat gradient, [Note: gloo reduce-scatter])."""
    for r in trained:
        result = r["one_bucket"]
        forward, backward = result["forward"], result["backward"]
        assert forward["all_gather"] == 1, forward
        assert backward.get("reduce_scatter", 0) + backward.get("all_reduce", 0) == 1, backward
        moved = backward.get("scattered_numel", 0) + backward.get("reduced_numel", 0)
        assert moved == sum(result["padded"][n] for n in frozen_cases.ADAPTERS), backward


@pytest.mark.parametrize("model,plan", [*(("lora", p) for p in PLANS),
                                        *(("int8", p) for p in INT8_PLANS),
                                        *(("mesh", p) for p in MESH_PLANS)])
def test_the_memory_promise_holds_with_frozen_groups_sharded(request, model, plan):
    trained = request.getfixturevalue(
        {"lora": "trained", "int8": "trained_int8", "mesh": "trained_mesh"}[model])
    for r in trained:
        predicted = r[plan]["predicted"]
        for step, measured in enumerate(r[plan]["peaks"]):
            assert 0.90 * predicted <= measured <= 1.05 * predicted, (
                plan, step, measured, predicted, r[plan]["held_at_entry"][step])


@pytest.mark.parametrize("model", ["lora", "int8"])
def test_the_search_shards_frozen_groups_to_fit(request, model):
    trained = request.getfixturevalue("trained" if model == "lora" else "trained_int8")
    frozen = frozen_cases.FROZEN if model == "lora" else frozen_cases.PACKED
    for r in trained:
        searched = r["searched"]
        assert all(peak <= searched["limit"] for peak in searched["peaks"])
        assert any(searched["strategies"][n] != "replicate" for n in frozen)


def test_the_adapters_alone_save_and_load_under_another_plan(worlds, tmp_path):
    results = worlds(2).run(frozen_cases.adapters_reload, path=str(tmp_path / "adapters"))
    saved = results[0]["saved"]
    assert {k for k in saved if k.startswith("model.")} == {
        f"model.{n}" for n in ("up.a", "up.b", "down.a", "down.b")}  # no frozen weight
    assert any(k.startswith("optim.up.a.") for k in saved)  # the momentum too
    for r in results:
        assert r["extra"] == {"step": 2}
        # full_shard trained on from its own state, replicate from the checkpoint: the same step
        assert r["losses"][0] == pytest.approx(r["losses"][1], abs=1e-6)
        for key, value in r["states"][0].items():
            torch.testing.assert_close(r["states"][1][key], value, atol=1e-6, rtol=0, msg=key)


@pytest.mark.slow
def test_peft_adapters_alone_save_and_load_under_another_plan(worlds, tmp_path):
    """peft's get_peft_model on a Hugging Face Llama, trained under full_shard: the adapters
    alone are saved (with AdamW's state) and load into the model compiled under replicate,
    whose frozen base stays its own; both then train on alike."""
    results = worlds(2).run(frozen_cases.peft_adapters_reload, path=str(tmp_path / "adapters"),
                            timeout_s=600)
    for r in results:
        assert r["extra"] == {"step": 2}
        assert r["trainable"] and all("lora_" in n for n in r["trainable"])
        saved = [k for k in r["saved"] if k.startswith("model.")]
        assert sorted(k.removeprefix("model.") for k in saved) == r["trainable"]
        trained, loaded = r["loaded"]
        for key, value in trained.items():
            if "lora_" in key:  # the adapters: as trained, bitwise
                assert torch.equal(loaded[key], value), key
            else:  # the base: what the model was built with, in both
                assert torch.equal(loaded[key], r["initial"][key]), key
                assert torch.equal(value, r["initial"][key]), key
        # bf16 compute under two plans: equal up to the order of low-precision sums
        assert r["losses"][0] == pytest.approx(r["losses"][1], rel=2e-2)
        # under full_shard: 1/N of the model, plus the adapters, plus padding, at most
        assert r["held_bytes"] <= (r["model_bytes"] / len(results) + r["adapter_bytes"]
                                   + r["padding_bytes"]), r


def test_peft_adapters_exported_from_a_sharded_run_load_with_peft(worlds, tmp_path):
    """Adapters trained at world 2 under full_shard, written by save_peft_adapters, load with
    peft's PeftModel.from_pretrained in this process onto a fresh base and give the compiled
    model's logits; the export gathers the adapters alone."""
    from harness.models import batches, build
    from peft import PeftModel
    from safetensors.torch import load_file

    path = tmp_path / "adapters"
    results = worlds(2).run(frozen_cases.peft_adapters_export, path=str(path), timeout_s=600)
    r = results[0]
    assert r["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert r["adapters"] and all("lora_" in k for k in r["adapters"]), list(r["adapters"])
    assert len(r["adapters"]) < r["all_keys"]
    saved = load_file(path / "adapter_model.safetensors")
    assert len(saved) == len(r["adapters"]) and all(".default." not in k for k in saved)
    loaded = PeftModel.from_pretrained(build("hf_llama")[0], path).eval()
    state = loaded.state_dict()
    for key, value in r["adapters"].items():  # as trained, bitwise
        assert torch.equal(state[key], value), key
    with torch.no_grad():
        logits = loaded(batches("hf_llama", global_batch=4, steps=3)[2][0]).logits
    for rank_result in results:
        torch.testing.assert_close(rank_result["logits"], logits, atol=1e-5, rtol=0)

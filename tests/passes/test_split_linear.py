"""Unit tests of the split_linear pass (osdp_fx/passes/split_linear.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from osdp_fx import Devices, compile_osdp
from osdp_fx.core.node_meta import NodeRole, osdp_meta
from osdp_fx.core.precision import MixedPrecision
from osdp_fx.core.setting import StepSetting
from osdp_fx.errors import PlanError
from osdp_fx.examples import MLP, TinyGPT
from osdp_fx.passes import profile as profile_module
from osdp_fx.passes.capture import capture
from osdp_fx.passes.pipeline import run_pipeline
from osdp_fx.passes.precision import CastParams
from osdp_fx.passes.split_linear import apply_splits, linear_sites
from osdp_fx.planner.make import SearchOptions, plan_model


def count(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


class MatmulModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).relu()


def test_split_mlp_node_counts_and_outputs():
    torch.manual_seed(0)
    model, x = MLP((6, 10, 3)), torch.randn(4, 6)
    captured = capture(copy.deepcopy(model), (x,))
    before = count(captured.gm, "linear")
    specs = apply_splits(captured, {"layers.0.weight": 4})
    assert count(captured.gm, "linear") == before - 1 + 4
    assert count(captured.gm, "cat") == 1
    assert [s.sizes for s in specs] == [(3, 3, 2, 2), (3, 3, 2, 2)]  # weight and bias, uneven
    assert "layers.0.weight" not in dict(captured.gm.named_parameters())
    assert {f"layers.0.weight_part{i}" for i in range(4)} <= set(captured.params)
    # Not bitwise: the BLAS kernel chosen for a narrower GEMM may sum the dot products in
    # another order (3e-8 apart on this machine).
    torch.testing.assert_close(captured.gm(x), model(x), rtol=0, atol=1e-6)


def test_matmul_with_a_parameter_splits_along_its_columns():
    torch.manual_seed(0)
    model, x = MatmulModel(), torch.randn(3, 6)
    captured = capture(copy.deepcopy(model), (x,))
    assert list(linear_sites(captured.gm)) == ["w"]
    apply_splits(captured, {"w": 3})
    assert [tuple(captured.gm.get_parameter(f"w_part{i}").shape) for i in range(3)] == [(6, 4), (6, 3), (6, 3)]
    torch.testing.assert_close(captured.gm(x), model(x), rtol=0, atol=1e-6)


def test_hf_conv1d_addmm_splits():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=67,
                                       n_positions=16, use_cache=False, bos_token_id=0,
                                       eos_token_id=0)).eval()
    ids = torch.randint(0, 67, (2, 8))
    captured = capture(copy.deepcopy(model), (ids,))
    apply_splits(captured, {"transformer.h.0.mlp.c_fc.weight": 3})
    assert count(captured.gm, "addmm") == 4 - 1 + 3
    torch.testing.assert_close(captured.gm(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_name", ["mlp", "hf_gpt2"])
def test_splitting_a_cast_graph_makes_the_graph_of_casting_a_split_one(model_name):
    """The search splits the graph already cast to the compute dtype (planner/make.py): seen
    through their casts, its linears are the same sites, and splitting them gives the nodes,
    parameters and outputs that casting the split graph gives."""
    torch.manual_seed(0)
    if model_name == "mlp":
        model, inputs, split = MLP((6, 10, 3)), (torch.randn(4, 6),), "layers.0.weight"
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=67,
                                           n_positions=16, use_cache=False)).eval()
        inputs, split = (torch.randint(0, 67, (2, 8)),), "transformer.h.0.mlp.c_fc.weight"

    def cast(c):
        run_pipeline(c.gm, [CastParams(torch.bfloat16)])

    split_first, cast_first = capture(copy.deepcopy(model), inputs), capture(model, inputs)
    sites = list(linear_sites(cast_first.gm))
    cast(cast_first)
    assert list(linear_sites(cast_first.gm)) == sites and split in sites
    apply_splits(split_first, {split: 3})
    cast(split_first)
    apply_splits(cast_first, {split: 3})

    def nodes(gm):
        return [(n.op, str(n.target), osdp_meta(n).role, osdp_meta(n).param, len(n.users))
                for n in gm.graph.nodes]

    assert nodes(cast_first.gm) == nodes(split_first.gm)
    assert cast_first.params == split_first.params
    out = [c.gm(*inputs) for c in (cast_first, split_first)]
    if model_name == "hf_gpt2":
        out = [o.logits for o in out]
    assert out[0].dtype == torch.bfloat16
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_tied_weights_are_not_split():
    model, x = TinyGPT(vocab=20, dim=8, depth=1, heads=2, max_seq=8), torch.randint(0, 20, (2, 8))
    captured = capture(model, (x,))
    assert "tok.weight" not in linear_sites(captured.gm)
    with pytest.raises(PlanError, match="cannot split 'tok.weight'"):
        apply_splits(captured, {"tok.weight": 2})


def test_split_factor_larger_than_out_features_is_an_error():
    captured = capture(MLP((6, 10, 3)), (torch.randn(2, 6),))
    with pytest.raises(PlanError, match="into 4 parts: it has 3 output features"):
        apply_splits(captured, {"layers.1.weight": 4})


def test_checkpoints_keep_the_original_names(tmp_path):
    torch.manual_seed(0)
    model, x = MLP((6, 10, 3)), torch.randn(4, 6)
    plan = tmp_path / "p.json"
    plan.write_text('{"format": "osdp-fx-plan", "version": 1, "splits": {"layers.0.weight": 3},'
                    ' "default": "full_shard", "params": {}}')
    compiled = compile_osdp(copy.deepcopy(model), (x,), plan=str(plan))
    state = compiled.full_state_dict()
    assert list(state) == list(model.state_dict())
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    changed = {k: v + 1 for k, v in state.items()}
    compiled.load_full_state_dict(changed)
    for key, value in compiled.full_state_dict().items():
        torch.testing.assert_close(value, changed[key], rtol=0, atol=0)
    assert "layers_0_weight_part2" in compiled.code


def test_a_searched_plan_that_splits_a_biased_linear_loads_back(tmp_path):
    """The plan names the weight alone (its bias follows); a file that also names the bias, as
    plans saved before this was fixed do, loads the same."""
    torch.manual_seed(0)
    model, x = MLP((64, 1024, 1024, 64)), torch.randn(8, 64)  # every linear has a bias
    # (AdamW's step holds temporaries of the split weight's whole local shard, one parameter
    # since issue 58: the limit that makes the search split it is higher than the 12 MiB it was)
    devices = Devices(world_size=2, memory_bytes=16 * 2**20)
    searched = plan_model(capture(copy.deepcopy(model), (x,)), (x,), None, StepSetting(devices),
                          SearchOptions(fake=True)).plan
    assert dict(searched.splits) == {"layers.1.weight": 2}  # the search split it
    saved, old = tmp_path / "plan.json", tmp_path / "old.json"
    searched.save(saved)
    data = json.loads(saved.read_text())
    old.write_text(json.dumps({**data, "splits": {**data["splits"], "layers.1.bias": 4}}))
    for path in (saved, old):
        loaded = plan_model(capture(copy.deepcopy(model), (x,)), (x,), str(path),
                            StepSetting(devices), SearchOptions(fake=True)).plan
        assert loaded.hash() == searched.hash(), path.name


@pytest.mark.parametrize("limit_mib, splits, profiles", [
    (7, {"layers.1.weight": 4}, 2), (9, {"layers.1.weight": 2}, 2), (32, {}, 1)])
def test_a_mixed_precision_search_splits_the_graph_in_the_compute_dtype(
        monkeypatch, limit_mib, splits, profiles):
    """In bf16 the model is cast, then profiled and its splits searched on that profile (what
    a step holds in bf16); it is profiled again only after a split: into more parts under a
    tighter limit. With SGD: under AdamW the step's peak is its optimizer step, whose
    temporaries are the split weight's whole local shard (one parameter since issue 58), which
    no split reduces."""
    runs = []
    profile = profile_module.profile_graph_pass
    monkeypatch.setattr(profile_module, "profile_graph_pass",
                        lambda *a, **k: runs.append(1) or profile(*a, **k))
    torch.manual_seed(0)
    model, x = MLP((64, 1024, 1024, 64)), torch.randn(8, 64)
    devices = Devices(world_size=2, memory_bytes=limit_mib * 2**20)
    captured = capture(model, (x,))
    searched = plan_model(captured, (x,), None,
                          StepSetting(devices, optimizer="sgd", precision=MixedPrecision()),
                          SearchOptions(fake=True)).plan
    assert (dict(searched.splits), len(runs)) == (splits, profiles)
    assert searched.peak_memory_bytes <= devices.memory_bytes
    assert searched.param_dtype == "bfloat16"
    casts = [osdp_meta(n).param for n in captured.gm.graph.nodes
             if osdp_meta(n).role == NodeRole.CAST]
    assert sorted(casts) == sorted(captured.params)  # every part has its cast

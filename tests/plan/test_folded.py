"""The folded plan view (osdp_fx/plan/folded.py): repeated blocks become one line per distinct
pattern, blocks that differ are never folded together, lines stay under 120 columns, and the
full per-group table stays what str(plan) prints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from osdp_fx.core.devices import Devices
from osdp_fx.core.setting import StepSetting
from osdp_fx.examples import MLP, GPTWithLoss, TinyGPT
from osdp_fx.passes.capture import capture
from osdp_fx.plan.folded import common_prefix, fold, folded_table, format_indices
from osdp_fx.plan.request import build_plan
from osdp_fx.planner.make import SearchOptions, param_specs, plan_model


def names_of_block(i: int) -> list[str]:
    return [f"h.{i}.ln.weight", f"h.{i}.attn.weight", f"h.{i}.mlp.weight"]


def test_identical_blocks_fold_into_one_line():
    items = [("wte.weight", "emb")]
    for i in range(48):
        items += [(n, n.split(".", 2)[2]) for n in names_of_block(i)]
    items.append(("ln_f.weight", "ln"))
    lines = fold(items)
    assert [f.label for f in lines] == ["wte.weight", "h.0-47", "ln_f.weight"]
    block = lines[1]
    assert block.folded and block.indices == tuple(range(48))
    assert len(block.blocks) == 48 and all(len(b) == 3 for b in block.blocks)


def test_a_block_that_differs_is_not_folded_with_the_others():
    items = []
    for i in range(8):
        sig = "sharded" if i == 5 else "replicated"  # block 5's members were planned apart
        items += [(n, (n.split(".", 2)[2], sig)) for n in names_of_block(i)]
    lines = fold(items)
    assert [f.label for f in lines] == ["h.0-4,6-7", *names_of_block(5)]
    assert not any(f.folded for f in lines[1:])


def test_blocks_of_different_shapes_are_not_folded():
    # an MLP whose layers have different widths: every signature differs
    items = [(f"layers.{i}.{k}", (i, k)) for i in range(3) for k in ("weight", "bias")]
    lines = fold(items)
    assert [f.label for f in lines] == [n for n, _ in items]
    # a block with an extra member differs from the others as well
    items = [(n, n.split(".", 2)[2]) for i in range(4) for n in names_of_block(i)]
    items.insert(6, ("h.1.extra.weight", "extra"))
    labels = [f.label for f in fold(items)]
    assert labels[0] == "h.0,2-3" and "h.1.extra.weight" in labels


def test_folds_at_the_first_container_with_several_blocks():
    # encoder.0 is the only index of its container: the layers inside it are the blocks
    items = [(f"encoder.0.layers.{i}.w", "w") for i in range(6)]
    items += [(f"decoder.layers.{i}.w", "w") for i in range(2)]
    assert [f.label for f in fold(items)] == ["encoder.0.layers.0-5", "decoder.layers.0-1"]


def test_format_indices():
    assert format_indices([3, 0, 1, 2]) == "0-3"
    assert format_indices([0, 1, 2, 4, 6, 7]) == "0-2,4,6-7"
    assert format_indices(list(range(0, 40, 2))) == "0,2,4,6,8,...,38"  # 6 runs at most


def _gpt_plan(strategies, depth=6, world_size=8):
    with torch.device("meta"):
        model = GPTWithLoss(TinyGPT(vocab=256, dim=64, depth=depth, heads=4, max_seq=32))
    inputs = (torch.randint(0, 256, (2, 32), device="meta"),)
    captured = capture(model, inputs)
    specs = param_specs(captured)
    plan = build_plan({s.name: strategies(s.name) for s in specs}, specs, world_size=world_size)
    devices = Devices(world_size=world_size, memory_bytes=2**30)
    planned = plan_model(captured, inputs, plan, StepSetting(devices, optimizer="adamw"),
                         SearchOptions(fake=True)).plan
    return planned


def test_folded_view_of_a_planned_gpt():
    plan = _gpt_plan(lambda n: "full_shard" if n.endswith("fc.weight") and ".2." not in n
                     else "replicate")
    text = folded_table(plan)
    lines = text.splitlines()
    assert max(map(len, lines)) < 120, text
    assert "names under model." in text  # every name's common prefix, dropped from the rows
    rows = {line.split()[0]: line for line in lines
            if line.startswith(("blocks.", "tok.", "pos.", "ln_f."))}
    # blocks 0, 1, 3, 4, 5 share a pattern; block 2 (its fc replicated) is listed by member
    assert "blocks.0-1,3-5" in rows
    folded = rows["blocks.0-1,3-5"].split()
    assert folded[1] == "5" and "11 replicate, 1 full_shard" in rows["blocks.0-1,3-5"]
    assert "blocks.2.fc.weight" in rows and "blocks.2.ln1.weight" in rows
    assert "tok.weight*" in rows and "* tied: tok.weight = head.weight" in text
    assert "peak memory by category: " in text and "predicted per rank" in text
    # str(plan) is still the full table, one row per group
    full = str(plan)
    assert full == plan.table() and all(p.name in full for p in plan.params)
    assert len(full.splitlines()) > len(lines)


def test_times_do_not_stop_folding_but_are_averaged_per_block():
    plan = _gpt_plan(lambda n: "replicate", depth=3)
    params = tuple(dataclasses.replace(p, compute_s=(p.compute_s or 0) * (1 + i * 1e-3))
                   for i, p in enumerate(plan.params))  # measured times differ a little
    text = folded_table(dataclasses.replace(plan, params=params))
    row = next(line for line in text.splitlines() if line.startswith("blocks.0-2"))
    blocks = [p for p in params if p.name.startswith("model.blocks.")]
    assert float(row.split()[-2]) == pytest.approx(
        sum(p.compute_s for p in blocks) * 1e3 / 3, abs=1e-3)


def test_a_model_without_repeated_blocks_prints_every_parameter():
    captured = capture(MLP((32, 64, 64, 10)), (torch.randn(4, 32),))
    specs = param_specs(captured)
    plan = build_plan({s.name: "full_shard" for s in specs}, specs, world_size=4)
    text = folded_table(plan)
    for s in specs:
        assert any(line.startswith(s.name) for line in text.splitlines()), s.name
    assert "layers.0-" not in text and "comm" not in text.splitlines()[1]  # nothing predicted


class _LoraLinear(nn.Module):
    """peft's naming: ``base_layer``, ``lora_A.default``, ``lora_B.default``."""

    def __init__(self, dim: int, r: int = 2):
        super().__init__()
        self.base_layer = nn.Linear(dim, dim, bias=False)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(dim, r, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(r, dim, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class _PeftLike(nn.Module):
    """``base_model.model.model.layers.N.self_attn.q_proj...`` and ``base_model.model.lm_head``,
    as ``get_peft_model`` names a Llama's parameters."""

    def __init__(self, dim: int = 16, depth: int = 4):
        super().__init__()
        layers = nn.ModuleList()
        for _ in range(depth):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.q_proj = _LoraLinear(dim)
            layers.append(layer)
        causal_lm = nn.Module()
        causal_lm.model = nn.Module()
        causal_lm.model.layers = layers
        causal_lm.lm_head = nn.Linear(dim, dim, bias=False)
        self.base_model = nn.Module()
        self.base_model.model = causal_lm

    def forward(self, x):
        for layer in self.base_model.model.model.layers:
            x = layer.self_attn.q_proj(x)
        return self.base_model.model.lm_head(x)


def test_peft_names_drop_their_common_prefix_and_keep_their_tail():
    captured = capture(_PeftLike(), (torch.randn(2, 16),))
    specs = param_specs(captured)
    names = [s.name for s in specs]
    assert common_prefix(names) == "base_model.model."
    # layer 2's adapters planned apart: its members get a line each, under their long names
    plan = build_plan({n: "full_shard" if ".2." in n and "lora_" in n else "replicate"
                       for n in names}, specs, world_size=4)
    text = folded_table(plan)
    header, table = text.split("\nparameters ", 1)
    assert "names under base_model.model." in " ".join(map(str.strip, header.splitlines()))
    rows = table.splitlines()[2:]
    assert not any("base_model.model." in row for row in rows), text
    assert any(row.startswith("model.layers.0-1,3 ") for row in rows), text
    assert any(row.startswith("lm_head.weight ") for row in rows), text
    # a name longer than the column loses its start and keeps its tail, never its middle
    lora_a = "model.layers.2.self_attn.q_proj.lora_A.default.weight"
    assert any(row.startswith(lora_a + " ") for row in rows), text  # 120 columns: it fits
    narrow = folded_table(plan, width=80)
    assert max(map(len, narrow.splitlines())) < 80, narrow
    cut = [row.split()[0] for row in narrow.splitlines() if row.startswith("...")]
    assert cut and all(any(n.endswith(c[3:]) for n in names) for c in cut), narrow


def test_common_prefix_is_whole_components_and_never_a_last_one():
    assert common_prefix(["a.b.c.weight", "a.b.d.weight"]) == "a.b."
    assert common_prefix(["ab.weight", "ac.weight"]) == ""  # not a part of a component
    assert common_prefix(["a.weight"]) == "a."
    assert common_prefix(["weight", "a.weight"]) == ""
    assert common_prefix([]) == ""
    assert common_prefix(["layers.0.weight", "layers.1.weight"]) == ""  # no name starts '0.'
    assert common_prefix(["m.layers.0.w", "m.layers.1.w"]) == "m."

"""Repeated blocks ([Note: repeated blocks] in ``passes/repeated.py``): a block that repeats an
earlier one takes its profiles and elements without running, and they equal those of running
every block; blocks that differ in their parameters or in their inputs at run time are run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from osdp_fx.core.node_meta import osdp_meta
from osdp_fx.passes.capture import capture
from osdp_fx.passes.precision import cast_params_pass
from osdp_fx.passes.profile import NodeProfiler
from osdp_fx.passes.repeated import repeated_blocks
from osdp_fx.passes.sequence import sequence_numels


def _meta_llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return model, (torch.randint(0, 256, (2, 32), device="meta"),)


def _meta_gpt2(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, n_positions=64,
                        use_cache=False, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    return model, (torch.randint(0, 256, (2, 32), device="meta"),)


class _MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, width), nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class _Halving(nn.Module):
    """Blocks of the same code and parameters whose inputs shrink from block to block: the
    same signature, other shapes at run time."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MLP(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)[:, ::2]
        return x.sum()


class _Widening(nn.Module):
    """Blocks of the same code whose parameters differ in shape (the first also differs from
    the next two in its input, which does not require grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_MLP(w) for w in (16, 16, 16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.sum()


def _profiles(captured, inputs, share: bool) -> tuple[dict, int]:
    profiler = NodeProfiler(captured.gm, warmup=0, repeats=1, fake=True,
                            meta_device=torch.device("cpu"), share_repeats=share)
    profiler.profile(list(inputs))
    return {n.name: osdp_meta(n).profile for n in captured.gm.graph.nodes}, profiler.shared


@pytest.mark.parametrize("build", [_meta_llama, _meta_gpt2])
@pytest.mark.parametrize("cast", [False, True], ids=["fp32", "bf16"])
def test_repeats_take_the_profiles_and_elements_of_running_every_block(build, cast):
    model, inputs = build()
    captured = capture(model, inputs)
    if cast:
        cast_params_pass(captured.gm, torch.bfloat16)
    blocks = repeated_blocks(captured.gm).values()
    assert sorted(b.name.rsplit(".", 1)[1] for b in blocks) == ["0", "1", "2", "3"]
    assert len({b.kind for b in blocks}) == 1

    shared, taken = _profiles(captured, inputs, share=True)
    every, none_taken = _profiles(captured, inputs, share=False)
    assert none_taken == 0
    assert taken >= 3 * 40  # the three repeats' nodes, parameters aside
    assert shared == every
    assert sequence_numels(captured.gm, inputs, seq_len=32) == sequence_numels(
        captured.gm, inputs, seq_len=32, share_repeats=False)


def test_blocks_with_other_parameter_shapes_are_not_repeats():
    model = _Widening()
    inputs = (torch.randn(4, 8),)
    captured = capture(model, inputs)
    blocks = repeated_blocks(captured.gm).values()
    assert [b.name for b in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert len({b.kind for b in blocks}) == 1
    shared, taken = _profiles(captured, inputs, share=True)
    assert taken > 0
    assert shared == _profiles(captured, inputs, share=False)[0]


def test_a_repeat_whose_inputs_differ_at_run_time_is_run():
    model = _Halving()
    inputs = (torch.randn(4, 16, 8),)
    captured = capture(model, inputs)
    assert len(repeated_blocks(captured.gm)) == 3  # alike before the run
    shared, taken = _profiles(captured, inputs, share=True)
    assert taken == 0
    assert shared == _profiles(captured, inputs, share=False)[0]


class _KeywordLoss(nn.Module):
    """A Hugging Face model called with its keyword inputs given in order, returning its loss."""

    def __init__(self, net: nn.Module, keys: list[str]) -> None:
        super().__init__()
        self.net, self.keys = net, keys

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.net(**dict(zip(self.keys, args))).loss


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["t5", "mixtral", "bloom"])
def test_repeats_of_other_architectures_take_what_running_them_gives(arch):
    """An encoder-decoder (T5: its first layers compute the position bias), a mixture of
    experts (Mixtral), ALiBi attention (BLOOM), each with 3 layers: blocks are shared, and the
    profiles and elements equal those of running every block."""
    pytest.importorskip("transformers")
    from harness import zoo_cases

    batch = zoo_cases.batch(arch, 0, 0)
    inputs = tuple(batch.values())
    captured = capture(_KeywordLoss(zoo_cases.build(arch, layers=3), list(batch)), inputs)
    shared, taken = _profiles(captured, inputs, share=True)
    assert taken > 0
    assert shared == _profiles(captured, inputs, share=False)[0]
    seq = inputs[0].shape[1]
    assert sequence_numels(captured.gm, inputs, seq_len=seq) == sequence_numels(
        captured.gm, inputs, seq_len=seq, share_repeats=False)

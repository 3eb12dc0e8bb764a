"""load_hf_weights in one process: names paired under a wrapper's prefix and peft's base_layer,
tied weights read from the name the checkpoint holds, and the errors naming the fix. Across
ranks, from a save_pretrained directory: tests/distributed/test_hf_weights.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from osdp_fx import compile_osdp, load_hf_weights
from osdp_fx.errors import CheckpointError, InputError
from osdp_fx.training.hf_weights import _key, _prefix


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: the checkpoint holds embed.weight only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(self.embed(x)))


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def compiled_wrapper() -> nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return compile_osdp(Wrapper(), (torch.randint(0, 10, (2, 3)),), plan="replicate")


def write(directory, tensors: dict[str, torch.Tensor]) -> str:
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(directory / "model.safetensors"))
    return str(directory)


def test_names_pair_under_one_prefix_and_peft_base_layers():
    keys = {"embed.weight", "proj.weight", "proj.bias"}
    names = ["model.embed.weight", "model.proj.weight", "model.proj.bias", "model.extra"]
    assert _prefix(names, keys) == "model."
    assert _prefix(["embed.weight"], keys) == ""
    assert _key("base_model.model.proj.base_layer.weight", "base_model.model.") == "proj.weight"


def test_loads_the_values_in_their_dtype_and_reports_what_it_did_not_pair(tmp_path):
    compiled = compiled_wrapper()
    values = {"embed.weight": torch.randn(10, 4, dtype=torch.bfloat16),
              "proj.weight": torch.randn(4, 4), "proj.bias": torch.randn(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = load_hf_weights(write(tmp_path, values), compiled)
    assert result.missing_keys == [] and result.unexpected_keys == []
    state = compiled.state_dict()
    assert state["model.embed.weight"].dtype == torch.float32  # cast from the file's bf16
    torch.testing.assert_close(state["model.embed.weight"], values["embed.weight"].float(),
                               rtol=0, atol=0)
    torch.testing.assert_close(state["model.head.weight"], values["embed.weight"].float(),
                               rtol=0, atol=0)  # tied
    torch.testing.assert_close(state["model.proj.bias"], values["proj.bias"], rtol=0, atol=0)
    both = tmp_path / "both"  # a checkpoint holding the tied weight under each of its names
    both.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tied_twice = {**values, "head.weight": values["embed.weight"].clone()}
        result = load_hf_weights(write(both, tied_twice), compiled)
    assert result.unexpected_keys == [] and result.missing_keys == []


def test_errors_name_the_fix(tmp_path):
    compiled = compiled_wrapper()
    with pytest.raises(CheckpointError, match="no safetensors checkpoint.*save_pretrained"):
        load_hf_weights(tmp_path, compiled)
    partial = tmp_path / "partial"
    partial.mkdir()
    write(partial, {"embed.weight": torch.zeros(10, 4), "proj.weight": torch.zeros(4, 4),
                    "other.weight": torch.zeros(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=r"missing: \['model.proj.bias'\], "
                                                  r"unexpected: \['other.weight'\].*strict=False"):
            load_hf_weights(str(partial), compiled)
        result = load_hf_weights(str(partial), compiled, strict=False)
    assert result.missing_keys == ["model.proj.bias"]
    assert result.unexpected_keys == ["other.weight"]
    assert torch.count_nonzero(compiled.state_dict()["model.proj.weight"]) == 0
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    write(wrong, {"embed.weight": torch.zeros(12, 4), "proj.weight": torch.zeros(4, 4),
                  "proj.bias": torch.zeros(4)})
    with pytest.raises(CheckpointError, match=r"other shapes.*embed.weight: checkpoint "
                                              r"\(12, 4\), model \(10, 4\).*AutoConfig"):
        load_hf_weights(str(wrong), compiled)
    with pytest.raises(InputError, match="needs the module compile_osdp returned"):
        load_hf_weights(str(wrong), nn.Linear(2, 2))

"""Meta-device initialisation (osdp_fx/training/materialize.py) in one process: where a meta
model's tensors go, which models can be initialised and the errors naming the fix, the sentinel
an initialisation must overwrite, and a meta model compiled at world size 1 getting bitwise the
values it has when built on the CPU. Across ranks: tests/distributed/test_meta_init.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from osdp_fx import compile_osdp
from osdp_fx.errors import InputError
from osdp_fx.training.materialize import (
    _fill_sentinel,
    _is_sentinel,
    check_initializable,
    check_same_rng_state,
    materialize_device,
    model_device,
)


class Scaled(nn.Module):
    """A module with a parameter of its own and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.scale


def test_where_the_tensors_go():
    meta, cpu = torch.empty(2, device="meta"), torch.empty(2)
    assert materialize_device((meta, 3, cpu)).type == "cpu"
    if not torch.cuda.is_available():
        assert materialize_device((meta,)) == torch.device("cpu")
    with torch.device("meta"):
        on_meta = nn.Linear(2, 2)
    assert model_device(on_meta, (meta, cpu)) == torch.device("cpu")  # the first input off meta
    assert model_device(nn.Linear(2, 2), ()) == torch.device("cpu")


def test_which_models_can_be_initialised():
    with torch.device("meta"):
        linear, scaled = nn.Sequential(nn.Linear(2, 3)), nn.Sequential(nn.Linear(3, 3), Scaled())
    check_initializable(linear, None, on_meta=True)  # Linear has reset_parameters()
    check_initializable(scaled, lambda m: None, on_meta=True)
    check_initializable(nn.Linear(2, 2), None, on_meta=False)
    with pytest.raises(InputError, match=r"1 of its modules have no reset_parameters\(\) to "
                                         r"initialise their tensors: 1 \(Scaled: scale\).*"
                                         "init_fn=model._init_weights"):
        check_initializable(scaled, None, on_meta=True)
    with pytest.raises(InputError, match="this model has no meta tensors.*drop init_fn"):
        check_initializable(nn.Linear(2, 2), lambda m: None, on_meta=False)
    with pytest.raises(InputError, match="init_fn must be a function of one module, got int"):
        check_initializable(linear, 3, on_meta=True)
    check_same_rng_state(torch.device("cpu"))  # one rank: nothing to compare, no collective


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int8])
def test_the_sentinel_is_seen_only_where_nothing_overwrote_it(dtype):
    t = torch.empty(4, dtype=dtype)
    _fill_sentinel(t)
    assert _is_sentinel(t)
    t[1] = 0
    assert not _is_sentinel(t)  # partly written: the initialisation ran
    assert not _is_sentinel(torch.empty(0, dtype=dtype))
    flags = torch.zeros(3, dtype=torch.bool)
    _fill_sentinel(flags)
    assert not _is_sentinel(flags) and not flags.any()  # a bool cannot be checked


@pytest.mark.parametrize("plan", ["replicate", "full_shard"])
def test_a_meta_model_gets_the_values_it_has_on_the_cpu(plan):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.LayerNorm(7), nn.Linear(7, 3))

    x, cpu = torch.randn(4, 5), build()
    with torch.device("meta"):
        meta = build()  # draws nothing: the values are drawn by materialisation, from the seed
    compiled = compile_osdp(meta, (x,), plan=plan)
    state = compiled.full_state_dict()
    assert set(state) == set(cpu.state_dict())
    for name, value in cpu.state_dict().items():
        assert state[name].device.type == "cpu"
        assert torch.equal(state[name], value), name
    torch.testing.assert_close(compiled(x), cpu(x), rtol=0, atol=0)


def test_an_initialisation_that_leaves_a_tensor_unset_is_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), Scaled())

    def init(module):
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    with pytest.raises(InputError, match=r"init_fn did not initialise 1.scale \(still empty"):
        compile_osdp(model, (torch.randn(2, 2),), plan="replicate", init_fn=init)

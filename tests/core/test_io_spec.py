"""What a compiled model is called with (osdp_fx/core/io_spec.py): keyword inputs bound to the
forward's names ([Note: keyword inputs]), the calls a spec accepts and the errors of the others,
the (batch, sequence) of a call, and the shape guard that refuses a call predicted over the
memory limit ([Note: input shapes])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from osdp_fx.core.io_spec import (
    CallCheck,
    InputSpec,
    ShapeGuard,
    bind_example,
    check_max_shape,
    input_shape,
)
from osdp_fx.errors import InputError


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask=None, scale=1.0, return_dict=True, **extra):
        out = self.proj(input_ids) * scale
        if attention_mask is not None:
            out = out * attention_mask[..., None]
        for value in extra.values():
            out = out + value
        return {"out": out} if return_dict else out


def test_positional_only_spec_passes_the_call_through():
    model, x = Tagger(), torch.randn(2, 4)
    spec, target, inputs = bind_example(model, (x,), None)
    assert target is model and inputs == (x,)
    assert spec == InputSpec(None, num_positional=1)
    assert spec.flatten((x,), {}) == (x,)
    with pytest.raises(InputError, match="compiled from positional inputs only.*got "
                                         "attention_mask.*pass example_kwargs"):
        spec.flatten((x,), {"attention_mask": x})
    with pytest.raises(InputError, match="compiled with 1 positional inputs and called with 2"):
        spec.flatten((x, x), {})


def test_keyword_example_binds_tensors_in_signature_order_and_fixes_the_rest():
    model = Tagger()
    x, mask, bias = torch.randn(2, 4), torch.tensor([1.0, 0.0]), torch.ones(3)
    spec, target, inputs = bind_example(
        model, (), {"return_dict": False, "attention_mask": mask, "input_ids": x, "bias": bias})
    # tensors in the signature's order (a **kwargs entry last), the rest constants
    assert spec.names == ("input_ids", "attention_mask", "bias")
    assert spec.constants == (("return_dict", False),)
    assert inputs[0] is x and inputs[1] is mask and inputs[2] is bias
    # the module to capture takes them positionally and shares the model's parameters
    assert type(target).__name__ == "Tagger"
    assert dict(target.named_parameters()) == dict(model.named_parameters())
    torch.testing.assert_close(target(*inputs), model(x, mask, return_dict=False, bias=bias))
    # a call is bound the same way, by name or by position
    assert spec.flatten((x,), {"attention_mask": mask, "bias": bias, "return_dict": False}) == (
        x, mask, bias)
    assert spec.flatten((x, mask), {"bias": bias, "return_dict": False})[1] is mask


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    ((), {"input_ids": 1, "bias": 2, "return_dict": False}, r"missing attention_mask: pass them "
                                                            "as in the example"),
    ((), {"input_ids": 1, "attention_mask": 2, "bias": 3, "return_dict": False, "scale": 2.0},
     "got scale, absent from the example.*compile with them in example_kwargs"),
    ((), {"input_ids": 1, "attention_mask": 2, "bias": 3, "return_dict": True},
     "return_dict=True, but the model was compiled with return_dict=False"),
    ((1, 2, 3, 4, 5, 6), {}, "the model's forward does not accept these arguments"),
])
def test_a_call_unlike_the_example_is_refused(args, kwargs, message):
    x = torch.randn(2, 4)
    spec, _, _ = bind_example(Tagger(), (x,), {"attention_mask": x[:, 0], "bias": x[0, :3],
                                               "return_dict": False})
    with pytest.raises(InputError, match=message):
        spec.flatten(args, kwargs)


def test_keyword_names_must_be_python_names():
    with pytest.raises(InputError, match=r"keyword inputs \['class'\] are not Python names"):
        bind_example(Tagger(), (torch.randn(2, 4),), {"class": torch.ones(3)})
    with pytest.raises(InputError, match="example_kwargs must be a dict.*got list"):
        bind_example(Tagger(), (torch.randn(2, 4),), [("bias", 1)])


def test_input_shape_is_batch_and_the_first_sequence():
    ids = torch.zeros(3, 7, dtype=torch.long)
    assert input_shape((ids,)) == (3, 7)
    assert input_shape((torch.zeros(5), ids)) == (5, 7)  # batch of the first, seq of the 2-D
    assert input_shape((torch.zeros(4),)) == (4, None)
    assert input_shape((2.0, torch.tensor(1.0))) == (1, None)  # no tensor with a dimension


def _guard(limit: int) -> ShapeGuard:
    return ShapeGuard(max_batch=4, max_seq=16, limit_bytes=limit,
                      peak_bytes_at=lambda batch, seq: batch * (seq or 1) * 1024)


def test_the_guard_refuses_a_larger_shape_predicted_over_the_limit():
    guard = _guard(limit=4 * 16 * 1024)
    guard.check((torch.zeros(4, 16),))  # the planned shape: no prediction needed
    guard.check((torch.zeros(2, 32),))  # larger sequence, smaller batch: fits
    with pytest.raises(InputError, match=r"batch 8 x sequence 16 per rank is predicted to need "
                                         r"128.0 KiB.*limit of 64.0 KiB.*at most batch 4 x "
                                         r"sequence 16\); nothing ran.*max_shape="):
        guard.check((torch.zeros(8, 16),))
    called = []
    lazy = ShapeGuard(4, 16, 0, lambda b, s: called.append((b, s)) or 0)
    lazy.check((torch.zeros(3, 8),))
    assert called == []  # at or under the planned shape the prediction is not asked


def test_check_max_shape():
    assert check_max_shape(None) is None
    assert check_max_shape((8, 512)) == (8, 512)
    assert check_max_shape([8]) == (8, None) == check_max_shape(8)
    for bad in ((0, 4), (2, 3, 4), (True, 4), (2.0, 4), "8"):
        with pytest.raises(InputError, match="is not a shape: pass \\(batch, sequence length\\)"):
            check_max_shape(bad)


def test_a_call_check_flattens_then_guards():
    spec = InputSpec(None, num_positional=1)
    x = torch.zeros(8, 16)
    assert CallCheck(spec, None)((x,), {}) == (x,)
    with pytest.raises(InputError, match="predicted to need"):
        CallCheck(spec, _guard(limit=1024))((x,), {})

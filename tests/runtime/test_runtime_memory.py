"""LiveTensorTracker and the step peak (osdp_fx/runtime/memory.py): new storages counted when an
operator makes them and uncounted when they are freed, views and in-place results not counted,
storages resized in place accounted when told, fake tensors never counted."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from osdp_fx.runtime.memory import LiveTensorTracker, measure_step_peak_bytes, note_resized


def test_new_storages_are_counted_until_freed_views_and_in_place_are_not():
    x = torch.ones(100)  # made before: not counted
    with LiveTensorTracker() as tracker:
        y = x * 2  # 400 bytes
        assert tracker.live_bytes == 400
        view = y[10:]  # a view and an in-place result: nothing new
        y.add_(1)
        z = torch.cat([x, x])  # 800 bytes
        assert tracker.live_bytes == tracker.peak_bytes == 1200
        del y, view
        assert tracker.live_bytes == 800  # y's storage freed with its last view
        tracker.reset_peak()
        assert tracker.peak_bytes == 800
        del z
        w = x + 1
        assert tracker.live_bytes == 400 and tracker.peak_bytes == 800
        del w
    assert tracker.live_bytes == 0 and tracker.settle() == 0


def test_a_storage_resized_in_place_is_accounted_when_told():
    x = torch.zeros(256)
    with LiveTensorTracker() as tracker:
        y = x + 1  # 1 KiB
        storage = y.untyped_storage()
        storage.resize_(0)  # the dispatcher does not see this
        assert tracker.live_bytes == 1024
        note_resized(storage)
        assert tracker.live_bytes == 0 and tracker.peak_bytes == 1024
    note_resized(storage)  # no tracker active: nothing to tell, nothing fails
    assert tracker.live_bytes == 0


def test_fake_tensors_are_not_counted():
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(1000))
    with LiveTensorTracker() as tracker, mode:
        out = fake * 2
        assert out.shape == (1000,)
    assert tracker.peak_bytes == 0


def test_step_peak_is_what_exists_plus_the_steps_own_peak():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64, bias=False)  # 16 KiB of weight
    x = torch.randn(8, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # 16 KiB of momentum

    def step():
        model(x).square().sum().backward()
        opt.step()

    peak = measure_step_peak_bytes(step, list(model.parameters()), opt,
                                   zero_grad=lambda: opt.zero_grad(set_to_none=True))
    existing = 2 * 64 * 64 * 4  # weight and momentum buffer
    # the step adds at least its gradient (16 KiB) and its activations, and not much else
    assert existing + 64 * 64 * 4 < peak < existing + 64 * 64 * 4 + 16 * 1024
    assert model.weight.grad is None  # zero_grad ran after the measured step

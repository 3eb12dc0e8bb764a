"""Gradient accumulation without synchronisation (osdp_fx/runtime/accumulation.py, [Note:
no_sync]), in one process: the held buffers of sharded gradients, the local queue a no_sync
forward's gathers send to, and what GradSync asks of the reducer and the reduce-scatter queue
around each forward and backward. The collectives themselves: tests/distributed/test_no_sync.py."""

from __future__ import annotations

import pytest
import torch

from osdp_fx.runtime.accumulation import GradSync, HeldGrads, LocalScatters


class Recorder:
    """A reducer and a reduce-scatter queue in one: records what GradSync asks of them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.started: list[tuple[list[torch.Tensor], torch.Tensor, str]] = []
        self.unsynced = False

    def new_step(self) -> None:
        self.calls.append("new_step")

    def reset(self) -> None:
        self.calls.append("reset")

    def pause(self) -> None:
        self.calls.append("pause")

    def flush(self) -> None:
        self.calls.append("flush")

    def start_flat(self, shards, flat, group, *, owned=True) -> None:
        self.started.append((shards, flat, group))


def test_held_buffers_are_taken_once_and_listed_in_first_held_order():
    held, a, b = HeldGrads(), torch.zeros(2), torch.zeros(3)
    assert not held and held.take([a]) is None
    fresh = held.buffer([a], 4, torch.float32, torch.device("cpu"))
    assert fresh.tolist() == [0.0] * 4
    held.hold([a], fresh + 1, "world")
    held.hold([a, b], torch.ones(6), "hybrid_shard/2x2")
    assert held
    again = held.buffer([a], 4, torch.float32, torch.device("cpu"))  # the held one, taken
    assert again.tolist() == [1.0] * 4 and held.take([a]) is None
    held.hold([a], again, "world")  # held again after taken: now after the bucket
    out = held.take_all()
    assert [(len(s), f.numel(), g) for s, f, g in out] == [(2, 6, "hybrid_shard/2x2"),
                                                           (1, 4, "world")]
    assert not held
    held.hold([b], torch.ones(3), "world")
    with pytest.raises(AssertionError, match="taken before it is held again"):
        held.hold([b], torch.ones(3), "world")
    held.clear()
    assert not held


def test_local_scatters_add_micro_batches_into_one_padded_buffer():
    held = HeldGrads()
    local, shard = LocalScatters(held), torch.zeros(2)
    local.start(shard, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "world", padded_numel=6)
    local.start(shard, torch.tensor([[10.0, 20.0], [30.0, 40.0]]), "world", padded_numel=6)
    (shards, flat, group), = held.take_all()
    assert shards[0] is shard and group == "world"
    assert flat.tolist() == [11.0, 22.0, 33.0, 44.0, 0.0, 0.0]  # the padding stays zero
    # in the reduce dtype when mixed precision asks for one
    local.start(shard, torch.ones(4, dtype=torch.bfloat16), "world", 4, torch.float32)
    assert held.take([shard]).dtype == torch.float32


def test_a_no_sync_forward_sends_gradients_to_the_held_buffers_and_keeps_the_step_state():
    rec = Recorder()
    sync = GradSync(rec, rec, HeldGrads())
    assert sync.begin_forward() == (True, rec)
    assert rec.calls == ["new_step", "reset"]  # a synchronised forward starts afresh
    with sync.no_sync():
        with sync.no_sync():
            pass
        assert not sync.enabled  # nested: still off until the outer one ends
        synced, where = sync.begin_forward()
        assert not synced and where is sync.local and where.held is sync.held
    assert sync.enabled
    assert rec.calls == ["new_step", "reset"]  # the no_sync forward reset nothing


def test_a_no_sync_backward_pauses_the_reducer():
    rec = Recorder()
    sync = GradSync(rec, rec, HeldGrads())
    w = torch.ones(3, requires_grad=True)
    out = sync.end_forward({"loss": (w * 2).sum(), "n": 3}, sync=False)
    assert rec.calls == []
    out["loss"].backward()
    assert rec.calls == ["pause"]
    # a synchronised forward with nothing held or unsynced is not hooked
    plain = (w * 2).sum()
    assert sync.end_forward(plain, sync=True) is plain and not plain._backward_hooks
    plain.backward()
    assert rec.calls == ["pause"]


def test_a_synchronised_backward_reduces_what_earlier_local_backwards_held():
    rec = Recorder()
    sync = GradSync(rec, rec, HeldGrads())
    shard = torch.zeros(2)
    sync.local.start(shard, torch.ones(2), "world", padded_numel=2)
    w = torch.ones(3, requires_grad=True)
    loss = sync.end_forward((w * 2).sum(), sync=True)
    loss.backward()
    assert rec.calls == ["flush"]  # at the end of backward
    (shards, flat, group), = rec.started
    assert shards == [shard] and flat.tolist() == [1.0, 1.0] and group == "world"
    assert not sync.held


def test_drop_forgets_what_was_accumulated():
    rec = Recorder()
    sync = GradSync(rec, rec, HeldGrads())
    sync.local.start(torch.zeros(2), torch.ones(2), "world", padded_numel=2)
    rec.unsynced = True
    sync.drop()
    assert not sync.held and rec.unsynced is False

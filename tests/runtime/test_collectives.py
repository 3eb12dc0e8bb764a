"""The collectives (osdp_fx/runtime/collectives.py) where no process group runs, as at world
size 1: each is the identity on this rank's data and never calls torch.distributed; groups are
named; padding, storage references and the release of a handed-over buffer. The collectives
across ranks: tests/distributed/test_reducer.py and test_hierarchy.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from osdp_fx.runtime import collectives as c
from osdp_fx.runtime.memory import LiveTensorTracker


@pytest.fixture
def no_process_group(monkeypatch):
    """torch.distributed uninitialised, and any collective of it an error."""
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")

    def refused(*args, **kwargs):
        raise AssertionError("a collective ran at world size 1")

    for name in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, refused)
    monkeypatch.setattr(c, "_all_gather_flat_impl", refused)
    monkeypatch.setattr(c, "_reduce_scatter_flat_impl", refused)


def test_without_a_process_group_the_world_is_one_rank(no_process_group):
    assert c.group_size(c.WORLD) == 1 and c.group_rank(c.WORLD) == 0
    assert c.group_size("hybrid_shard/2x4") == 1  # any name: no group is looked up
    assert not c.scatter_copies_input()


def test_groups_are_reached_by_name():
    marker, registered = object(), dict(c._named_groups)
    assert c.resolve_group(c.WORLD) is None  # the default group
    c.register_group("test/1x1", marker)
    try:
        assert c.resolve_group("test/1x1") is marker
        c.forget_named_groups()
        with pytest.raises(KeyError):
            c.resolve_group("test/1x1")
    finally:
        c._named_groups.update(registered)  # what this process had registered before


def test_gathers_and_reductions_of_one_rank_copy_or_keep_the_data(no_process_group):
    shard = torch.arange(6.0).reshape(2, 3)
    gathered = c.all_gather_flat(shard, c.WORLD)
    assert gathered.shape == (6,) and gathered.tolist() == list(range(6))
    assert gathered.untyped_storage().data_ptr() != shard.untyped_storage().data_ptr()
    pending = c.all_gather_flat_start(shard, c.WORLD, consume=True)
    assert pending.wait() is pending.wait() and shard.untyped_storage().nbytes() == 24

    full = torch.arange(4.0)
    chunk = c.reduce_scatter_flat(full, c.WORLD)
    assert chunk.tolist() == [0.0, 1.0, 2.0, 3.0] and chunk.data_ptr() != full.data_ptr()
    assert c.all_reduce_sum_start(full, c.WORLD) is None
    assert c.all_reduce_sum_(full, c.WORLD) is full and full.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert c.broadcast_(full, c.WORLD, src_rank=0) is full and full.tolist() == [0.0, 1.0, 2.0,
                                                                                 3.0]


def test_pad_flat():
    t = torch.arange(6.0).reshape(2, 3)
    same = c.pad_flat(t, 6)
    assert same.shape == (6,) and same.data_ptr() == t.data_ptr()  # a view, no copy
    padded = c.pad_flat(t, 8)
    assert padded.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0]
    assert padded.dtype == t.dtype


def test_references_count_the_tensors_of_a_storage():
    t = torch.zeros(4)
    before = c.references(t)
    if before is None:
        pytest.skip("this torch does not count storage references")
    view = t[1:]
    assert c.references(t) == before + 1
    del view
    assert c.references(t) == before


class _Work:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> None:
        self.waited += 1


def test_a_pending_collective_waits_once_and_frees_a_handed_over_input():
    out, kept, work = torch.ones(4), torch.ones(8), _Work()
    with LiveTensorTracker() as tracker:
        handed = kept * 2  # a buffer of the tracker's sight
        pending = c.Pending(out, work, handed, release=True)
        live = tracker.live_bytes
        assert pending.wait() is out and pending.wait() is out
        assert work.waited == 1
        assert handed.untyped_storage().nbytes() == 0  # released, though still referenced
        assert tracker.live_bytes == live - 32  # and the tracker was told
    kept_work = _Work()
    assert c.Pending(out, kept_work, kept).wait() is out and kept.untyped_storage().nbytes() == 32


def test_a_view_of_part_of_a_storage_is_not_freed():
    base = torch.ones(8)
    c._free(base[:4])
    assert base.untyped_storage().nbytes() == 32
    c._free(base)
    assert base.untyped_storage().nbytes() == 0

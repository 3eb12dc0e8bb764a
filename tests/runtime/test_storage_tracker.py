"""The storage tracker (osdp_fx/runtime/storage_tracker.py), the instrument every memory promise
is judged by: storages counted at their current size, what a reference cycle keeps counted as
held, and the tracker itself no reference cycle."""

from __future__ import annotations

import gc
import weakref

import torch

from osdp_fx.runtime.storage_tracker import StorageTracker


class _Cycle:
    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.me = t, self


def test_a_step_is_counted_at_current_size_and_what_a_cycle_keeps_stays_held():
    gc.collect()  # garbage an earlier test left (a captured graph's cycles) is not counted
    gc.disable()  # a collection mid-test would free the cycle the test counts
    try:
        x = torch.randn(1000)  # held on entry: counted from the start
        with StorageTracker() as tracker:
            assert tracker.start_bytes >= 4000
            y = x * 2  # 4,000 bytes more
            peak_with_y = tracker.live_bytes
            y.untyped_storage().resize_(0)  # freed in place: no dispatch mode sees it
            z = x + 1
            assert tracker.live_bytes == peak_with_y  # z in the place y was
            del y, z
            kept = x - 1
            _Cycle(kept)  # unreachable, but held until the collector runs
            del kept
            held = tracker.update()
        assert tracker.peak_bytes == peak_with_y == tracker.start_bytes + 4000
        assert held == tracker.start_bytes + 4000  # the cycle's tensor is held memory
        gc.collect()
        assert tracker.update() == tracker.start_bytes
    finally:
        gc.enable()


def test_a_dropped_tracker_is_freed_at_once():
    gc.disable()
    try:
        with StorageTracker() as tracker:
            t = torch.ones(10) * 3
        ref = weakref.ref(tracker)
        del tracker
        assert ref() is None  # no cycle through its storages' weak-reference callbacks
        del t  # and the callback of a dead tracker is harmless
    finally:
        gc.enable()

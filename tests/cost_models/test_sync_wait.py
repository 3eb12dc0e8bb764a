"""The wait of a blocking collective after a stretch of computation ([Note: the wait after a
stretch of computation] in ``cost_models/overlap.py``): which collectives pay it and after how
much computation, worked by hand, and what a plan's prediction charges for it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from osdp_fx import Devices
from osdp_fx.core.buckets import Schedule
from osdp_fx.core.devices import SYNC_STRETCH_S
from osdp_fx.core.setting import StepSetting
from osdp_fx.cost_models.overlap import (
    TimedGather,
    TimedReduce,
    expected_max_normal,
    group_wait_ratio,
    sync_stretches_s,
    sync_wait_share,
)
from osdp_fx.errors import InputError
from osdp_fx.examples import MLP
from osdp_fx.passes.capture import capture
from osdp_fx.planner.make import plan_model

MS = 1e-3


def _stretches(*args, **kw) -> list[float]:
    """``sync_stretches_s``' stretches, each collective waiting for every rank (share 1)."""
    pairs = sync_stretches_s(*args, **kw)
    assert all(share == 1.0 for _, share in pairs)
    return [stretch for stretch, _ in pairs]


def test_each_blocking_collective_pays_for_the_computation_since_the_last_wait() -> None:
    """Forward lane 1, 2, 3, 4 ms and backward lane 4, 3, 2, 1 ms (a step of 20 ms), the
    optimizer step 0.5 ms between steps. The ranks wait at the first gather (forward step 0),
    the second (step 2, 3 ms in), the re-gather (backward step 1, 14 ms in) and the end of
    backward (20 ms)."""
    forward = [TimedGather(0, 0, 1.0), TimedGather(0, 2, 1.0)]  # the second prefetched at 0
    backward = [TimedGather(1, 1, 1.0)]
    reduces = [TimedReduce(3, 1.0, "reduce_scatter"), TimedReduce(1, 1.0, "all_reduce")]
    stretches = _stretches([1 * MS, 2 * MS, 3 * MS, 4 * MS],
                                 [4 * MS, 3 * MS, 2 * MS, 1 * MS],
                                 forward, backward, reduces, between_steps_s=0.5 * MS)
    assert stretches == pytest.approx([
        0.5 * MS,  # the first gather: since the end of the step before, and its optimizer step
        0.0,  # prefetched at the first one's wait: right after a synchronisation
        11 * MS,  # the re-gather, at 14 ms: since the second gather's wait at 3 ms
        6 * MS,  # the last gradient collective, issued at 20 ms: since the re-gather's wait
    ])


def test_where_the_ranks_hold_their_cores_a_prefetched_gather_waits_at_its_use() -> None:
    """The step of the first test with ``prefetch_waits`` (``Devices.prefetch_waits_for_ranks``:
    the CPU where each rank's computation holds a core, and gloo's threads run the gather at
    its wait): the second gather, issued at the first one's wait, pays for the 3 ms of forward
    steps 0 and 1 computed before its use; the rest as before."""
    forward = [TimedGather(0, 0, 1.0), TimedGather(0, 2, 1.0)]
    backward = [TimedGather(1, 1, 1.0)]
    reduces = [TimedReduce(3, 1.0, "reduce_scatter"), TimedReduce(1, 1.0, "all_reduce")]
    lanes = ([1 * MS, 2 * MS, 3 * MS, 4 * MS], [4 * MS, 3 * MS, 2 * MS, 1 * MS])
    stretches = _stretches(*lanes, forward, backward, reduces, between_steps_s=0.5 * MS,
                                 prefetch_waits=True)
    assert stretches == pytest.approx([0.5 * MS, 3 * MS, 11 * MS, 6 * MS])
    # a re-gather prefetched in backward (issued at backward step 0, used at step 2) too
    early = [TimedGather(0, 2, 1.0)]
    assert _stretches(*lanes, forward, early, reduces, between_steps_s=0.5 * MS,
                            prefetch_waits=True) == pytest.approx(
        [0.5 * MS, 3 * MS, 14 * MS, 3 * MS])
    assert _stretches(*lanes, forward, early, reduces, between_steps_s=0.5 * MS) == (
        pytest.approx([0.5 * MS, 0.0, 7 * MS, 3 * MS]))


def test_gathers_used_at_one_operator_wait_in_turn() -> None:
    """A linear's weight and bias in two gather buckets, both first used by its operator at
    forward step 0 (the bias's prefetched there): the weight's is issued after the step
    before (and its optimizer step) and waited for, then the bias's follows that wait."""
    forward = [TimedGather(0, 0, 1.0), TimedGather(0, 0, 1.0), TimedGather(0, 1, 1.0)]
    stretches = _stretches([2 * MS, 3 * MS], [3 * MS, 2 * MS], forward, [],
                                 [TimedReduce(1, 1.0, "reduce_scatter")],
                                 between_steps_s=1 * MS)
    assert stretches == pytest.approx([1 * MS, 0.0, 0.0, 8 * MS])


def test_a_prefetched_two_stage_gather_waits_again_at_its_use_for_its_stage_ranks() -> None:
    """The first test's step with two-stage gathers (``hierarchical`` on 2 nodes x 2: the
    second stage over a node's 2 ranks, started at the gather's wait). The first gather,
    issued at its use, waits once for every rank (its second stage follows the first, whose
    ranks already waited); the second, prefetched at the first one's wait, issues its second
    stage at its use, 3 ms later, and waits there for the 2 ranks of that stage only; the
    re-gather, issued at its use, waits once."""
    forward = [TimedGather(0, 0, 1.0, 0.5, 2), TimedGather(0, 2, 1.0, 0.5, 2)]
    backward = [TimedGather(1, 1, 1.0, 0.5, 2)]
    reduces = [TimedReduce(3, 1.0, "reduce_scatter")]
    pair = group_wait_ratio(2, 4)
    stretches = sync_stretches_s([1 * MS, 2 * MS, 3 * MS, 4 * MS],
                                 [4 * MS, 3 * MS, 2 * MS, 1 * MS],
                                 forward, backward, reduces, between_steps_s=0.5 * MS,
                                 world_size=4)
    assert [c for c, _ in stretches] == pytest.approx([
        0.5 * MS, 0.0,  # the first gather; the second's first stage, issued at the first's wait
        3 * MS,  # the second's second stage, at its use
        11 * MS, 6 * MS])  # the re-gather; the last gradient collective
    assert [share for _, share in stretches] == pytest.approx([1.0, 1.0, pair, 1.0, 1.0])
    # where a gather runs at its use wherever it was issued, it waits once, for every rank
    assert _stretches([1 * MS, 2 * MS, 3 * MS, 4 * MS], [4 * MS, 3 * MS, 2 * MS, 1 * MS],
                      forward, backward, reduces, between_steps_s=0.5 * MS,
                      prefetch_waits=True, world_size=4) == pytest.approx(
        [0.5 * MS, 3 * MS, 11 * MS, 6 * MS])


def test_a_two_stage_gradient_collective_waited_for_in_backward_waits_for_its_stage_ranks(
) -> None:
    """Forward lane 1, 2 ms, backward lane 4, 3, 2, 1 ms (backward from 3 to 13 ms), the
    optimizer step 0.5 ms; three two-stage reduce-scatters (``hierarchical`` on 2 x 2: the
    second stage across the nodes' 2 ranks) ready after backward steps 0, 1 and 3, one in
    flight at a time. Issuing the second (at 10 ms) first waits for the first, whose second
    stage starts then, 10.5 ms after the last synchronisation (the step before's end); issuing
    the third (at 13 ms) waits for the second, 13.5 ms after it (a stage's ranks meeting do
    not synchronise the rest), and the third's issue follows as long a stretch. With two in
    flight, only the third's issue waits for one."""
    pair = group_wait_ratio(2, 4)
    reduces = [TimedReduce(step, 1.0, "reduce_scatter", 0.5, 2) for step in (0, 1, 3)]
    lanes = ([1 * MS, 2 * MS], [4 * MS, 3 * MS, 2 * MS, 1 * MS])
    stretches = sync_stretches_s(*lanes, [], [], reduces, between_steps_s=0.5 * MS,
                                 world_size=4, in_flight=1)
    assert [c for c, _ in stretches] == pytest.approx([10.5 * MS, 13.5 * MS, 13.5 * MS])
    assert [share for _, share in stretches] == pytest.approx([pair, pair, 1.0])
    stretches = sync_stretches_s(*lanes, [], [], reduces, between_steps_s=0.5 * MS,
                                 world_size=4, in_flight=2)
    assert [c for c, _ in stretches] == pytest.approx([13.5 * MS, 13.5 * MS])
    assert [share for _, share in stretches] == pytest.approx([pair, 1.0])
    # one-stage collectives waited for in backward: only the last one's issue waits
    flat = [dataclasses.replace(r, at_wait_s=0.0, at_wait_ranks=0) for r in reduces]
    assert _stretches(*lanes, [], [], flat, between_steps_s=0.5 * MS, world_size=4,
                      in_flight=1) == pytest.approx([13.5 * MS])


def test_a_group_waits_for_the_expected_last_of_its_ranks() -> None:
    """The expected largest of n standard normals (tabulated: 0.5642 for 2, 0.8463 for 3,
    1.0294 for 4, 1.4236 for 8), and the wait of a group of ranks against all of them."""
    assert [expected_max_normal(n) for n in (1, 2, 3, 4, 8)] == pytest.approx(
        [0.0, 0.5642, 0.8463, 1.0294, 1.4236], abs=1e-4)
    assert group_wait_ratio(2, 4) == pytest.approx(0.5642 / 1.0294, abs=1e-4)
    assert group_wait_ratio(4, 4) == 1.0
    assert group_wait_ratio(2, 1) == 0.0


def test_without_gathers_the_step_end_follows_a_whole_step() -> None:
    """``replicate``: the one wait is the end of backward, after forward, backward and the
    optimizer step; without gradient collectives nothing waits."""
    lanes = ([2 * MS, 3 * MS], [3 * MS, 2 * MS])
    reduces = [TimedReduce(0, 1.0, "all_reduce"), TimedReduce(1, 1.0, "all_reduce")]
    assert _stretches(*lanes, [], [], reduces, between_steps_s=1 * MS) == (
        pytest.approx([11 * MS]))
    assert _stretches(*lanes, [], [], [], between_steps_s=1 * MS) == []


def _predicted(plan, devices: Devices, tmp_path):
    return _planned(plan, devices, tmp_path).prediction


def _planned(plan, devices: Devices, tmp_path):
    if isinstance(plan, str) and plan.endswith(".json"):
        path = tmp_path / plan
        path.write_text('{"format": "osdp-fx-plan", "version": 1, "default": "replicate", '
                        '"params": {"layers.2.weight": "full_shard"}}')
        plan = str(path)
    torch.manual_seed(0)
    model, x = MLP((64, 128, 128, 64)), torch.randn(8, 64)
    planned = plan_model(capture(model, (x,)), (x,), plan, StepSetting(devices, optimizer="sgd"))
    return planned.plan


DEVICES = dict(world_size=2, memory_bytes=2**30, compute_flops_per_s=1e9,
               memory_bandwidth_bytes_per_s=1e10)


@pytest.mark.parametrize("plan, waits", [
    ("replicate", 1),  # the end of backward
    ("last.json", 3),  # the last linear's gather, its re-gather in backward, the end
])
def test_a_plan_pays_the_wait_once_per_collective_after_computation(plan, waits, tmp_path,
                                                                   monkeypatch) -> None:
    """With a share of one for any computation before it, each blocking collective after some
    computation pays ``sync_wait_s`` whole: their count."""
    import osdp_fx.cost_models.overlap as overlap

    monkeypatch.setattr(overlap, "sync_wait_share", lambda stretch_s: float(stretch_s > 0))
    wait = 2 * MS
    base = _predicted(plan, Devices(**DEVICES), tmp_path)
    charged = _predicted(plan, Devices(**DEVICES, sync_wait_s=wait), tmp_path)
    assert base.sync_wait_s == 0.0
    assert charged.sync_wait_s == pytest.approx(waits * wait)
    # in the communication, and nothing else moves
    assert charged.comm_s == pytest.approx(base.comm_s + waits * wait)
    assert charged.step_time_s == pytest.approx(base.step_time_s + waits * wait)
    assert charged.compute_s == pytest.approx(base.compute_s)


def test_where_the_ranks_hold_their_cores_prefetching_saves_no_wait(tmp_path) -> None:
    """``full_shard`` in 4 KiB gather buckets (a bucket per parameter), each gather prefetched
    one ahead: with ``Devices.prefetch_waits_for_ranks`` its gathers wait for the ranks as at
    prefetch 0, without it the prefetched ones wait for nothing, and the step grows by the
    difference alone."""
    devices = Devices(**DEVICES, sync_wait_s=2 * MS)
    held_devices = dataclasses.replace(devices, prefetch_waits_for_ranks=True)
    small = dataclasses.replace(_planned("full_shard", devices, tmp_path),
                                schedule=Schedule(gather_bucket_bytes=4096))
    apart = _predicted(small, devices, tmp_path)
    held = _predicted(small, held_devices, tmp_path)
    unfetched = _predicted(dataclasses.replace(small, schedule=Schedule(
        prefetch=0, gather_bucket_bytes=4096)), devices, tmp_path)
    assert held.sync_wait_s == pytest.approx(unfetched.sync_wait_s)
    assert held.sync_wait_s > apart.sync_wait_s > 0
    assert held.step_time_s - apart.step_time_s == pytest.approx(
        held.sync_wait_s - apart.sync_wait_s)
    with pytest.raises(InputError, match="prefetch_waits_for_ranks"):
        Devices(prefetch_waits_for_ranks=1)


def test_the_share_grows_with_the_square_root_of_the_stretch() -> None:
    """Ranks drift apart as random walks do: the whole wait after ``SYNC_STRETCH_S``, half of
    it after a quarter of that, twice it after four times, nothing after nothing."""
    assert sync_wait_share(SYNC_STRETCH_S) == pytest.approx(1.0)
    assert sync_wait_share(SYNC_STRETCH_S / 4) == pytest.approx(0.5)
    assert sync_wait_share(4 * SYNC_STRETCH_S) == pytest.approx(2.0)
    assert sync_wait_share(0.0) == 0.0


def test_a_step_pays_the_share_of_its_stretch_and_one_rank_nothing(tmp_path) -> None:
    """``replicate``'s one wait, at the end of backward, follows the whole step (forward,
    backward and optimizer): it pays that stretch's share of ``sync_wait_s``; one rank waits
    for none."""
    wait = 2 * MS
    step = _predicted("replicate", Devices(**DEVICES, sync_wait_s=wait), tmp_path)
    stretch = step.compute_s + step.optim_s
    assert step.sync_wait_s == pytest.approx(wait * (stretch / SYNC_STRETCH_S) ** 0.5)
    alone = _predicted("replicate", Devices(**dict(DEVICES, world_size=1), sync_wait_s=wait),
                       tmp_path)
    assert alone.sync_wait_s == 0.0


def test_the_wait_and_the_replicas_host_time_are_checked() -> None:
    for name in ("sync_wait_s", "replica_host_time_s"):
        with pytest.raises(InputError, match=name):
            Devices(**{name: -1e-3})
        assert getattr(Devices(**{name: 1e-3}), name) == 1e-3

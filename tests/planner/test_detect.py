"""Detection of Devices in one process and on a real 2-rank gloo world (the Devices record
itself, its JSON and checks: tests/core/test_devices.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from harness import cases

from osdp_fx.core.devices import DEFAULT_CPU_MEMORY_BYTES, OPTIMIZERS, Devices
from osdp_fx.cost_models.communication import collective_time_s
from osdp_fx.errors import InputError
from osdp_fx.planner.detect import (
    CPU_MEMORY_MARGIN,
    detect_devices,
    devices_for,
    measured,
    non_decreasing,
    overlap_efficiency_from,
)

MEASURED = ("compute_flops_per_s", "memory_bandwidth_bytes_per_s", "selective_op_time_s",
            "full_recompute_op_time_s")


def _positive_finite(devices: Devices, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(devices, name)
        assert value > 0 and math.isfinite(value), (name, value)


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("searched", [True, False])
def test_default_memory_limit_is_the_devices_memory(world_size: int, searched: bool) -> None:
    """Without a limit, what the devices say, else the memory of the device the model runs on:
    the same at every world size and for named plans as for the search (no detection here:
    a Devices is given, or there is no process group to detect)."""
    def found(devices: Devices, given: bool) -> Devices:
        # a search without given Devices plans with measured figures (nothing to measure in
        # a world of one rank; no process group here for more)
        return measured(devices) if searched and not given and world_size == 1 else devices

    cpu = found(devices_for(None, world_size=world_size, memory_limit_bytes=None,
                            device=torch.device("cpu")), given=False)
    assert cpu.memory_bytes == DEFAULT_CPU_MEMORY_BYTES == 4 * 2**30
    given = found(devices_for(Devices(memory_bytes=2**30), world_size=world_size,
                              memory_limit_bytes=None, device=torch.device("cpu")), given=True)
    assert given.memory_bytes == 2**30
    assert found(devices_for(given, world_size=world_size, memory_limit_bytes=3 * 2**30),
                 given=True).memory_bytes == 3 * 2**30
    if torch.cuda.is_available():
        gpu = found(devices_for(None, world_size=world_size, memory_limit_bytes=None,
                                device=torch.device("cuda", 0)), given=False)
        assert gpu.memory_bytes == torch.cuda.mem_get_info(0)[1]


def test_detect_without_process_group() -> None:
    # one intra-op thread, as each rank of a world has (torchrun's default): with the suite's
    # second worker busy, a pool of two threads on two cores makes every small operator wait
    # on a thread that is not running, and the selective-checkpoint figure measured 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        devices = detect_devices(memory_limit="2GiB")
    finally:
        torch.set_num_threads(threads)
    assert devices.world_size == 1 and devices.memory_bytes == 2 * 2**30
    assert devices.memory_margin == CPU_MEMORY_MARGIN == 0.0  # no caching allocator
    _positive_finite(devices, MEASURED)
    # every optimizer kind is timed, per element and per tensor
    for times in (devices.optimizer_element_time_s, devices.optimizer_tensor_time_s):
        assert sorted(times) == sorted(OPTIMIZERS)
        assert all(0 <= t < 1e-3 and math.isfinite(t) for t in times.values()), times
    assert devices.optimizer_tensor_time_s["adamw"] > 0


def test_optimizer_times_round_trip_and_are_checked(tmp_path: Path) -> None:
    devices = Devices(optimizer_element_time_s={"adamw": 4e-9},
                      optimizer_tensor_time_s={"adamw": 2e-5, "sgd": 2e-6})
    devices.to_json(tmp_path / "devices.json")
    assert Devices.from_json(tmp_path / "devices.json") == devices
    with pytest.raises(InputError, match=r"optimizer_element_time_s has invalid entries "
                                         r"\{'lamb': 1e-09\}: keys are optimizer kinds"):
        Devices(optimizer_element_time_s={"lamb": 1e-9})
    with pytest.raises(InputError, match="non-negative seconds"):
        Devices(optimizer_tensor_time_s={"sgd": -1.0})


def test_detect_on_two_rank_gloo_world(worlds, tmp_path: Path) -> None:
    worlds(2).run(cases.detect_to_json, out_dir=str(tmp_path))
    one_node = [Devices.from_json(tmp_path / f"node.{r}.json") for r in range(2)]
    two_nodes = [Devices.from_json(tmp_path / f"nodes.{r}.json") for r in range(2)]
    # every rank derives the same figures, so every rank makes the same plan
    assert one_node[0] == one_node[1] and two_nodes[0] == two_nodes[1]
    intra = ("intra_node_bandwidth_bytes_per_s", "intra_node_latency_s")
    inter = ("inter_node_bandwidth_bytes_per_s", "inter_node_latency_s")
    defaults = Devices()

    node = one_node[0]
    assert (node.world_size, node.ranks_per_node, node.memory_bytes) == (2, None, 2**30)
    _positive_finite(node, MEASURED + intra)
    assert node.intra_node_bandwidth_bytes_per_s != defaults.intra_node_bandwidth_bytes_per_s
    assert [getattr(node, f) for f in inter] == [getattr(defaults, f) for f in inter]
    # each collective fitted to its own timings; the scope's figures are the all-reduce's
    assert sorted(node.collective_links) == [
        "intra_node.all_gather", "intra_node.all_reduce", "intra_node.reduce_scatter"]
    assert node.collective_links["intra_node.all_reduce"] == {
        "bandwidth_bytes_per_s": node.intra_node_bandwidth_bytes_per_s,
        "latency_s": node.intra_node_latency_s}
    # the timed sizes kept, and each priced at its own time ([Note: priced from the timed
    # sizes])
    assert sorted(node.collective_times) == sorted(node.collective_links)
    for key, times in node.collective_times.items():
        assert times["group_size"] == 2 and len(times["total_bytes"]) >= 2
        for nbytes, seconds in zip(times["total_bytes"], times["seconds"]):
            assert collective_time_s(key.split(".")[1], nbytes, node) == pytest.approx(seconds)
    # two collectives started together, timed against one after the other: a measured share,
    # and one per size (a re-gather beside a reduce-scatter), kept in the devices' file
    assert 0.5 <= node.concurrent_collective_ratio <= 1
    table = node.concurrent_collective_ratios
    assert len(table["total_bytes"]) == 4 and all(0.5 <= r <= 1 for r in table["ratios"])
    # the single ratio pools the sizes' times: between the least and the largest of theirs
    assert (min(table["ratios"]) - 1e-9 <= node.concurrent_collective_ratio
            <= max(table["ratios"]) + 1e-9)
    loaded = Devices.from_json(tmp_path / "node.0.json")
    assert loaded.concurrent_collective_ratio == node.concurrent_collective_ratio
    assert loaded.concurrent_collective_ratios == table
    # measured on the CPU: a share, applied beyond a collective's latency
    assert 0 <= node.overlap_efficiency <= 1 and not node.overlap_hides_latency
    # whether the ranks hold their cores: from the ranks' share of them, which other tests
    # running beside this one move; one answer for every rank, kept in the devices' file
    assert isinstance(node.prefetch_waits_for_ranks, bool)
    assert loaded.prefetch_waits_for_ranks == node.prefetch_waits_for_ranks
    # the wait after a stretch of computation, and the host time of a replicated parameter
    # among sharded ones: measured, and within what a step on this CPU could hold
    assert 0 <= node.sync_wait_s < 0.05 and 0 <= node.replica_host_time_s < 0.005
    assert Devices.from_json(tmp_path / "node.0.json").sync_wait_s == node.sync_wait_s

    nodes = two_nodes[0]
    assert (nodes.world_size, nodes.ranks_per_node, nodes.num_nodes) == (2, 1, 2)
    _positive_finite(nodes, MEASURED + inter)
    assert nodes.inter_node_bandwidth_bytes_per_s != defaults.inter_node_bandwidth_bytes_per_s
    assert [getattr(nodes, f) for f in intra] == [getattr(defaults, f) for f in intra]
    assert all(key.startswith("inter_node.") for key in nodes.collective_links)
    assert not nodes.all_reduce_trees  # gloo runs its all-reduces as rings, not NCCL's trees


@pytest.mark.parametrize(("alone", "compute", "together", "latency", "efficiency"), [
    (10.0, 15.0, 25.0, 2.0, 0.0),  # one after the other: hiding saved nothing
    (10.0, 15.0, 17.0, 2.0, 1.0),  # all but the latency hidden: the model's ideal
    (10.0, 15.0, 21.0, 2.0, 0.5),  # half of the time beyond the latency
    (10.0, 5.0, 13.0, 2.0, 0.5),  # a shorter computation hides at most its own length
    (10.0, 15.0, 30.0, 2.0, 0.0),  # slower together: no credit, not a negative one
    (10.0, 15.0, 10.0, 2.0, 1.0),  # faster than the ideal (noise): at most all of it
    (2.0, 15.0, 15.0, 2.0, 0.0),  # nothing beyond the latency to hide
])
def test_overlap_efficiency_is_the_saving_over_the_models_ideal(alone, compute, together,
                                                                latency, efficiency) -> None:
    """Saving T + C - B over the ideal the step model credits, (C - latency) / C min(T, C)
    ([Note: overlap on the CPU])."""
    assert overlap_efficiency_from(alone, compute, together, latency) == pytest.approx(efficiency)


def test_links_are_measured_again_on_the_same_nodes(worlds) -> None:
    """World 4 as 2 nodes x 2: a second measurement makes its node and cross-node groups
    again (a group made under a destroyed one's name found the old addresses and never
    connected). Every kind of group a plan's collectives run over is timed: the node's ranks
    (intra-node), the whole world's ring (``world``) and the ranks of one local index, one per
    node (inter-node: ``hybrid_shard``'s all-reduce, ``hierarchical``'s first stages)."""
    results = worlds(4).run(cases.links_measured_twice, ranks_per_node=2)
    for first, second in results:
        assert first == second and "intra_node_latency_s" in first
        assert "inter_node_latency_s" in first
        for scope in ("intra_node", "inter_node", "world"):
            for collective in ("all_gather", "reduce_scatter", "all_reduce"):
                assert f"{scope}.{collective}" in first
                # its sizes timed over the group's ranks: 2 in a node and across, 4 in the ring
                assert f"{scope}.{collective}:{4 if scope == 'world' else 2}" in first


def test_a_cpu_second_costs_more_wall_where_ranks_outnumber_the_cores(worlds) -> None:
    """The host probe's thread-clock figures are scaled by the wall seconds a second of a
    rank's work takes while every rank works (``detect._wall_per_cpu_second``): 1 for one
    process, and above 1 for the slowest of four ranks on fewer cores."""
    from osdp_fx.planner import detect

    assert detect._wall_per_cpu_second(None) >= 1.0
    shares = worlds(4).run(cases.wall_per_cpu_second)
    assert all(s >= 1.0 for s in shares)
    if (os.cpu_count() or 1) <= 2:  # four ranks on two cores each run about half the time
        assert max(shares) > 1.1, shares


def test_the_gpu_margin_follows_the_caching_allocators_setting(monkeypatch):
    """expandable_segments:True (here through PYTORCH_CUDA_ALLOC_CONF, read when the allocator
    reports no settings of its own) fragments less: the search keeps a smaller margin."""
    from osdp_fx.core.presets import GPU_MEMORY_MARGIN, GPU_MEMORY_MARGIN_EXPANDABLE
    from osdp_fx.planner.detect import allocator_margin, expandable_segments

    if torch._C._accelerator_getAllocatorSettings():
        pytest.skip("this process set its allocator's settings at run time")
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert not expandable_segments() and allocator_margin() == GPU_MEMORY_MARGIN
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:True")
    assert expandable_segments() and allocator_margin() == GPU_MEMORY_MARGIN_EXPANDABLE
    assert GPU_MEMORY_MARGIN_EXPANDABLE < GPU_MEMORY_MARGIN


def test_interleaved_runs_take_their_own_number_of_calls() -> None:
    """Each run is timed in runs of its own number of calls, every round (after one warmup
    round): a large collective is timed in fewer calls per run."""
    import time

    from osdp_fx.planner import detect

    counts = [0, 0]

    def run(j: int, seconds: float):
        def body() -> None:
            counts[j] += 1
            time.sleep(seconds)
        return body

    times = detect._interleaved_times_s([run(0, 0.002), run(1, 0.004)], torch.device("cpu"),
                                        barrier=lambda: None, rounds=3, calls=[4, 1])
    assert counts == [4 * 4, 1 * 4]
    assert all(t >= 0.002 for t in times)  # per call: at least a call's sleep


def test_timed_sizes_are_pooled_where_a_larger_one_timed_faster() -> None:
    """A size timed below a smaller one shares the mean of the two with it (pool adjacent
    violators): neither time is raised to the other's noise."""
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert non_decreasing([5.0, 1.0, 1.0, 1.0]) == [2.0] * 4
    assert non_decreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


@given(st.lists(st.floats(1e-6, 1.0), min_size=1, max_size=12))
def test_pooled_times_never_fall_and_keep_their_sum(times) -> None:
    pooled = non_decreasing(times)
    assert len(pooled) == len(times)
    assert all(b >= a for a, b in zip(pooled, pooled[1:]))
    assert sum(pooled) == pytest.approx(sum(times))


def test_rates_are_timed_with_every_rank_at_once() -> None:
    """The matmul rate, the copy bandwidth and the optimizer's times run each timed run after
    the barrier given ([Note: rates with every rank at once]): the warmup and every repeat."""
    from osdp_fx.planner.detect import (
        _REPEATS,
        _copy_bandwidth_bytes_per_s,
        _matmul_flops_per_s,
        _optimizer_times,
    )

    calls = []
    cpu = torch.device("cpu")
    assert _matmul_flops_per_s(cpu, lambda: calls.append("mm")) > 0
    assert _copy_bandwidth_bytes_per_s(cpu, lambda: calls.append("copy")) > 0
    per_element, per_tensor = _optimizer_times(cpu, ("sgd",), lambda: calls.append("sgd"))
    assert per_element[0] >= 0 and per_tensor[0] > 0
    # the optimizer: a step over 64 small tensors, then one over 4 large ones
    assert calls == ["mm"] * (1 + _REPEATS) + ["copy"] * (1 + _REPEATS) + ["sgd"] * (
        2 * (1 + _REPEATS))

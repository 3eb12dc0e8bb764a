"""Communication cost model: closed-form ring times, intra/inter-node link choice, fitting."""

from __future__ import annotations

import dataclasses

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from osdp_fx.core.devices import Devices
from osdp_fx.cost_models.communication import (
    TREE_BANDWIDTH_SHARE,
    CollectiveSample,
    Link,
    all_gather_time_s,
    all_reduce_parts_s,
    all_reduce_time_s,
    collective_time_s,
    fit_link,
    group_link,
    reduce_scatter_time_s,
)
from osdp_fx.errors import InputError

LINK = {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5}


def test_ring_all_gather_and_reduce_scatter_closed_form() -> None:
    n, p = 8e6, 4
    expected = 3 / 4 * n / 1e9 + 3 * 1e-5
    assert all_gather_time_s(n, p, **LINK) == pytest.approx(expected, rel=1e-12)
    assert reduce_scatter_time_s(n, p, **LINK) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_is_reduce_scatter_plus_all_gather() -> None:
    n, p = 3e6, 8
    assert all_reduce_time_s(n, p, **LINK) == pytest.approx(
        reduce_scatter_time_s(n, p, **LINK) + all_gather_time_s(n, p, **LINK), rel=1e-12
    )
    assert all_reduce_time_s(n, p, **LINK) == pytest.approx(2 * (7 / 8 * n / 1e9 + 7e-5))


def test_one_rank_costs_nothing() -> None:
    assert all_gather_time_s(1e9, 1, **LINK) == 0.0
    assert all_reduce_time_s(1e9, 1, **LINK) == 0.0


def test_group_link_chooses_intra_or_inter_node() -> None:
    devices = Devices(world_size=8, ranks_per_node=4, intra_node_bandwidth_bytes_per_s=1e11,
                      intra_node_latency_s=1e-6, inter_node_bandwidth_bytes_per_s=1e10,
                      inter_node_latency_s=1e-5)
    intra, inter = Link(1e11, 1e-6), Link(1e10, 1e-5)
    # the world spans both nodes: NCCL's ring through every rank of a node, its two crossings
    # spread over the node's four network links, one of its seven steps crossing nodes
    ring = Link(min(1e11, 4 * 1e10), (6 * 1e-6 + 1 * 1e-5) / 7)
    assert group_link(devices, "all_gather") == ring
    assert group_link(devices, "all_gather", group_size=4) == intra
    # one rank per node: each crossing over that rank's own link
    assert group_link(devices, "all_reduce", group_size=2, spans_nodes=True) == inter
    assert group_link(Devices(world_size=8), "reduce_scatter", group_size=8) == Link(
        Devices().intra_node_bandwidth_bytes_per_s, Devices().intra_node_latency_s)
    n = 64e6
    assert collective_time_s("all_gather", n, devices) == pytest.approx(
        all_gather_time_s(n, 8, bandwidth_bytes_per_s=4e10, latency_s=ring.latency_s))
    # slower links across nodes than the node's: the node's links bound the ring
    fast_net = dataclasses.replace(devices, inter_node_bandwidth_bytes_per_s=5e10)
    assert group_link(fast_net, "all_gather").bandwidth_bytes_per_s == 1e11
    assert collective_time_s("all_reduce", n, devices, group_size=4) == pytest.approx(
        all_reduce_time_s(n, 4, bandwidth_bytes_per_s=1e11, latency_s=1e-6))
    # a spanning group is slower than a node-local one of the same size
    assert collective_time_s("reduce_scatter", n, devices, group_size=4, spans_nodes=True) > \
        collective_time_s("reduce_scatter", n, devices, group_size=4)


def test_the_whole_worlds_collectives_run_at_its_measured_ring() -> None:
    """``detect`` keeps the ring over every rank of every node as measured
    (``collective_links["world.<collective>"]``): the world's collectives run at it, even where
    the rule across nodes would bound them by a slower node ring (nodes sharing one machine's
    cores); groups of one rank per node, and a node's groups, keep their own figures."""
    world = {"bandwidth_bytes_per_s": 2e9, "latency_s": 3e-4}
    devices = Devices(world_size=4, ranks_per_node=2, intra_node_bandwidth_bytes_per_s=5e8,
                      intra_node_latency_s=1e-4, inter_node_bandwidth_bytes_per_s=1e9,
                      inter_node_latency_s=2e-4, collective_links={"world.all_gather": world})
    assert group_link(devices, "all_gather") == Link(2e9, 3e-4)
    assert collective_time_s("all_gather", 4e6, devices) == pytest.approx(
        all_gather_time_s(4e6, 4, **world))
    # without a measurement, the rule: the node's slower links bound the ring
    assert group_link(devices, "reduce_scatter").bandwidth_bytes_per_s == 5e8
    assert group_link(devices, "all_gather", group_size=2, spans_nodes=True) == Link(1e9, 2e-4)
    assert group_link(devices, "all_gather", group_size=2) == Link(5e8, 1e-4)


def test_an_all_reduce_across_nodes_runs_as_nccls_tree_where_it_is_faster() -> None:
    """NCCL's tuning model (tuning.cc): a tree all-reduce over ``m`` nodes of ``R`` ranks pays
    ``2 ((R - 1) alpha_intra + floor(log2 m) alpha_net)`` and moves ``2 n`` bytes at 0.92 of the
    ring's bus bandwidth; NCCL takes the faster of ring and tree at each size."""
    a_intra, a_net, b_intra, b_net = 2e-6, 1e-5, 3e11, 4e10
    devices = Devices(world_size=128, ranks_per_node=8, intra_node_bandwidth_bytes_per_s=b_intra,
                      intra_node_latency_s=a_intra, inter_node_bandwidth_bytes_per_s=b_net,
                      inter_node_latency_s=a_net, all_reduce_trees=True)
    assert TREE_BANDWIDTH_SHARE == 0.92
    # every rank of 16 nodes: the ring's bandwidth spread over a node's 8 links, capped by
    # NVLink; its 127 steps, 15 of them across nodes
    b = min(b_intra, 8 * b_net)
    ring = (2 * 127 / 128 / b, 2 * (112 * a_intra + 15 * a_net))
    tree = (2 / (0.92 * b), 2 * (7 * a_intra + 4 * a_net))
    crossover = (ring[1] - tree[1]) / (tree[0] - ring[0])  # both take as long: about 1 GB
    assert crossover > 0
    for n, parts in ((0.5 * crossover, tree), (2 * crossover, ring), (1e3, tree), (1e12, ring)):
        assert all_reduce_parts_s(n, devices) == pytest.approx(parts)
        assert collective_time_s("all_reduce", n, devices) == pytest.approx(
            parts[0] * n + parts[1])
    # one rank per node (hybrid sharding's cross-node all-reduce over 16 nodes): no chain
    # in a node; its ring runs over one network link
    one_per_node = all_reduce_parts_s(1e3, devices, group_size=16, spans_nodes=True)
    assert one_per_node == pytest.approx((2 / (0.92 * b_net), 2 * 4 * a_net))
    # inside a node, on gloo (no trees) and for the other collectives: rings at every size
    node = Devices(**{**dataclasses.asdict(devices), "world_size": 8})
    assert all_reduce_parts_s(1e3, node) == pytest.approx((2 * 7 / 8 / b_intra, 14 * a_intra))
    gloo = dataclasses.replace(devices, all_reduce_trees=False)
    assert all_reduce_parts_s(1e3, gloo) == pytest.approx(ring)
    assert collective_time_s("all_gather", 1e3, devices) == pytest.approx(
        all_gather_time_s(1e3, 128, bandwidth_bytes_per_s=b, latency_s=ring[1] / 254))
    assert Devices.preset("h100-sxm-8x", world_size=16).all_reduce_trees


def test_bad_inputs_are_user_errors() -> None:
    with pytest.raises(InputError, match="unknown collective 'broadcast'"):
        collective_time_s("broadcast", 1e6, Devices(world_size=2))  # type: ignore[arg-type]
    with pytest.raises(InputError, match="bandwidth"):
        all_gather_time_s(1e6, 2, bandwidth_bytes_per_s=0.0, latency_s=0.0)
    with pytest.raises(InputError, match="group_size=0"):
        all_gather_time_s(1e6, 0, **LINK)
    with pytest.raises(InputError, match="at least two"):
        fit_link([CollectiveSample("all_gather", 1e6, 2, 1e-3)])


@settings(max_examples=50, deadline=None)
@given(
    bandwidth=st.floats(1e7, 1e12),
    latency=st.floats(1e-7, 1e-3),
    group_size=st.integers(2, 64),
)
def test_fit_recovers_exact_link(bandwidth: float, latency: float, group_size: int) -> None:
    link = {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency}
    functions = {"all_gather": all_gather_time_s, "reduce_scatter": reduce_scatter_time_s,
                 "all_reduce": all_reduce_time_s}
    samples = [CollectiveSample(name, n, group_size, fn(n, group_size, **link))
               for n in (4e3, 6.4e4, 1e6, 4e6) for name, fn in functions.items()]
    fitted = fit_link(samples)
    assert fitted.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert fitted.latency_s == pytest.approx(latency, rel=1e-6)


def test_fit_stays_positive_on_noisy_data() -> None:
    # constant times: no size dependence, so all time is latency and bandwidth is bounded
    flat = [CollectiveSample("all_gather", n, 2, 1e-3) for n in (4e3, 1e6, 4e6)]
    link = fit_link(flat)
    assert link.latency_s > 0 and math.isfinite(link.bandwidth_bytes_per_s)
    assert link.bandwidth_bytes_per_s > 0
    # times falling with size (noise): latency is floored, bandwidth stays positive
    falling = [CollectiveSample("all_reduce", n, 2, t) for n, t in ((4e3, 2e-3), (4e6, 1e-3))]
    link = fit_link(falling)
    assert link.latency_s > 0 and link.bandwidth_bytes_per_s > 0


def test_collective_links_override_only_their_collective_and_scope(tmp_path) -> None:
    plain = Devices(world_size=4, ranks_per_node=2)
    own = {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-3}
    measured = Devices(world_size=4, ranks_per_node=2,
                       collective_links={"intra_node.all_gather": own})
    n = 8 * 2**20
    # the intra-node all-gather runs at its own figures, in closed form
    assert collective_time_s("all_gather", n, measured, group_size=2) == pytest.approx(
        (2 - 1) / 2 * n / 1e9 + (2 - 1) * 1e-3)
    assert group_link(measured, "all_gather", group_size=2) == Link(1e9, 1e-3)
    # every other collective at the scope's figures
    for collective, size in (("reduce_scatter", 2), ("all_reduce", 2), ("reduce_scatter", 4)):
        assert collective_time_s(collective, n, measured, group_size=size) == (
            collective_time_s(collective, n, plain, group_size=size))
    # the all-gather across nodes runs through the node's links at their own figures
    assert group_link(measured, "all_gather", group_size=4) == Link(
        min(1e9, 2 * plain.inter_node_bandwidth_bytes_per_s),
        (2 * 1e-3 + 1 * plain.inter_node_latency_s) / 3)
    measured.to_json(tmp_path / "devices.json")
    assert Devices.from_json(tmp_path / "devices.json") == measured


@pytest.mark.parametrize("links, match", [
    ({"intra_node.broadcast": {"bandwidth_bytes_per_s": 1e9, "latency_s": 0.0}},
     "unknown key 'intra_node.broadcast'"),
    ({"intra_node.all_gather": {"bandwidth_bytes_per_s": 0.0, "latency_s": 0.0}},
     "positive bytes/s"),
    ({"inter_node.all_reduce": {"bandwidth_bytes_per_s": 1e9}}, "non-negative seconds"),
])
def test_collective_links_are_checked(links, match) -> None:
    with pytest.raises(InputError, match=match):
        Devices(collective_links=links)




TIMED = {"group_size": 2, "total_bytes": [2**12, 2**20, 2**24], "seconds": [1e-3, 2e-3, 18e-3]}


def test_timed_sizes_price_their_collective_on_the_polyline_between_them(tmp_path) -> None:
    """A collective with measured times (``collective_times``) costs, over a group of the size
    it was timed on, each timed size's time; between two, the time on the straight line
    between them; below the first, on the line from its link figures' fixed cost; past the
    last, at the rate of the last two. Its all-reduce parts add up to the same time."""
    link = {"bandwidth_bytes_per_s": 1e9, "latency_s": 4e-4}
    devices = Devices(world_size=4, ranks_per_node=2,
                      collective_links={"intra_node.all_gather": link},
                      collective_times={"intra_node.all_gather": TIMED,
                                        "intra_node.all_reduce": TIMED})
    plain = dataclasses.replace(devices, collective_times={})
    for n, t in zip(TIMED["total_bytes"], TIMED["seconds"]):
        assert collective_time_s("all_gather", n, devices, group_size=2) == pytest.approx(t)
    middle = (2**20 + 2**24) / 2
    assert collective_time_s("all_gather", middle, devices, group_size=2) == pytest.approx(10e-3)
    # the fixed cost: the line's time at 0 bytes, one ring step's latency over 2 ranks
    assert collective_time_s("all_gather", 0, devices, group_size=2) == pytest.approx(4e-4)
    assert collective_time_s("all_gather", 2**11, devices, group_size=2) == pytest.approx(7e-4)
    rate = 16e-3 / (2**24 - 2**20)
    assert collective_time_s("all_gather", 2**25, devices, group_size=2) == pytest.approx(
        18e-3 + rate * 2**24)
    # the all-reduce's parts: the fixed cost it starts from and the mean rate above it
    per_byte, latency = all_reduce_parts_s(middle, devices, group_size=2)
    assert latency == pytest.approx(plain.intra_node_latency_s * 2)
    assert per_byte * middle + latency == pytest.approx(10e-3)
    assert collective_time_s("all_reduce", middle, devices, group_size=2) == pytest.approx(10e-3)
    # over a group of another size, and for a collective without times, the link figures
    for collective, size in (("all_gather", 4), ("reduce_scatter", 2), ("all_reduce", 4)):
        assert collective_time_s(collective, middle, devices, group_size=size) == (
            collective_time_s(collective, middle, plain, group_size=size))
    devices.to_json(tmp_path / "devices.json")
    assert Devices.from_json(tmp_path / "devices.json") == devices
    assert hash(Devices.from_json(tmp_path / "devices.json")) == hash(devices)


def test_timed_sizes_of_each_scope_price_its_groups() -> None:
    """The times of a scope price the groups the link figures of that scope would: the node's
    ranks (``intra_node``), one rank per node (``inter_node``), the whole world's ring across
    nodes (``world``)."""
    times = {f"{scope}.all_gather": dict(TIMED, group_size=size, seconds=[
        t * factor for t in TIMED["seconds"]])
        for scope, size, factor in (("intra_node", 2, 1), ("inter_node", 2, 2), ("world", 4, 3))}
    devices = Devices(world_size=4, ranks_per_node=2, collective_times=times)
    n = 2**20
    assert collective_time_s("all_gather", n, devices, group_size=2) == pytest.approx(2e-3)
    assert collective_time_s("all_gather", n, devices, group_size=2,
                             spans_nodes=True) == pytest.approx(4e-3)
    assert collective_time_s("all_gather", n, devices) == pytest.approx(6e-3)


@pytest.mark.parametrize("table, match", [
    ({"group_size": 2, "total_bytes": [1, 2], "seconds": [2e-3, 1e-3]}, "none below"),
    ({"group_size": 2, "total_bytes": [2, 1], "seconds": [1e-3, 2e-3]}, "increasing"),
    ({"group_size": 1, "total_bytes": [1, 2], "seconds": [1e-3, 2e-3]}, "2 or more"),
    ({"group_size": 2, "total_bytes": [1], "seconds": [1e-3]}, "increasing"),
    ({"group_size": 2, "total_bytes": [1, 2], "seconds": [1e-3]}, "as many"),
    ({"total_bytes": [1, 2], "seconds": [1e-3, 2e-3]}, "group_size"),
])
def test_collective_times_are_checked(table, match) -> None:
    with pytest.raises(InputError, match=match):
        Devices(collective_times={"intra_node.all_gather": table})
    with pytest.raises(InputError, match="unknown key 'node.all_gather'"):
        Devices(collective_times={"node.all_gather": TIMED})

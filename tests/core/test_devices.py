"""Devices (osdp_fx/core/devices.py): the record of the hardware a plan is made for. Its JSON
round trip, the checks of every figure (errors name the field and the fix), the hash the cost
models key their caches by, and the figures it derives. Presets: tests/core/test_presets.py;
detection: tests/planner/test_detect.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from osdp_fx.core.devices import DEFAULT_CPU_MEMORY_BYTES, Devices, device_memory_bytes
from osdp_fx.core.presets import GPU_MEMORY_MARGIN
from osdp_fx.errors import InputError

LINK = {"bandwidth_bytes_per_s": 2e9, "latency_s": 1e-5}


def test_json_round_trip(tmp_path: Path) -> None:
    devices = Devices(world_size=8, ranks_per_node=4, memory_bytes="16GiB",
                      inter_node_latency_s=2e-5)
    devices.to_json(tmp_path / "devices.json")
    assert Devices.from_json(tmp_path / "devices.json") == devices


def test_json_holds_every_field_and_a_partial_file_keeps_the_defaults(tmp_path: Path) -> None:
    devices = Devices(world_size=2, collective_links={"intra_node.all_gather": LINK},
                      optimizer_element_time_s={"adamw": 1e-9},
                      compute_flops_per_s_by_dtype={"bfloat16": 4e11}, source="detected")
    path = tmp_path / "devices.json"
    devices.to_json(path)
    data = json.loads(path.read_text())
    assert set(data) == {f.name for f in dataclasses.fields(Devices)}
    assert data["collective_links"] == {"intra_node.all_gather": LINK}
    assert Devices.from_json(path) == devices
    path.write_text(json.dumps({"world_size": 4, "memory_bytes": "1GiB"}))
    assert Devices.from_json(path) == Devices(world_size=4, memory_bytes=2**30)


def test_json_errors_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"world_size": 2, "gpus": 8}))
    with pytest.raises(InputError, match=r"unknown keys \['gpus'\]"):
        Devices.from_json(path)
    path.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        Devices.from_json(path)
    with pytest.raises(InputError, match="cannot read"):
        Devices.from_json(tmp_path / "missing.json")
    path.write_text("[1, 2]")
    with pytest.raises(InputError, match="must hold a JSON object with keys among world_size"):
        Devices.from_json(path)


def test_memory_margin_is_a_share_of_the_limit(tmp_path: Path) -> None:
    assert Devices().memory_margin == 0.03
    assert Devices.preset("a100-sxm-40gb-8x").memory_margin == GPU_MEMORY_MARGIN == 0.12
    devices = Devices(memory_margin=0.1)
    devices.to_json(tmp_path / "devices.json")
    assert Devices.from_json(tmp_path / "devices.json").memory_margin == 0.1
    for bad in (1.0, -0.01, "3%", True):
        with pytest.raises(InputError, match=r"memory_margin=.* is not a share of the memory"):
            Devices(memory_margin=bad)


def test_devices_whose_nodes_do_not_divide_the_world():
    with pytest.raises(InputError, match="ranks_per_node=3 must divide world_size=4"):
        Devices(world_size=4, ranks_per_node=3)


@pytest.mark.parametrize(("fields", "message"), [
    ({"world_size": 0}, "world_size must be a positive int, got 0"),
    ({"world_size": 2.0}, "world_size must be a positive int, got 2.0"),
    ({"world_size": True}, "world_size must be a positive int, got True"),
    ({"ranks_per_node": 0}, "ranks_per_node=0 must divide"),
    ({"world_size": 5, "ranks_per_node": 2.5}, "ranks_per_node=2.5 must divide"),
    ({"compute_flops_per_s": 0}, "compute_flops_per_s must be a positive, finite number"),
    ({"memory_bandwidth_bytes_per_s": float("nan")}, "memory_bandwidth_bytes_per_s must be"),
    ({"inter_node_bandwidth_bytes_per_s": -1e9}, "inter_node_bandwidth_bytes_per_s must be"),
    ({"intra_node_latency_s": -1e-6}, "intra_node_latency_s must be a non-negative"),
    ({"selective_op_time_s": "1ms"}, "selective_op_time_s must be a non-negative"),
    ({"concurrent_collective_ratio": 0.4}, r"concurrent_collective_ratio must be in \[0.5, 1\]"),
    ({"concurrent_collective_ratio": 1.2}, r"concurrent_collective_ratio must be in \[0.5, 1\]"),
    ({"concurrent_collective_ratios": {"total_bytes": [1024], "ratios": [0.4]}},
     r"concurrent_collective_ratios must be .*ratios in \[0.5, 1\]"),
    ({"concurrent_collective_ratios": {"total_bytes": [4096, 1024], "ratios": [1.0, 0.8]}},
     "increasing positive sizes"),
    ({"concurrent_collective_ratios": {"total_bytes": [1024]}}, "concurrent_collective_ratios"),
    ({"overlap_efficiency": -0.1}, r"overlap_efficiency must be in \[0, 1\]"),
    ({"overlap_efficiency": 1.5}, r"overlap_efficiency must be in \[0, 1\]"),
    ({"overlap_hides_latency": 0}, "overlap_hides_latency must be True or False"),
    ({"memory_bytes": "lots"}, "'lots' is not a byte quantity"),
    ({"collective_links": {"intra_node.broadcast": LINK}},
     "unknown key 'intra_node.broadcast'.*e.g. 'intra_node.all_gather'"),
    ({"collective_links": {"inter_node.all_reduce": {"bandwidth_bytes_per_s": 0.0,
                                                     "latency_s": 0.0}}},
     r"collective_links\['inter_node.all_reduce'\].*positive bytes/s"),
    ({"collective_links": {"inter_node.all_reduce": {"bandwidth_bytes_per_s": 1e9}}},
     "non-negative seconds"),
    ({"optimizer_element_time_s": {"lion": 1e-9}}, "optimizer_element_time_s has invalid "
                                                  "entries.*optimizer kinds"),
    ({"optimizer_tensor_time_s": {"adam": -1.0}}, "optimizer_tensor_time_s has invalid"),
    ({"compute_flops_per_s_by_dtype": {"bfloat16": 0.0}}, "positive FLOP/s"),
    ({"compute_flops_per_s_by_dtype": {"int8": 1e12}}, "dtype names"),
])
def test_invalid_figures_name_the_field(fields, message):
    with pytest.raises(InputError, match=message):
        Devices(**fields)


def test_derived_figures():
    assert Devices(memory_bytes="1.5 KiB").memory_bytes == 1536
    assert Devices(world_size=16, ranks_per_node=8).num_nodes == 2
    assert Devices(world_size=16).num_nodes == 1
    devices = Devices(compute_flops_per_s=1e12, compute_flops_per_s_by_dtype={"bfloat16": 4e12})
    assert devices.flops_per_s("bfloat16") == 4e12
    assert devices.flops_per_s("float32") == devices.flops_per_s() == 1e12
    assert device_memory_bytes("cpu") == device_memory_bytes(None) == DEFAULT_CPU_MEMORY_BYTES


def test_equal_figures_hash_alike_and_any_figure_changes_the_hash():
    """The cost models key their caches by a Devices: dict fields count by value."""
    a = Devices(world_size=4, optimizer_element_time_s={"sgd": 1e-9, "adam": 2e-9})
    b = Devices(world_size=4, optimizer_element_time_s={"adam": 2e-9, "sgd": 1e-9})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    c = dataclasses.replace(a, optimizer_element_time_s={"sgd": 1e-9, "adam": 3e-9})
    assert a != c and hash(a) != hash(c)
    assert hash(dataclasses.replace(a, memory_margin=0.05)) != hash(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.world_size = 8  # type: ignore[misc]


def test_a_collective_runs_beside_others_at_the_ratio_of_its_size() -> None:
    """``Devices.concurrent_ratio``: the table's ratio at a timed size, on the line in the
    logarithm of the size between two, the end ratios outside; the single ratio without a
    table; the least of them bounds what collectives together save."""
    table = {"total_bytes": [2**16, 2**20, 2**22], "ratios": [1.0, 0.8, 0.9]}
    devices = Devices(world_size=2, concurrent_collective_ratio=0.85,
                      concurrent_collective_ratios=table)
    assert devices.concurrent_ratio(2**16) == 1.0 and devices.concurrent_ratio(2**20) == 0.8
    assert devices.concurrent_ratio(2**18) == pytest.approx(0.9)  # halfway in log size
    assert devices.concurrent_ratio(2**21) == pytest.approx(0.85)
    assert devices.concurrent_ratio(100) == 1.0 and devices.concurrent_ratio(2**30) == 0.9
    assert devices.least_concurrent_ratio == 0.8
    assert Devices(world_size=2, concurrent_collective_ratio=0.85).concurrent_ratio(2**16) == 0.85
    assert Devices(concurrent_collective_ratio=0.7).least_concurrent_ratio == 0.7

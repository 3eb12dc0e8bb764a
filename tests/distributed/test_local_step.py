"""[Note: local optimizer steps] torch's elementwise optimizers step the compiled module's
DTensor parameters over their local tensors: bitwise the step over the DTensors, the same state
(DTensors of the parameters' placements), and the DTensor step wherever the view would not be
elementwise."""

from __future__ import annotations

import pytest
import torch
from harness import local_step_cases
from test_parity import mixed_plan_file, split_plan_file

ALL = list(local_step_cases.OPTIMIZERS)


def _assert_same(local: dict, dtensors: dict) -> None:
    assert local["dtensor_params"] > 0
    for name, value in dtensors["params"].items():
        torch.testing.assert_close(local["params"][name], value, rtol=0, atol=0, msg=name)
    assert local["state"].keys() == dtensors["state"].keys()
    for key, (kind, placements, value) in dtensors["state"].items():
        got = local["state"][key]
        assert got[:2] == (kind, placements), key
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[2], value, rtol=0, atol=0, msg=str(key))
        else:
            assert got[2] == value, key
    assert local["groups"] == dtensors["groups"]


@pytest.mark.parametrize("plan", ["full_shard", "mixed"])
def test_elementwise_optimizers_step_local_tensors_bitwise_like_dtensors(worlds, tmp_path, plan):
    """Every elementwise optimizer, three steps at world 2: under full_shard, and under a plan
    that mixes the strategies (its replicated groups ``Replicate()`` DTensors)."""
    if plan == "mixed":
        plan = mixed_plan_file("gpt", tmp_path)
    results = worlds(2).run(local_step_cases.local_against_dtensor_steps, model="gpt",
                            plan=plan, optimizers=ALL)
    for r in results:
        for name in ALL:
            _assert_same(r[name]["local"], r[name]["dtensors"])


def test_split_weights_step_local_tensors_bitwise_like_dtensors(worlds, tmp_path):
    """Split weights (a parameter whose local tensor holds its parts' data, in mixed
    strategies)."""
    results = worlds(2).run(local_step_cases.local_against_dtensor_steps, model="gpt",
                            plan=split_plan_file("gpt", tmp_path), optimizers=["adamw", "sgd"])
    for r in results:
        for name in ("adamw", "sgd"):
            _assert_same(r[name]["local"], r[name]["dtensors"])


def test_state_dict_of_local_steps_loads_and_steps_alike(worlds):
    results = worlds(2).run(local_step_cases.state_dict_round_trip, model="gpt",
                            plan="full_shard")
    for r in results:
        assert r["moved"] and r["state_types"] == ["DTensor", "Tensor"]
        for name, value in r["first"].items():
            torch.testing.assert_close(r["second"][name], value, rtol=0, atol=0, msg=name)


def test_the_step_runs_over_dtensors_where_the_view_would_not_be_elementwise(worlds):
    """A subclass, a closure and ``over_dtensors()`` step over the DTensors, and so does an
    FSDP2 module's optimizer: only the compiled module's parameters are marked."""
    results = worlds(2).run(local_step_cases.steps_over, model="gpt", plan="full_shard")
    for r in results:
        assert r["adamw"]["seen"] == ["Tensor"]
        for name in ("subclass", "closure", "over_dtensors", "fsdp2"):
            assert r[name]["seen"] == ["DTensor"], name
        for name in ("adamw", "subclass", "closure", "over_dtensors"):
            # the state as torch makes it over DTensors, whichever way it stepped
            assert r[name]["state"] == ["DTensor", "Tensor"], (name, r[name]["state"])

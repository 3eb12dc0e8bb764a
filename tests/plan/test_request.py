"""``plan=`` is read once into a PlanRequest: a plan file is opened once, checked at once."""

from __future__ import annotations

import json

import pytest
import torch

from osdp_fx.errors import PlanError
from osdp_fx.examples import MLP
from osdp_fx.passes.capture import capture
from osdp_fx.plan.request import PlanRequest, resolve_plan
from osdp_fx.planner.make import param_specs


def _specs():
    torch.manual_seed(0)
    model = MLP((8, 16, 4))
    return param_specs(capture(model, (torch.randn(2, 8),)))


def test_a_plan_file_is_read_once(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({
        "format": "osdp-fx-plan", "version": 1, "default": "full_shard",
        "params": {"layers.0.weight": "replicate"},
        "mixed_precision": {"param_dtype": "bfloat16"}}))
    request = PlanRequest.parse(str(path))
    path.unlink()  # everything after the parse reads the request, not the file
    assert request.kind == "file" and request.splits == {}
    assert request.precision == ("bfloat16", "float32")
    plan = resolve_plan(request, _specs(), world_size=2)
    assert plan["layers.0.weight"].strategy == "replicate"
    assert plan["layers.1.weight"].strategy == "full_shard"
    assert plan.source == f"file:{path}"


@pytest.mark.parametrize("spec, kind", [(None, "search"), ("full_shard", "uniform")])
def test_names_and_search(spec, kind):
    assert PlanRequest.parse(spec).kind == kind


def test_a_malformed_file_fails_when_parsed(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "params": {},
                                "splits": {"fc.weight": "four"}}))
    with pytest.raises(PlanError, match="splits"):
        PlanRequest.parse(str(path))
    with pytest.raises(PlanError, match="unknown strategy 'fully_shard'"):
        PlanRequest.parse("fully_shard")

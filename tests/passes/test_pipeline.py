"""The pass pipeline (osdp_fx/passes/pipeline.py): every pass is a ``GraphPass`` with a contract,
run by ``run_pipeline`` in the declared order, which the graph keeps across calls."""

from __future__ import annotations

import copy
import importlib
import pkgutil

import pytest
import torch
from torch import fx, nn

import osdp_fx.passes
from osdp_fx.errors import OSDPError
from osdp_fx.examples import MLP
from osdp_fx.passes.aliases import AnnotateAliases
from osdp_fx.passes.capture import capture
from osdp_fx.passes.pipeline import (
    PIPELINE,
    GraphPass,
    PassContractError,
    PassFailed,
    history,
    properties,
    run_pipeline,
)
from osdp_fx.passes.precision import CastParams
from osdp_fx.passes.profile import ProfileGraph, SlowestRankTimes
from osdp_fx.passes.recompute import RecomputeRegions
from osdp_fx.passes.shard import ShardParameters
from osdp_fx.passes.split_linear import SplitLinear
from osdp_fx.plan.request import resolve_plan
from osdp_fx.planner.analysis import param_specs

SPLIT = {"layers.0.weight": 2}


def _captured():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    return capture(MLP((8, 16, 4)), (x,)), (x,)


def _ran(gm: fx.GraphModule) -> list[str]:
    return [r.name for r in history(gm)]


def test_passes_record_what_they_ensure_and_take_away():
    captured, inputs = _captured()
    gm = captured.gm
    assert properties(gm) == {"normalized"}
    run_pipeline(gm, [ProfileGraph(inputs, fake=True), SlowestRankTimes()])
    assert properties(gm) == {"normalized", "profiled", "slowest_rank_times"}
    run_pipeline(gm, [CastParams(torch.bfloat16)])  # the graph changed: its profile is gone
    assert properties(gm) == {"normalized", "cast"}
    assert _ran(gm) == ["profile", "slowest_rank_times", "cast_params"]


def test_the_planner_profiles_again_after_a_split():
    captured, inputs = _captured()
    gm = captured.gm
    run_pipeline(gm, [CastParams(torch.bfloat16), ProfileGraph(inputs, fake=True)])
    run_pipeline(gm, [SplitLinear(SPLIT)])  # takes the profile away: profiled again
    run_pipeline(gm, [ProfileGraph(inputs, fake=True)])
    assert properties(gm) == {"normalized", "cast", "split", "profiled"}


def test_a_plan_files_splits_come_before_the_cast():
    captured, inputs = _captured()
    run_pipeline(captured.gm, [SplitLinear(SPLIT), CastParams(torch.bfloat16),
                               ProfileGraph(inputs, fake=True)])  # the two commute
    assert _ran(captured.gm) == ["split_linear", "cast_params", "profile"]


def test_a_pass_out_of_order_is_refused_across_calls():
    captured, inputs = _captured()
    gm = captured.gm
    run_pipeline(gm, [AnnotateAliases(inputs)])
    with pytest.raises(PassContractError,
                       match=r"pass 'profile' comes before \['annotate_aliases'\]"):
        run_pipeline(gm, [ProfileGraph(inputs, fake=True)])
    with pytest.raises(PassContractError, match="pass 'split_linear' comes before"):
        run_pipeline(gm, [SplitLinear(SPLIT)])
    assert _ran(gm) == ["annotate_aliases"]  # neither ran


def test_a_missing_requirement_is_a_contract_error_naming_the_pass():
    traced = fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))  # not captured: not normalised
    with pytest.raises(PassContractError,
                       match=r"pass 'cast_params' requires a graph that is \['normalized'\]"):
        run_pipeline(traced, [CastParams(torch.bfloat16)])
    captured, _ = _captured()
    with pytest.raises(PassContractError, match=r"'slowest_rank_times' requires .*\['profiled'\]"):
        run_pipeline(captured.gm, [SlowestRankTimes()])


def test_shard_comes_last_and_shards_copies_of_the_graph():
    captured, inputs = _captured()
    plan = resolve_plan("full_shard", param_specs(captured), world_size=2)
    gm = captured.gm
    with pytest.raises(PassContractError, match=r"'shard' requires .*\['aliases'\]"):
        run_pipeline(copy.deepcopy(gm), [ShardParameters(plan, rank=0)])
    run_pipeline(gm, [AnnotateAliases(inputs)])
    trial = copy.deepcopy(gm)  # autotuning's copy: its meta, the pipeline's state, copied
    run_pipeline(trial, [ShardParameters(plan, rank=0)])
    assert "sharded" in properties(trial) and "sharded" not in properties(gm)
    for late in (ProfileGraph(inputs, fake=True), SplitLinear(SPLIT), AnnotateAliases(inputs)):
        with pytest.raises(PassContractError, match=rf"'{late.name}' comes before \[.*'shard'\]"):
            run_pipeline(trial, [late])
    run_pipeline(gm, [ShardParameters(plan, rank=0)])  # then the graph itself
    assert _ran(gm)[-2:] == ["annotate_aliases", "shard"]


def test_a_failure_is_wrapped_with_the_pass_name_and_a_user_error_passes_through():
    captured, _ = _captured()
    with pytest.raises(PassFailed, match="pass 'annotate_aliases' failed"):
        run_pipeline(captured.gm, [AnnotateAliases(())])  # no inputs to run the graph on
    with pytest.raises(OSDPError, match="regions the model does not have"):
        run_pipeline(captured.gm, [RecomputeRegions({"no_such_region": "full"})])
    assert properties(captured.gm) == {"normalized"} and _ran(captured.gm) == []


def test_passes_are_skipped_by_name():
    captured, inputs = _captured()
    run_pipeline(captured.gm, [CastParams(torch.bfloat16), ProfileGraph(inputs, fake=True)],
                 skip={"cast_params"})
    assert _ran(captured.gm) == ["profile"]


def test_the_declared_pipeline_covers_every_pass_class_in_an_order_of_needs():
    for info in pkgutil.iter_modules(osdp_fx.passes.__path__):
        importlib.import_module(f"osdp_fx.passes.{info.name}")
    classes = GraphPass.__subclasses__()
    assert sorted(c.name for c in classes) == sorted(PIPELINE)
    seen = {"normalized"}
    for cls in sorted(classes, key=lambda c: PIPELINE.index(c.name)):
        assert cls.required <= seen, cls.name
        seen |= cls.ensured
    with pytest.raises(PassContractError, match="'made_up'.*is not in the declared PIPELINE"):
        type("MadeUp", (GraphPass,), {}, name="made_up")

"""The declared pass list: every pass runs through the pass manager (``run_passes``), which
keeps the pipeline's order and checks what each pass requires."""

from __future__ import annotations

import pytest
import torch

from osdp_fx.examples import MLP
from osdp_fx.passes.capture import capture
from osdp_fx.passes.manager import PIPELINE, properties, run_passes
from osdp_fx.passes.precision import cast_params_pass
from osdp_fx.passes.profile import profile_graph_pass


def _captured():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    return capture(MLP((8, 16, 4)), (x,)), x


def test_capture_normalises_and_passes_record_what_they_ensure():
    captured, x = _captured()
    gm = captured.gm
    assert properties(gm) == {"normalized"}
    run_passes(gm, [("profile", lambda g: profile_graph_pass(g, (x,), fake=True))])
    assert properties(gm) == {"normalized", "profiled"}
    # casting changes the graph: what was profiled no longer holds
    run_passes(gm, [("cast_params", lambda g: cast_params_pass(g, torch.bfloat16))])
    assert properties(gm) == {"normalized", "cast"}


def test_a_pass_whose_requirements_are_missing_is_refused():
    captured, _ = _captured()
    with pytest.raises(AssertionError, match="requires a graph that is"):
        run_passes(captured.gm, [("slowest_rank_times", lambda g: None)])  # not profiled
    with pytest.raises(AssertionError, match="not in the declared PIPELINE"):
        run_passes(captured.gm, [("made_up", lambda g: None)])


def test_passes_out_of_the_pipelines_order_are_refused():
    captured, x = _captured()
    profile = ("profile", lambda g: profile_graph_pass(g, (x,), fake=True))
    cast = ("cast_params", lambda g: cast_params_pass(g, torch.bfloat16))
    with pytest.raises(AssertionError, match="the PIPELINE runs it before"):
        run_passes(captured.gm, [profile, cast])
    assert properties(captured.gm) == {"normalized", "profiled"}  # what ran before is kept
    run_passes(captured.gm, [cast, profile])
    assert properties(captured.gm) == {"normalized", "cast", "profiled"}


def test_the_pipeline_is_ordered_by_what_each_pass_needs():
    seen = {"normalized"}
    for spec in PIPELINE:
        assert spec.requires <= seen, spec.name
        seen |= spec.ensures

"""Recomputed regions train like single-process training, reuse backward's re-gather, and draw
the same dropout masks as without recomputation (world 2, gloo)."""

from __future__ import annotations

import pytest
import torch
from harness import cases, recompute_cases

BLOCKS = {"gpt": ("blocks.0", "blocks.1"), "hf_gpt2": ("transformer.h.0", "transformer.h.1")}
POLICIES = {
    "full": ("full", "full"),
    "selective": ("selective", "selective"),
    "one_block": ("full", "save"),
    "mixed": ("selective", "full"),
}


def _recompute(model: str, policies: str) -> dict[str, str]:
    return dict(zip(BLOCKS[model], POLICIES[policies]))


@pytest.mark.parametrize("strategy", ["replicate", "shard_grad_op", "full_shard", "mixed"])
@pytest.mark.parametrize("policies", list(POLICIES))
def test_recompute_matches_single_process(worlds, tmp_path, strategy, policies):
    plan = recompute_cases.plan_file("gpt", tmp_path / "plan.json", strategy,
                                     _recompute("gpt", policies))
    results = worlds(2).run(recompute_cases.train, model="gpt", plan=plan)
    cases.assert_matches_single_process(results, "gpt", 2)
    wrapped = [r for r, p in _recompute("gpt", policies).items() if p != "save"]
    assert results[0]["plan"]["recompute"] == {r: p for r, p in _recompute("gpt", policies).items()
                                               if p != "save"}
    for region in wrapped:  # visible in the printed graph
        assert f"self.recompute_{region.replace('.', '_')}(" in results[0]["code"]


@pytest.mark.parametrize("strategy", ["full_shard", "mixed"])
def test_recompute_runs_no_second_all_gather(worlds, tmp_path, strategy):
    saved = recompute_cases.plan_file("gpt", tmp_path / "save.json", strategy, {})
    full = recompute_cases.plan_file("gpt", tmp_path / "full.json", strategy,
                                     _recompute("gpt", "full"))
    base = worlds(2).run(recompute_cases.train, model="gpt", plan=saved, steps=2)
    recomputed = worlds(2).run(recompute_cases.train, model="gpt", plan=full, steps=2)
    for (fwd, bwd), (fwd_re, bwd_re) in zip(base[0]["gathers"], recomputed[0]["gathers"]):
        # forward gathers the same; backward gathers each parameter at most once, with or
        # without recomputation, and every parameter it re-gathers without recomputation it
        # re-gathers once with it (recomputation also needs the parameters backward alone does
        # not, such as biases: once each)
        assert fwd_re == fwd
        bwd.pop("collectives"), bwd_re.pop("collectives")
        assert bwd and max(bwd.values()) == 1 and max(bwd_re.values()) == 1
        assert set(bwd) <= set(bwd_re)


@pytest.mark.parametrize("policies", ["full", "selective"])
def test_dropout_recomputes_the_same_masks(worlds, tmp_path, policies):
    """hf_gpt2 with dropout: a plan with recomputation trains exactly as the same plan without
    it (same seeds), so recomputation drew the masks forward drew."""
    kwargs = dict(model="hf_gpt2_dropout", train_mode_seed=7)
    saved = recompute_cases.plan_file("hf_gpt2_dropout", tmp_path / "s.json", "mixed", {})
    redo = recompute_cases.plan_file("hf_gpt2_dropout", tmp_path / "r.json", "mixed",
                                     _recompute("hf_gpt2", policies))
    base = worlds(2).run(recompute_cases.train, plan=saved, **kwargs)
    got = worlds(2).run(recompute_cases.train, plan=redo, **kwargs)
    for b, g in zip(base, got):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(b["losses"]),
                                   atol=1e-5, rtol=0)
        for key, expected in b["state"].items():
            torch.testing.assert_close(g["state"][key], expected, atol=1e-4, rtol=0, msg=key)
    assert "self.recompute_transformer_h_0(" in got[0]["code"]

"""The memory promise holds for plans that recompute: the independent storage tracker
(``osdp_fx/runtime/storage_tracker.py``) measures within 5 % of the predicted peak for a plan searched
under a limit below the all-full_shard peak, which measures under its limit, and at most 0.5 %
under the prediction (never over it) for hand-written plans (selective and full, under
replicate and full_shard)."""

from __future__ import annotations

import json

import pytest
from harness import memory_cases

from osdp_fx.planner.analysis import MEMORY_MARGIN

TOLERANCE = 0.05
REGIONS = ("model.blocks.0", "model.blocks.1")


def _plan(tmp_path, strategy: str, policy: str) -> str:
    path = tmp_path / f"{strategy}-{policy}.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": strategy,
                                "params": {}, "recompute": {r: policy for r in REGIONS}}))
    return str(path)


def _errors(runs: list[dict]) -> list[float]:
    return [peak / r["steady"] - 1 for r in runs for _, peak in r["measured"][1:]]


@pytest.mark.parametrize("strategy,policy", [("full_shard", "full"), ("full_shard", "selective"),
                                             ("replicate", "selective"), ("replicate", "full")])
def test_recompute_plans_keep_the_memory_promise(worlds, tmp_path, strategy, policy):
    runs = worlds(2).run(memory_cases.compile_and_steps, model="gpt",
                         plan=_plan(tmp_path, strategy, policy), steps=3)
    errors = _errors(runs)
    assert max(map(abs, errors)) <= TOLERANCE, (errors, runs[0]["breakdown"], runs[0]["peak_at"])
    assert -0.005 <= min(errors) and max(errors) <= 0, errors  # from above, closely


def test_searched_plan_recomputes_below_the_full_shard_peak(worlds, tmp_path):
    world = worlds(2)
    low = world.run(memory_cases.compile_and_steps, model="gpt", plan="full_shard", steps=2)
    redo = world.run(memory_cases.compile_and_steps, model="gpt", steps=2,
                     plan=_plan(tmp_path, "full_shard", "full"))
    limit = int(redo[0]["steady"] / (1 - MEMORY_MARGIN)) + 1  # the recomputing plan fits
    assert limit < low[0]["steady"]  # below the all-full_shard peak
    runs = world.run(memory_cases.compile_and_steps, model="gpt", limit=limit, steps=3)
    errors = _errors(runs)
    assert max(map(abs, errors)) <= TOLERANCE, (errors, runs[0]["breakdown"])
    # on the CPU the search plans up to the limit itself (Devices.memory_margin 0): every
    # step fits, the prediction being exact or above
    assert max(peak for r in runs for _, peak in r["measured"]) <= limit, (
        [r["measured"] for r in runs], runs[0]["breakdown"], runs[0]["peak_at"])


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_sharded_gradients_of_a_recomputed_block_are_reduce_scattered_as_they_complete(
        worlds, tmp_path, policy):
    """A recomputed block's all-gathers run before it, so autograd would run their backward
    (which starts each reduce-scatter) after the whole block's: under shard_grad_op the Llama's
    peak measured 1.8 % (full) and 2.1 % (selective) over the prediction, every gradient of the
    block alive at its end. Read through ``grad_ready``, each starts when complete, and the
    peak is predicted from above and closely (``selective``: 64 KiB, 0.6 %, over: the model
    keeps a kept attention's mask from forward, the recomputation re-creates it)."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({
        "format": "osdp-fx-plan", "version": 1, "default": "shard_grad_op", "params": {},
        "recompute": {f"model.model.layers.{i}": policy for i in range(2)}}))
    for rank, r in enumerate(worlds(2).run(memory_cases.compile_and_steps, model="llama",
                                           plan=str(path), steps=3)):
        for _, peak in r["measured"][1:]:
            assert 0.99 * r["steady"] <= peak <= r["steady"], (
                rank, peak, r["steady"], r["peak_at"], r["breakdown"])

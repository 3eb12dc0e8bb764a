"""``torch.compile(compiled)`` trains like the eager compiled module on a real 2-rank gloo world:
every strategy, a split plan, recomputed regions, mixed precision and prefetch, gradient
accumulation with ``no_sync()``.

Most cases compile with ``backend="aot_eager"`` (dynamo and AOT autograd: the regions of compute
between the collectives compiled, forward and backward, without inductor's C++ code generation,
which costs tens of seconds per graph on this CPU); one case runs inductor.
"""

from __future__ import annotations

import json

import pytest
import torch
from harness import compile_cases, models, recompute_cases
from test_parity import split_plan_file

from osdp_fx import Devices

TWO_NODES = Devices(world_size=2, ranks_per_node=1)  # hybrid_shard and hierarchical at world 2


def assert_trains_like_eager(result: dict, *, held_slack_bytes: int = 0) -> None:
    eager, compiled = result["eager"], result["compiled"]
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]),
                               atol=1e-5, rtol=0)
    for key, value in eager["state"].items():
        torch.testing.assert_close(compiled["state"][key], value, atol=1e-5, rtol=0, msg=key)
    assert result["graphs"] >= 1, "dynamo compiled nothing"
    # Freed parameters stay freed under torch.compile: a forward holds no more than eager's.
    assert compiled["held_after_forward"] <= eager["held_after_forward"] + held_slack_bytes, (
        compiled["held_after_forward"], eager["held_after_forward"])


@pytest.mark.parametrize("model,plan,devices", [
    ("gpt", "replicate", None), ("gpt", "shard_grad_op", None), ("gpt", "full_shard", None),
    ("mlp", "hybrid_shard", TWO_NODES), ("mlp", "hierarchical", TWO_NODES)])
def test_every_strategy(worlds, model, plan, devices):
    results = worlds(2).run(compile_cases.train_both, model=model, plan=plan,
                            backend="aot_eager", devices=devices)
    for result in results:
        assert {p["strategy"] for p in result["eager"]["plan"]["params"].values()} == {plan}
        assert_trains_like_eager(result)
        # dynamo compiles each region between two collective calls whole, once, and nothing else
        assert result["graph_breaks"] == 0 and result["graphs"] == result["regions"]
        assert 1 <= result["regions"] <= result["call_sites"] + 1


def test_compute_between_collective_calls_is_one_region_each_and_runs_as_before(monkeypatch,
                                                                                tmp_path):
    """Under torch.compile the graph runs each run of compute between two collective calls as a
    region; run eagerly, that computes what the printed graph computes, before and after the
    regions' way is chosen."""
    from osdp_fx import compile_osdp, module
    from osdp_fx.examples import TinyGPT
    from osdp_fx.runtime import compiled_regions
    from osdp_fx.runtime.compile_support import is_collective_call

    torch.manual_seed(0)  # weights larger than a gather bucket (64 KiB): gathered one by one
    net = TinyGPT(vocab=67, dim=128, depth=2, heads=4, max_seq=16)
    loss_fn = models.build("gpt", 0)[1]
    batch = models.batches("gpt", global_batch=2, steps=1)[0]
    plan = tmp_path / "small_buckets.json"
    plan.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "params": {},
                                "default": "shard_grad_op", "gather_bucket_bytes": 65536}))
    compiled = compile_osdp(net, batch[:1], Devices(world_size=1), plan=str(plan))
    regions = compiled._compiled_regions()
    kinds = ["call" if is_collective_call(n) else
             "region" if n.op == "call_module" and n.target.startswith(compiled_regions.REGION)
             else n.op for n in regions.module.graph.nodes]
    steps = [k for k in kinds if k in ("call", "region", "call_module", "call_method")]
    assert set(steps) == {"call", "region"}, "compute outside the regions"
    assert not any(a == b == "region" for a, b in zip(steps, steps[1:])), "two regions in a row"
    assert kinds.count("region") == len(regions.regions) >= 6
    assert compiled.code == compiled.graph_module.code and compiled_regions.REGION not in compiled.code

    def step() -> tuple[float, dict[str, torch.Tensor]]:
        loss = loss_fn(compiled(*batch[:1]), batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in compiled.named_parameters()}
        compiled.zero_grad()
        return loss.item(), grads

    plain = step()
    monkeypatch.setattr(module, "under_torch_compile", lambda: True)  # the regions, eagerly
    with torch.no_grad():  # evaluation forwards are no trials
        compiled(*batch[:1])
    assert regions.forwards == 0
    for _ in range(compiled_regions.SETTLED_AFTER + 1):
        loss, grads = step()
        assert loss == plain[0]
        for name, grad in plain[1].items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)
    assert regions.decided and "on trial" not in compiled.compiled_regions


def test_regions_run_the_way_they_measured_faster_on_every_rank_alike(worlds):
    """After the trials each region runs compiled or eagerly, the same on every rank, and the
    module trains as eagerly throughout (trials, choice and after). Dynamo compiles the regions'
    bodies and nothing else: not the saved-tensor hooks or frees an eager region calls."""
    from osdp_fx.runtime.compiled_regions import SETTLED_AFTER

    results = worlds(2).run(compile_cases.train_both, model="gpt", plan="full_shard",
                            backend="aot_eager", steps=SETTLED_AFTER + 2, measure_held=False)
    for result in results:
        assert_trains_like_eager(result)
        assert result["graph_breaks"] == 0 and result["graphs"] <= result["regions"]
        assert result["region_modes"] is not None and len(result["region_modes"]) == (
            result["regions"])
        assert set(result["region_modes"]) <= {"compiled", "eager"}
    assert results[0]["region_modes"] == results[1]["region_modes"]


def test_split_plan_with_the_compile_method(worlds, tmp_path):
    results = worlds(2).run(compile_cases.train_both, model="gpt",
                            plan=split_plan_file("gpt", tmp_path), backend="aot_eager",
                            method=True)
    for result in results:
        assert result["eager"]["plan"]["splits"]
        assert_trains_like_eager(result)


@pytest.mark.parametrize("plan", ["full_shard", "shard_grad_op"])
def test_mixed_precision_and_prefetch(worlds, plan):
    results = worlds(2).run(compile_cases.train_both, model="gpt", plan=plan,
                            backend="aot_eager", mixed_precision="bf16", prefetch=2)
    for result in results:
        assert result["eager"]["plan"]["mixed_precision"]["param_dtype"] == "bfloat16"
        assert_trains_like_eager(result)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recomputed_regions(worlds, tmp_path, policy):
    plan = recompute_cases.plan_file("gpt", tmp_path / "plan.json", "full_shard",
                                     {"blocks.0": policy, "blocks.1": policy})
    results = worlds(2).run(compile_cases.train_both, model="gpt", plan=plan,
                            backend="aot_eager", measure_held=policy != "selective")
    for result in results:
        assert result["eager"]["plan"]["recompute"] == {"blocks.0": policy, "blocks.1": policy}
        assert_trains_like_eager(result)


def test_no_sync_accumulation(worlds):
    results = worlds(2).run(compile_cases.train_both, model="gpt", plan="full_shard",
                            backend="aot_eager", accumulate=2)
    for result in results:
        assert_trains_like_eager(result)


def test_inductor_full_shard(worlds):
    results = worlds(2).run(compile_cases.train_both, model="gpt", plan="full_shard",
                            backend="inductor", prefetch=2, timeout_s=900)
    for result in results:
        assert_trains_like_eager(result)

"""The memory promise: what a user measures is what the plan predicted, from the first step.

Measured with ``osdp_fx/runtime/storage_tracker.py``, a tracker written apart from the runtime (it imports only torch): every
storage the process holds (found through the garbage collector's object list on entry, and
every operator's inputs and outputs after), counted at its current size, over the whole step
(forward, backward, ``optimizer.step()``, ``zero_grad()``), from the very first step, without
collecting garbage for the user. World 2, AdamW, a traced GPT and a Hugging Face Llama
(captured by torch.export), every uniform strategy, a mixed plan and searched plans at two
limits; peft's LoRA on that Llama in bf16.
"""

from __future__ import annotations

import json

import pytest
from harness import memory_cases, moe_memory_cases

TOLERANCE = 0.05
UNIFORM = ("replicate", "shard_grad_op", "full_shard")


def _check(r: dict, label: str) -> list[str]:
    """Problems with one rank's run: first three steps against the first-step prediction
    (steps 2 and 3 against the steady state), the last against the steady state, the limit."""
    problems = []
    (_, first), *rest = r["measured"]
    checks = [("step 1", first, r["first_step"])]
    checks += [(f"step {i + 2}", peak, r["steady"]) for i, (_, peak) in enumerate(rest)]
    for what, measured, predicted in checks:
        error = measured / predicted - 1
        if abs(error) > TOLERANCE:
            problems.append(f"{label} {what}: measured {measured} B, predicted {predicted} B "
                            f"({error:+.1%}; peak at {r['peak_at']}: {r['breakdown']})")
    if r["limit"] is not None and max(p for _, p in r["measured"]) > r["limit"]:
        problems.append(f"{label}: measured {max(p for _, p in r['measured'])} B over the "
                        f"limit {r['limit']} B")
    starts = [s for s, _ in r["measured"][1:]]
    if max(starts) != min(starts):
        problems.append(f"{label}: memory held between steps changes: {starts}")
    if r["cycle_bytes"] or r["stray"]:
        problems.append(f"{label}: compile left {r['cycle_bytes']} B of tensors in cycles and "
                        f"holds {r['stray'][:5]}")
    return problems


def _mixed_plan(model: str, path) -> str:
    """Every parameter group under replicate, shard_grad_op and full_shard in turn."""
    names = [n for n, _ in memory_cases.build(model, device="meta").named_parameters()]
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "params": {
        n: UNIFORM[i % 3] for i, n in enumerate(names)}}))
    return str(path)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_measured_peaks_match_the_prediction_from_the_first_step(worlds, model, tmp_path):
    world = worlds(2)
    results = {plan: world.run(memory_cases.compile_and_steps, model=model, plan=plan)
               for plan in UNIFORM}
    results["mixed"] = world.run(memory_cases.compile_and_steps, model=model,
                                 plan=_mixed_plan(model, tmp_path / "mixed.json"))
    low = results["full_shard"][0]["steady"]
    high = results["replicate"][0]["steady"]
    assert low < high
    for k in (1, 2):  # searched plans at a third and two thirds of the way between
        limit = low + (high - low) * k // 3
        run = world.run(memory_cases.compile_and_steps, model=model, limit=limit)
        # it shards something, or recomputes blocks of a replicated model
        assert (sum(run[0]["counts"].values()) > run[0]["counts"]["replicate"]
                or run[0]["recompute"]), run[0]["counts"]
        results[f"searched @ {limit} B"] = run
    problems = [p for label, runs in results.items() for rank, r in enumerate(runs)
                for p in _check(r, f"{label} rank {rank}")]
    assert not problems, "\n".join(problems)


def test_the_promise_holds_for_a_peft_lora_fine_tune(worlds):
    """peft's LoRA on a Hugging Face Llama, its base frozen in bf16, trained in bf16 with AdamW:
    the base replicated, sharded, and searched halfway between the two."""
    world = worlds(2)
    results = {plan: world.run(memory_cases.compile_and_steps, model="llama_lora", plan=plan,
                               mixed_precision="bf16") for plan in ("replicate", "full_shard")}
    low, high = results["full_shard"][0]["steady"], results["replicate"][0]["steady"]
    assert low < high
    limit = (low + high) // 2
    results[f"searched @ {limit} B"] = searched = world.run(
        memory_cases.compile_and_steps, model="llama_lora", limit=limit, mixed_precision="bf16")
    # it shards something, or recomputes blocks (the times measured here decide)
    assert (sum(searched[0]["counts"].values()) > searched[0]["counts"]["replicate"]
            or searched[0]["recompute"]), searched[0]["counts"]
    problems = [p for label, runs in results.items() for rank, r in enumerate(runs)
                for p in _check(r, f"{label} rank {rank}")]
    assert not problems, "\n".join(problems)


def test_one_gradient_collective_in_flight_is_measured_as_predicted(worlds, tmp_path):
    """full_shard with a bucket per block (a GPT of 4 blocks): two reduce-scatters in flight
    hold two blocks' flat gradients and shards, one in flight (``scatters_in_flight``) one."""
    world = worlds(2)
    runs = {}
    for k in (2, 1):
        path = tmp_path / f"in_flight_{k}.json"
        path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1,
                                    "default": "full_shard", "params": {},
                                    "gather_bucket_bytes": 2**30, "scatters_in_flight": k}))
        runs[k] = world.run(memory_cases.compile_and_steps, model="gpt_4_blocks",
                            plan=str(path))
    problems = [p for k, rs in runs.items() for rank, r in enumerate(rs)
                for p in _check(r, f"{k} in flight rank {rank}")]
    assert not problems, "\n".join(problems)
    for r1, r2 in zip(runs[1], runs[2]):
        assert max(p for _, p in r1["measured"]) < max(p for _, p in r2["measured"])
        assert max(p for _, p in r1["measured"]) <= r1["steady"] * (1 + 0.005)


@pytest.mark.parametrize("variant", [
    "replicate", "shard_grad_op", "full_shard", "split", "bf16", "meta", "llama", "gpt2_meta"])
def test_compile_leaves_nothing_behind(worlds, variant, tmp_path_factory):
    """No tensor in a reference cycle after compile_osdp, nothing held but the compiled
    module's parameters and buffers, nothing that accumulates from step to step, and nothing
    left in a cycle when the compiled module is dropped."""
    options: dict = {"plan": "full_shard", "model": "gpt", "steps": 3, "optimizer": "sgd"}
    if variant in ("replicate", "shard_grad_op", "full_shard"):
        options["plan"] = variant
    elif variant == "split":
        path = tmp_path_factory.mktemp("split") / "split.json"
        options["plan"] = memory_cases.split_plan_file(str(path))
    elif variant == "bf16":
        options["mixed_precision"] = "bf16"
    elif variant == "llama":
        options["model"] = "llama"
    elif variant == "gpt2_meta":  # a Hugging Face model built on the meta device
        options.update(model="gpt2", init_fn="hf")
    if variant.endswith("meta"):
        options["on_meta"] = True
    for rank, r in enumerate(worlds(2).run(memory_cases.compile_and_steps, **options)):
        assert r["cycle_bytes"] == 0, (rank, r["cycle_bytes"], r["garbage_objects"])
        assert r["dropped_cycle_bytes"] == 0, (rank, r["dropped_cycle_bytes"])
        assert not r["stray"], (rank, r["stray"][:10])
        starts = [s for s, _ in r["measured"][1:]]
        assert max(starts) == min(starts), (rank, r["measured"])


@pytest.mark.parametrize("prefetch", [1, 2])
def test_bucketed_regathers_are_predicted_from_above_and_closely(worlds, prefetch, tmp_path):
    """full_shard in 1 MiB gather buckets: a bucket's flat buffer is split (flat and copies
    alive) before the gathers its wait prefetches start, whose send buffers are held until they
    are waited for. Counting the flat with the next bucket's predicted 3.5 % over at prefetch 1;
    leaving out the send buffers, 2.5 % under at prefetch 2."""
    path = tmp_path / "buckets.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": "full_shard",
                                "prefetch": prefetch, "gather_bucket_bytes": 2**20}))
    for rank, r in enumerate(worlds(2).run(memory_cases.compile_and_steps, model="llama",
                                           plan=str(path), steps=3)):
        assert not _check(r, f"rank {rank}")
        for _, peak in r["measured"][1:]:
            assert 0.97 * r["steady"] <= peak <= r["steady"], (peak, r["steady"], r["peak_at"])


def test_the_promise_holds_for_searched_mixed_plans_on_a_mixture_of_experts(worlds, tmp_path):
    """A tiny Hugging Face Mixtral called with keywords and labels (issue 57: the plan searched
    at 1.15x full_shard's peak was reported 8-11 % over its prediction at every shape):
    full_shard, the searched plan and a written mix of the three strategies, each within the
    tolerance at four shapes on every rank, the searched plan under its limit."""
    results = worlds(2).run(moe_memory_cases.train_measured, plan_dir=str(tmp_path))
    problems = []
    for rank, r in enumerate(results):
        assert r["full_shard"]["counts"]["full_shard"] == sum(r["full_shard"]["counts"].values())
        assert sum(1 for c in r["mixed"]["counts"].values() if c) == 3, r["mixed"]["counts"]
        assert r["searched"]["fits"], r["searched"]
        for label, run in r.items():
            for shape, measured, predicted in run["steps"]:
                error = measured / predicted - 1
                if abs(error) > TOLERANCE:
                    problems.append(f"{label} rank {rank} at {shape}: measured {measured} B, "
                                    f"predicted {predicted} B ({error:+.1%}; {run['counts']}, "
                                    f"peak at {run['peak_at']}: {run['breakdown']})")
                if label == "searched" and measured > run["limit"]:
                    problems.append(f"searched rank {rank} at {shape}: measured {measured} B "
                                    f"over the limit {run['limit']} B")
    assert not problems, "\n".join(problems)

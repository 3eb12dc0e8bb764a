"""The order the suite runs in: the longest work first, so that the xdist workers finish together.

Under ``-n``, ``conftest.py`` picks ``--dist loadgroup``: xdist hands each worker the next
test in collection order whenever its queue runs low, and a test marked ``xdist_group`` goes to
the worker that runs its group. ``order`` sorts the collected tests by their expected seconds,
longest first (a greedy longest-first schedule: the last tests to start are short), keeping
each group together: the tests of a module with a module- or class-scoped fixture (set up once
per worker, so the whole module goes to one worker) or a module-level cache.

``SECONDS`` holds the tests that took longest in a whole-suite run on 2 busy cores
(``--durations``, setup included); only their order matters, so the figures need not be
exact. A test not listed is expected to take ``DEFAULT_S`` (``SLOW_DEFAULT_S`` in the slow
tier).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

DEFAULT_S = 0.5
SLOW_DEFAULT_S = 5.0

SECONDS: dict[str, float] = {
    "test_benchmarks_smoke.py::test_optimality_times_every_plan_that_fits": 148,
    "core/test_presets.py::test_gpt2_xl_compute_is_within_2x_of_the_datasheet_roofline": 105,
    "test_api_doc.py::test_the_readme_example_runs_and_resumes_as_written": 84,
    "distributed/test_torchrun_nodes.py::test_two_launchers_make_a_two_node_mesh": 76,
    "test_benchmarks_smoke.py::test_recompute_benchmark_builds_measures_and_checks_every_system": 73,
    "test_benchmarks_smoke.py::test_torch_compile_benchmark_times_every_uniform_plan_both_ways": 70,
    "distributed/test_memory_promise.py::test_measured_peaks_match_the_prediction_from_the_first_step[llama]": 69,
    "test_examples.py::test_train_gpt_resumes_where_it_stopped": 66,
    "distributed/test_search_world.py::test_searched_plan_fits_between_fsdp_and_ddp_peaks[hf_gpt2]": 65,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[gemma]": 63,
    "test_benchmarks_smoke.py::test_torch_compile_benchmark_runs_plans_with_block_sized_gather_buckets": 60,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[phi]": 58,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[gpt_neox]": 56,
    "test_examples.py::test_plan_cluster_saves_a_plan_for_64_gpus": 52,
    "property/test_equivalence.py::test_tiny_gpt_compiled_equals_original[2]": 51,
    "distributed/test_autotune.py::test_autotune_keeps_a_measured_plan_that_every_rank_agrees_on": 49,
    "planner/test_detect.py::test_detect_on_two_rank_gloo_world": 48,
    "property/test_equivalence.py::test_mlp_compiled_equals_original[3]": 46,
    "distributed/test_memory_promise.py::test_measured_peaks_match_the_prediction_from_the_first_step[gpt]": 44,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[falcon]": 44,
    "test_shape_prediction.py::test_peak_at_another_shape_matches_profiling_at_it[llama]": 42,
    "test_examples.py::test_finetune_lora_trains_only_the_adapters": 40,
    "distributed/test_memory_promise.py::test_compile_leaves_nothing_behind[bf16]": 38,
    "test_shape_prediction.py::test_keyword_inputs_return_the_model_output_and_check_the_call": 38,
    "property/test_equivalence.py::test_tiny_gpt_compiled_equals_original[4]": 36,
    "distributed/test_memory_promise.py::test_one_gradient_collective_in_flight_is_measured_as_predicted": 35,
    "test_benchmarks_smoke.py::test_memory_timeline_measures_and_draws_every_plan": 34,
    "distributed/test_recompute_memory.py::test_searched_plan_recomputes_below_the_full_shard_peak": 34,
    "property/test_joint_search_exact.py::test_joint_search_equals_brute_force": 34,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[llama]": 33,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[t5]": 30,
    "property/test_equivalence.py::test_tiny_gpt_compiled_equals_original[3]": 30,
    "test_benchmarks_smoke.py::test_compare_runs_every_mode_on_a_tiny_model": 29,
    "property/test_equivalence.py::test_tiny_gpt_compiled_equals_original[1]": 28,
    "distributed/test_faults.py::test_peer_raises_and_exits": 27,
    "distributed/test_checkpoint.py::test_resharding_from_2_to_4_to_1_ranks_continues_the_same_run": 27,
    "distributed/test_recompute_memory.py::test_sharded_gradients_of_a_recomputed_block_are_reduce_scattered_as_they_complete[full]": 26,
    "property/test_equivalence.py::test_mlp_compiled_equals_original[4]": 25,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[qwen2]": 24,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[gpt2]": 22,
    "distributed/test_recompute.py::test_dropout_recomputes_the_same_masks[full]": 22,
    "core/test_progress.py::test_quiet_silences_progress": 21,
    "distributed/test_mixed_precision.py::test_training_matches_single_process_in_low_precision[hf_llama_lora-bf16-replicate]": 21,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[bloom]": 20,
    "distributed/test_torch_compile.py::test_every_strategy[gpt-replicate-None]": 20,
    "distributed/test_recompute.py::test_dropout_recomputes_the_same_masks[selective]": 19,
    "distributed/test_shapes.py::test_a_shape_over_the_memory_limit_raises_before_it_runs[llama]": 19,
    "passes/test_profile.py::test_hugging_face_model_on_meta_profiles_like_the_one_on_the_cpu": 19,
    "distributed/test_recompute_memory.py::test_sharded_gradients_of_a_recomputed_block_are_reduce_scattered_as_they_complete[selective]": 19,
    "core/test_progress.py::test_plain_log_lines_report_progress_when_not_a_terminal": 19,
    "distributed/test_parity.py::test_training_matches_single_process[replicate-hf_gpt2-4]": 18,
    "property/test_equivalence.py::test_mlp_compiled_equals_original[2]": 18,
    "distributed/test_torch_compile.py::test_split_plan_with_the_compile_method": 18,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[opt]": 17,
    "distributed/test_hierarchy.py::test_training_matches_single_process[hybrid_shard-hf_gpt2]": 17,
    "distributed/test_memory_prediction.py::test_two_node_mesh_peak_memory_within_ten_percent[hf_gpt2-hybrid_shard-sgd]": 17,
    "distributed/test_mixed_precision.py::test_training_matches_single_process_in_low_precision[hf_llama_lora-bf16-full_shard]": 17,
    "distributed/test_torch_compile.py::test_every_strategy[gpt-shard_grad_op-None]": 17,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[mixtral]": 17,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[mistral]": 16,
    "distributed/test_zoo.py::test_architecture_trains_unwrapped_like_one_process[roberta]": 16,
    "distributed/test_torch_compile.py::test_recomputed_regions[full]": 16,
    "distributed/test_search_world.py::test_searched_plan_fits_between_fsdp_and_ddp_peaks[gpt]": 16,
    "distributed/test_torch_compile.py::test_inductor_full_shard": 16,
    "distributed/test_mixed_precision.py::test_training_matches_single_process_in_low_precision[hf_llama-bf16-replicate]": 16,
    "test_shape_prediction.py::test_peak_at_another_shape_matches_profiling_at_it[gpt]": 16,
    "distributed/test_shapes.py::test_every_shape_trains_like_one_process[llama-full_shard]": 15,
    "distributed/test_torch_compile.py::test_regions_run_the_way_they_measured_faster_on_every_rank_alike": 15,
    "distributed/test_memory_promise.py::test_bucketed_regathers_are_predicted_from_above_and_closely[2]": 15,
    "planner/test_schedule_search.py::test_the_schedule_search_ranks_distinct_plans_that_fit": 15,
    "distributed/test_torch_compile.py::test_mixed_precision_and_prefetch[full_shard]": 15,
    "passes/test_shard.py::test_collective_nodes_before_and_after[hf_gpt2-replicate]": 14,
    "distributed/test_clip.py::test_clipped_training_matches_single_process[shard_grad_op-mlp-4-inf]": 14,
    "distributed/test_torch_compile.py::test_every_strategy[gpt-full_shard-None]": 14,
    "distributed/test_torch_compile.py::test_no_sync_accumulation": 13,
    "distributed/test_mixed_precision.py::test_training_matches_single_process_in_low_precision[hf_llama-bf16-mixed]": 13,
    "distributed/test_memory_promise.py::test_bucketed_regathers_are_predicted_from_above_and_closely[1]": 13,
    "distributed/test_frozen.py::test_a_sharded_frozen_base_trains_like_one_process[full_shard]": 13,
    "distributed/test_memory_promise.py::test_compile_leaves_nothing_behind[gpt2_meta]": 13,
    "distributed/test_meta_init.py::test_hugging_face_model_on_meta_trains_like_one_process[full_shard]": 13,
}
"""Node id under tests/ -> seconds (a run of 2026-11-26, 2 cores shared with another run)."""

GROUPED_MODULES = frozenset({"passes/test_shard.py"})
"""Modules kept on one worker although no fixture of theirs is module-scoped: a module-level
cache (test_shard's captures of the unsharded models)."""

WIDE_SCOPES = ("module", "class", "package")


def group_of(item: Any) -> str | None:
    """The group ``item`` runs in (its module, when the module holds a fixture set up once for
    several tests, or a cache), or None: it runs on whichever worker is free."""
    module = item.nodeid.split("::")[0]
    if module.removeprefix("tests/") in GROUPED_MODULES:
        return module
    defs = getattr(item, "_fixtureinfo", None)
    for fixturedefs in (defs.name2fixturedefs.values() if defs else ()):
        if any(d.scope in WIDE_SCOPES for d in fixturedefs):
            return module
    return None


def expected_s(item: Any, slow: bool) -> float:
    return SECONDS.get(item.nodeid.removeprefix("tests/"), SLOW_DEFAULT_S if slow else DEFAULT_S)


def order(items: list[Any], slow: Iterable[bool]) -> list[Any]:
    """``items`` longest first, a group's tests together (in their collection order) and
    weighed as their sum; ties keep the collection order."""
    units: dict[str, list[tuple[Any, float]]] = {}
    for index, (item, is_slow) in enumerate(zip(items, slow, strict=True)):
        key = group_of(item) or f"#{index}"
        units.setdefault(key, []).append((item, expected_s(item, is_slow)))
    ranked = sorted(units.values(), key=lambda unit: -sum(s for _, s in unit))
    return [item for unit in ranked for item, _ in unit]

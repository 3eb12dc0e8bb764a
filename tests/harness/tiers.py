"""Which tests are ``slow``: the test tiers (``conftest.pytest_collection_modifyitems``).

``pytest -m "not slow"`` is the gate: the README's test command and what CI runs, a few
minutes on 2 cores. It holds every unit test of core, plan, planner, cost_models and passes;
the README's example and ``python -m osdp_fx demo`` as a user runs them; and of each
multi-process feature a few cases on the cheap models (the MLP, TinyGPT) in 2-rank worlds (4 for
the two-node mesh): parity of every strategy, checkpoints, clipping, mixed precision,
accumulation, recomputation, meta init, export, memory prediction, QLoRA; and one real
``torch.export`` of a Hugging Face Llama per plan, with the suite's shared captures undone
(``passes/test_export_real.py``, a few seconds: every other test of a Hugging Face model gets a
shared capture, ``harness/shared_captures.py``). ``pytest -m slow`` runs the rest, the
end-to-end tier: the benchmarks' and examples' scripts in subprocesses, every architecture of
the zoo, the hypothesis searches in gloo worlds, the memory measurements of Hugging Face
models, worlds of 3 and 4 ranks; ``pytest`` runs both.

A test is slow when its module is in ``SLOW_MODULES``, or its module is in ``FAST_CASES`` and
the predicate there says no to the test (its function name and parameters), or its module is in
``SLOW_CASES`` and the predicate there says yes. Tests marked
``pytest.mark.slow`` in their own file are slow as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Predicate = Callable[[str, dict[str, Any]], bool]
"""(test function name, parametrize values) -> yes or no: in ``FAST_CASES`` whether the case is in
the gate, in ``SLOW_CASES`` whether it is slow."""

SLOW_MODULES = frozenset({
    # subprocess-launched scripts and worlds of their own
    "test_benchmarks_smoke.py",
    "distributed/test_faults.py",
    "distributed/test_torchrun_nodes.py",
    # searches, autotuning, torch.compile, many architectures, Llama/HF memory measurements
    "distributed/test_autotune.py",
    "distributed/test_search_world.py",
    "distributed/test_torch_compile.py",
    "distributed/test_zoo.py",
    "distributed/test_memory_promise.py",
    "distributed/test_recompute_memory.py",
    "distributed/test_shapes.py",
    "distributed/test_strategy_memory.py",
    "distributed/test_split.py",
    "distributed/test_param_identity.py",
    # hypothesis over the search space
    "property/test_joint_search_exact.py",
})


def _everything(name: str, params: dict[str, Any]) -> bool:
    return True


def _is(**wanted: Any) -> Predicate:
    """Fast when every named parameter has one of the wanted values (a value or a tuple)."""
    def predicate(name: str, params: dict[str, Any]) -> bool:
        return all(params.get(k) in (v if isinstance(v, tuple) else (v,))
                   for k, v in wanted.items())
    return predicate


def _names(*names: str, **cases: Predicate) -> Predicate:
    """Yes to the tests named (every case), and to the cases of ``cases[name]``. The names it
    was given are kept as its ``names``, so that a test can check each still names a test
    (``tests/test_tiers.py``): a renamed test would silently change tier."""
    def predicate(name: str, params: dict[str, Any]) -> bool:
        return name in names or (name in cases and cases[name](name, params))
    predicate.names = (*names, *cases)  # type: ignore[attr-defined]
    return predicate


FAST_CASES: dict[str, Predicate] = {
    # parity of every strategy, mixed and split plans: the MLP in a 2-rank world
    "distributed/test_parity.py": _is(model="mlp", world_size=2),
    # the two-node mesh strategies and collectives
    "distributed/test_hierarchy.py": _names(
        "test_two_level_collectives_reassemble_the_flat_order",
        "test_local_world_size_that_does_not_divide_the_world",
        test_training_matches_single_process=_is(model="mlp")),
    "distributed/test_checkpoint.py": _names(
        "test_errors_name_the_problem_and_the_fix",
        "test_a_failed_save_leaves_the_previous_checkpoint_intact",
        test_resume_at_the_same_world_size_is_bitwise_exact=_is(model="mlp")),
    "distributed/test_clip.py": _names(
        "test_frozen_parameters_are_skipped", "test_nonfinite_gradient_on_one_rank",
        test_clipped_training_matches_single_process=_is(model="mlp", world_size=2,
                                                         plan=("full_shard", "mixed"))),
    "distributed/test_export.py": _is(model="gpt"),
    "distributed/test_forward_only.py": _everything,
    "distributed/test_gather_buckets.py": _names(
        "test_a_bucket_holds_a_large_parameter_with_small_ones"),
    "distributed/test_memory_prediction.py": _names(
        "test_a_replicated_bucket_is_packed_before_the_reduce_scatter_of_the_same_backward",
        test_predicted_peak_memory_within_ten_percent=_is(model="mlp")),
    "distributed/test_meta_init.py": _names(
        "test_meta_errors_name_the_fix", "test_init_fn_initialises_the_meta_model",
        test_meta_model_gets_the_values_it_has_on_the_cpu=_is(model="mlp")),
    "distributed/test_mixed_precision.py": _names(
        test_training_matches_single_process_in_low_precision=_is(model="mlp")),
    "distributed/test_no_sync.py": _names(
        test_accumulation_matches_single_process=_is(model="wide_mlp"),
        test_no_gradient_collective_runs_inside_no_sync=_is(devices=None)),
    "distributed/test_profile_world.py": _everything,
    "distributed/test_recompute.py": _names(
        test_recompute_matches_single_process=_is(strategy="mixed")),
    "distributed/test_reducer.py": _everything,
    "distributed/test_state.py": _everything,
    # a split weight as one parameter: one world for every case; one lone collective's own
    "distributed/test_split_identity.py": lambda name, params: params.get("call") in (
        None, "full_state_dict"),
    "distributed/test_two_models.py": _is(plan="mixed"),
    # hypothesis: world size 1 (in this process) in the gate, the gloo worlds in the slow
    "property/test_equivalence.py": _is(world_size=1),
    "property/test_split_equivalence.py": _is(world_size=1),
}


SLOW_CASES: dict[str, Predicate] = {
    # planning GPT-2 XL / MPT-1b (meta, fake profile) for 1024 and 8 H100s: minutes on 2 cores
    "core/test_presets.py": _names(
        "test_gpt2_xl_compute_is_within_2x_of_the_datasheet_roofline",
        "test_gpt2_xl_folded_plan_fits_in_40_lines_beside_the_blocks_planned_apart",
        "test_h100_preset_against_llm_foundrys_published_fsdp_throughput"),
    # the command line in a subprocess (imports and compiles from scratch each time)
    "core/test_progress.py": _names(
        "test_quiet_silences_progress", "test_a_terminal_gets_a_bar",
        "test_plain_log_lines_report_progress_when_not_a_terminal"),
    # Llama captured by torch.export, profiled at several shapes
    "test_shape_prediction.py": _names(
        "test_keyword_inputs_return_the_model_output_and_check_the_call",
        "test_a_model_that_returns_a_cache_is_told_to_turn_it_off",
        test_peak_at_another_shape_matches_profiling_at_it=_is(model="llama")),
    # GPT-2 from transformers compiled under each strategy (tiny_gpt and the MLP stay fast;
    # passes/test_capture.py keeps a GPT-2 capture in the gate)
    "passes/test_shard.py": lambda name, params: params.get("run", ("",))[0] == "hf_gpt2",
    "passes/test_profile.py": _names(
        "test_hugging_face_model_on_meta_profiles_like_the_one_on_the_cpu",
        test_node_flops_sum_to_whole_model=_is(name="hf_gpt2")),
    "planner/test_schedule_search.py": _names(
        "test_the_schedule_search_ranks_distinct_plans_that_fit"),
}


def is_slow(module: str, name: str, params: dict[str, Any]) -> bool:
    """Whether the test ``name`` (parameters ``params``) of ``module`` (its path under tests/,
    with forward slashes) belongs to the slow tier."""
    if module in SLOW_MODULES:
        return True
    fast = FAST_CASES.get(module)
    if fast is not None and not fast(name, params):
        return True
    slow = SLOW_CASES.get(module)
    return slow is not None and slow(name, params)

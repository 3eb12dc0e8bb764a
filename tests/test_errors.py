"""Bad inputs raise an OSDPError naming the problem and the fix, before any collective.

The bad inputs themselves live in ``harness.property_cases.bad_inputs`` so that the same list runs
here in-process (message checks) and on every rank of a 2-rank gloo world with every collective
forbidden (nothing may reach a collective before failing). Ranks that disagree on the plan must
fail together with PlanMismatchError instead of hanging, and leave the world usable.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import time

import pytest
import torch
from harness import property_cases as pc

from osdp_fx import Devices, OSDPError, compile_osdp
from osdp_fx._version import TORCH_FLOOR, torch_release, torch_too_old
from osdp_fx.errors import CaptureError, InputError, PlanError, PlanMismatchError

STRATEGY_LIST = "replicate, shard_grad_op, full_shard"


def marker_line(cls: type, marker: str) -> int:
    """The file line number of the source line of ``cls`` containing ``marker``."""
    lines, first = inspect.getsourcelines(cls)
    return first + next(i for i, line in enumerate(lines) if marker in line)


def _capture_where(cls: type, marker: str) -> list[str]:
    return [f"property_cases.py:{marker_line(cls, marker)}"]


# name -> (error class, fragments the message must contain: what was wrong, then the fix)
EXPECTED: dict[str, tuple[type[OSDPError], list[str]]] = {
    "not_a_module": (InputError, ["needs a torch.nn.Module", "got function",
                                  "wrap your function in an nn.Module"]),
    "inputs_wrong_shape": (InputError, ["MLP rejected the example inputs", "Tensor(2, 7):float32",
                                        "mat1 and mat2", "Pass example_inputs as a tuple"]),
    "inputs_wrong_dtype": (InputError, ["MLP rejected the example inputs", "Tensor(2, 4):int64",
                                        "Pass example_inputs as a tuple"]),
    "inputs_not_a_tuple": (InputError, ["example_inputs must be a tuple", "got dict",
                                        "compile_osdp(model, (x,))"]),
    "unknown_strategy": (PlanError, ["unknown strategy 'fsdp'", STRATEGY_LIST, ".json"]),
    "plan_not_a_string": (PlanError, ["got int", STRATEGY_LIST, "JSON plan file"]),
    "missing_plan_file": (PlanError, ["nope.json", "does not exist", "pass a strategy name"]),
    "plan_bad_json": (PlanError, ["bad.json", "is not valid JSON", "plan-format"]),
    "plan_without_format": (PlanError, ["noformat.json", "is not an osdp-fx plan",
                                        '"format": "osdp-fx-plan"']),
    "plan_wrong_version": (PlanError, ["v2.json", "has version 2", "reads version 1",
                                       "re-save the plan"]),
    "plan_unknown_param": (PlanError, ["names parameters the model does not have",
                                       "layers.7.weight", "named like: layers.0.weight"]),
    "plan_missing_params": (PlanError, ["gives no strategy for 3 parameters", "layers.0.bias",
                                        '"default": "full_shard"']),
    "plan_unknown_strategy_in_file": (PlanError, ["'layers.1.bias'", "unknown strategy 'zero3'",
                                                  STRATEGY_LIST]),
    "plan_shape_mismatch": (PlanError, ["'layers.0.weight'", "shape (4, 5) in the plan",
                                        "(5, 4) in the model", "re-plan"]),
    "plan_for_another_mesh": (PlanError, ["mesh.json", "made for 3 ranks per node",
                                          "on one node", "Devices(world_size=..., ranks_per_node=3)",
                                          "torchrun --nproc-per-node 3",
                                          'remove "ranks_per_node"']),
    "memory_limit_words": (InputError, ["'8 gigs' is not a byte quantity", "'8GiB'"]),
    "memory_limit_negative": (InputError, ["non-negative", "got -1"]),
    "memory_limit_bool": (InputError, ["got True", "'8GiB'"]),
    "prefetch_negative": (PlanError, ["prefetch must be an int >= 0", "got -1",
                                      "0 turns prefetching off"]),
    "plan_file_bad_prefetch": (PlanError, ["prefetch must be an int >= 0", "got 'two'"]),
    "plan_file_bad_bucket": (PlanError, ["gather_bucket_bytes must be a number of bytes >= 1",
                                         "got 0"]),
    "autotune_with_a_plan": (InputError, ["autotune times searched plans", "plan=None"]),
    "autotune_negative": (InputError, ["autotune=-1 is not a number of plans", "int >= 1"]),
    "capture_branch": (CaptureError, [
        "could not capture DataDependentBranch", "torch.fx.symbolic_trace", "torch.export",
        *_capture_where(pc.DataDependentBranch, "CAPTURE-FAILS-HERE"), "if h.sum() > 0:",
        "Make the failing line traceable"]),
    "capture_item_loop": (CaptureError, [
        "could not capture ItemLoopBound", "GuardOnDataDependentSymNode",
        *_capture_where(pc.ItemLoopBound, "CAPTURE-FAILS-HERE"), ".item()",
        "Make the failing line traceable"]),
}


def assert_names_problem_and_fix(exc: BaseException, cls: type, fragments: list[str]) -> None:
    assert isinstance(exc, cls), f"{type(exc).__name__}: {exc}"
    for fragment in fragments:
        assert fragment in str(exc), f"{fragment!r} not in message:\n{exc}"


def test_the_error_classes_are_exported():
    import osdp_fx
    from osdp_fx import errors

    names = ["OSDPError", "CaptureError", "CheckpointError", "InputError", "PlanError",
             "PlanMismatchError"]
    assert set(names) <= set(osdp_fx.__all__)
    for name in names:
        assert getattr(osdp_fx, name) is getattr(errors, name)
        assert issubclass(getattr(osdp_fx, name), osdp_fx.OSDPError)


def test_a_torch_older_than_the_floor_is_refused_at_import():
    """``import osdp_fx`` under a torch older than ``TORCH_FLOOR`` raises InputError naming the
    release needed and how to install it (run in a fresh interpreter whose torch reports
    ``version``), before a module that needs a newer torch fails with an ImportError."""
    version = "2.5.1"
    code = (f"import torch; torch.__version__ = {version!r}\n"
            "try:\n    import osdp_fx\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("InputError osdp-fx needs torch 2.6 or newer"), out
    assert f"this is torch {version}" in out and "pip install 'torch>=2.6'" in out


@pytest.mark.parametrize("version", ["2.6.0", "2.7.0a0+git1234", "2.13.0+cpu", "3.0.0"])
def test_torch_at_or_above_the_floor_is_accepted(version):
    assert torch_too_old(version) is None
    assert torch_release(version) >= TORCH_FLOOR


@pytest.mark.parametrize("version", ["2.5.1", "2.4.0+cu121", "1.13.1"])
def test_torch_below_the_floor_is_named_with_the_floor(version):
    assert torch_release(version) < TORCH_FLOOR
    assert "needs torch 2.6 or newer" in torch_too_old(version)


def test_every_bad_input_has_an_expectation(tmp_path):
    assert set(pc.bad_inputs(str(tmp_path))) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input_raises_osdp_error(tmp_path, name):
    kwargs = pc.bad_inputs(str(tmp_path))[name]()
    with pytest.raises(OSDPError) as info:
        compile_osdp(kwargs.pop("model"), kwargs.pop("example_inputs"), **kwargs)
    assert_names_problem_and_fix(info.value, *EXPECTED[name])


def test_a_tensor_subclass_parameter_is_refused_with_the_packed_form_as_fix():
    """torchao's NF4Tensor held by a module of its own (not an nn.Linear's weight, which is
    taken as it is) captures, but osdp-fx cannot shard it."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization import to_nf4

    class NF4Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(to_nf4(torch.randn(256, 128)), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, self.weight.get_original_weight())

    with pytest.raises(OSDPError) as info:
        compile_osdp(NF4Linear(), (torch.randn(2, 128),))
    assert_names_problem_and_fix(info.value, InputError, [
        "parameter 'weight' is a NF4Tensor, a tensor subclass", "plain tensors only",
        "packed form as a plain parameter", "docs/finetuning.md"])


def test_devices_for_a_world_without_process_group():
    with pytest.raises(InputError) as info:
        compile_osdp(pc.small_mlp(), (torch.randn(2, 4),), Devices(world_size=2))
    assert_names_problem_and_fix(info.value, InputError, [
        "Devices(world_size=2) needs a process group", "torchrun", "init_process_group()"])


def test_tied_names_with_different_strategies(tmp_path):
    from osdp_fx.examples import TinyGPT

    path = pc.write_plan(tmp_path / "tied.json", {"tok.weight": "full_shard",
                                                  "head.weight": "replicate"}, "replicate")
    with pytest.raises(PlanError) as info:
        compile_osdp(TinyGPT(vocab=11, dim=8, depth=1, heads=2, max_seq=4),
                     (torch.zeros(1, 3, dtype=torch.long),), plan=path)
    assert_names_problem_and_fix(info.value, PlanError, [
        "tied names of 'tok.weight' different strategies", "give them the same strategy"])


def test_plan_file_for_another_world_size(tmp_path):
    path = tmp_path / "ws4.json"
    path.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "world_size": 4,
                                "default": "full_shard"}))
    with pytest.raises(PlanError) as info:
        compile_osdp(pc.small_mlp(), (torch.randn(2, 4),), plan=str(path))
    assert_names_problem_and_fix(info.value, PlanError, [
        "made for world size 4", "this world has 1 ranks", 'edit its "world_size"'])


def test_infinite_memory_limit():
    with pytest.raises(InputError, match="memory limit"):
        compile_osdp(pc.small_mlp(), (torch.randn(2, 4),), memory_limit=float("inf"))


@pytest.mark.parametrize("shape", [5, None])
def test_plan_entry_shape_not_a_list(tmp_path, shape):
    path = pc.write_plan(tmp_path / "shape.json",
                         {"layers.0.weight": {"strategy": "replicate", "shape": shape}},
                         "replicate")
    with pytest.raises(PlanError, match="layers.0.weight"):
        compile_osdp(pc.small_mlp(), (torch.randn(2, 4),), plan=path)


# ---- load_full_state_dict ------------------------------------------------------------------


@pytest.fixture
def compiled_with_buffers():
    torch.manual_seed(0)
    return compile_osdp(pc.WithBuffer(), (torch.randn(2, 4),), plan="full_shard")


def test_load_full_state_dict_missing_key(compiled_with_buffers):
    state = compiled_with_buffers.full_state_dict()
    del state["fc.bias"]
    with pytest.raises(InputError) as info:
        compiled_with_buffers.load_full_state_dict(state)
    assert_names_problem_and_fix(info.value, InputError, [
        "does not match the model", "missing: ['fc.bias']", "pass the dict returned by"])


def test_load_full_state_dict_unexpected_key(compiled_with_buffers):
    state = {**compiled_with_buffers.full_state_dict(), "fc.scale": torch.ones(3)}
    with pytest.raises(InputError, match=r"unexpected: \['fc.scale'\]"):
        compiled_with_buffers.load_full_state_dict(state)


@pytest.mark.parametrize("plan", ["full_shard", "replicate"])
def test_load_full_state_dict_wrong_parameter_shape(plan):
    compiled = compile_osdp(pc.small_mlp(), (torch.randn(2, 4),), plan=plan)
    state = compiled.full_state_dict()
    state["layers.0.weight"] = torch.zeros(4, 5)
    with pytest.raises(InputError) as info:
        compiled.load_full_state_dict(state)
    assert_names_problem_and_fix(info.value, InputError, [
        "'layers.0.weight' has shape (4, 5)", "expects (5, 4)"])


@pytest.mark.parametrize("bad_shape", [(1,), (5,)])
def test_load_full_state_dict_wrong_buffer_shape(compiled_with_buffers, bad_shape):
    state = compiled_with_buffers.full_state_dict()
    state["bn.running_mean"] = torch.zeros(bad_shape)
    with pytest.raises(OSDPError, match="bn.running_mean"):
        compiled_with_buffers.load_full_state_dict(state)


def test_load_full_state_dict_error_leaves_state_unchanged():
    compiled = compile_osdp(pc.small_mlp(), (torch.randn(2, 4),), plan="replicate")
    before = compiled.full_state_dict()
    state = {k: v + 1 for k, v in before.items()}
    state["layers.1.bias"] = torch.zeros(1, 3)
    with pytest.raises(InputError):
        compiled.load_full_state_dict(state)
    pc.assert_unchanged(before, compiled.full_state_dict())


# ---- in a real world ------------------------------------------------------------------------


def test_bad_inputs_fail_on_every_rank_before_any_collective(worlds, tmp_path):
    reports = worlds(2).run(pc.bad_inputs_report, tmpdir=str(tmp_path))
    for rank, report in enumerate(reports):
        assert set(report) == set(EXPECTED)
        for name, outcome in report.items():
            where = f"rank {rank}, {name}"
            assert outcome["collectives"] == [], f"{where}: called {outcome['collectives']}"
            assert outcome["raised"] == EXPECTED[name][0].__name__, f"{where}: {outcome}"
            assert outcome["osdp"], where


def test_devices_disagreeing_with_the_world(worlds):
    errors = worlds(2).run_expecting_error(pc.compile_with_devices, devices_world=3)
    for rank, error in errors.items():
        assert error["type"] == "InputError", error["traceback"]
        assert "Devices(world_size=3) does not match the process group's 2 ranks" in error["error"]


def test_ranks_disagreeing_on_the_plan_fail_together(worlds):
    world = worlds(2)
    start = time.monotonic()
    errors = world.run_expecting_error(pc.compile_per_rank_plan,
                                       plans=["full_shard", "replicate"], timeout_s=60.0)
    assert time.monotonic() - start < 60.0
    assert sorted(errors) == [0, 1]
    for rank, error in errors.items():
        assert error["type"] == "PlanMismatchError", error["traceback"]
        for fragment in ("ranks compiled different plans", "rank 0: hash", "rank 1: hash",
                         "'full_shard': 4", "'replicate': 4",
                         "same model, plan and memory limit on every rank"):
            assert fragment in error["error"], (rank, fragment, error["error"])
    assert issubclass(PlanMismatchError, PlanError)

    # The world survived: same processes, and collectives and compiles still work.
    assert world.alive() and worlds(2) is world
    results = world.run(pc.train_one_step, plan="full_shard")
    assert [r["rank_sum"] for r in results] == [1.0, 1.0]
    for key in results[0]["grads"]:
        torch.testing.assert_close(results[0]["grads"][key], results[1]["grads"][key])
    assert list(results[0]["state"]) == list(pc.small_mlp().state_dict())


def test_plan_files_disagreeing_across_ranks(worlds, tmp_path):
    names = [n for n, _ in pc.small_mlp().named_parameters()]
    plans = [pc.write_plan(tmp_path / f"rank{r}.json",
                           {n: "replicate" for n in names}, None) for r in range(2)]
    pc.write_plan(plans[1], {**{n: "replicate" for n in names}, names[-1]: "shard_grad_op"})
    errors = worlds(2).run_expecting_error(pc.compile_per_rank_plan, plans=plans, timeout_s=60.0)
    assert {e["type"] for e in errors.values()} == {"PlanMismatchError"}
    assert all("'shard_grad_op': 1" in e["error"] for e in errors.values())

"""Models, data and rank functions for the property and error tests.

Everything here is importable by the spawned ranks of a test world and deterministic given its
arguments, so the test process can rebuild the same model and batch to compute a reference.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from osdp_fx import Devices, OSDPError, compile_osdp
from osdp_fx.examples import MLP, TinyGPT, lm_loss

# ---- models and data described by a plain dict (picklable, rebuilt identically anywhere) ------


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The model a spec describes, initialised from ``spec["seed"]``.

    ``{"kind": "mlp", "sizes": [...], "bias": bool, ...}`` or
    ``{"kind": "gpt", "vocab", "dim", "heads", "depth", "max_seq", ...}``.
    """
    torch.manual_seed(spec["seed"])
    if spec["kind"] == "mlp":
        return MLP(tuple(spec["sizes"]), bias=spec["bias"])
    if spec["kind"] == "gpt":
        return TinyGPT(vocab=spec["vocab"], dim=spec["dim"], depth=spec["depth"],
                       heads=spec["heads"], max_seq=spec["max_seq"])
    raise ValueError(spec["kind"])


def global_batch(spec: dict[str, Any], world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``spec["local_batch"] * world`` samples; targets are the inputs
    themselves for a language model."""
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    n = spec["local_batch"] * world
    if spec["kind"] == "mlp":
        return (torch.randn(n, spec["sizes"][0], generator=gen),
                torch.randn(n, spec["sizes"][-1], generator=gen))
    idx = torch.randint(0, spec["vocab"], (n, spec["seq"]), generator=gen)
    return idx, idx


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def loss_of(spec: dict[str, Any], out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean loss over the batch (equal local batches: mean over ranks == global mean)."""
    if spec["kind"] == "mlp":
        return F.mse_loss(out, target)
    return lm_loss(out, target)


def write_plan(path: str | os.PathLike[str], params: dict[str, str],
               default: str | None = None, splits: dict[str, int] | None = None) -> str:
    """Write a version-1 JSON plan file and return its path."""
    data: dict[str, Any] = {"format": "osdp-fx-plan", "version": 1, "params": params}
    if default is not None:
        data["default"] = default
    if splits:
        data["splits"] = splits
    with open(path, "w") as f:
        json.dump(data, f)
    return os.fspath(path)


def equivalence(rank: int, world: int, *, spec: dict[str, Any], plan: str) -> dict[str, Any]:
    """Compile the spec's model under ``plan``; one forward and backward of this rank's batch."""
    x, target = global_batch(spec, world)
    x, target = local_slice(x, rank, world), local_slice(target, rank, world)
    compiled = compile_osdp(build_model(spec), (x,), plan=plan)
    out = compiled(x)
    loss_of(spec, out, target).backward()
    return {
        "out": out.detach(),
        "grads": compiled.full_grads(),
        "strategies": {p.name: p.strategy for p in compiled.plan.params},
    }


# ---- tiny models for the pass tests --------------------------------------------------------


def tiny_mlp() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    return MLP((6, 7, 5, 3)), (torch.randn(4, 6),)


def tiny_gpt() -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    return TinyGPT(vocab=19, dim=16, depth=2, heads=4, max_seq=8), (torch.randint(0, 19, (2, 6)),)


def tiny_hf_gpt2() -> tuple[nn.Module, tuple[Any, ...]]:
    """A random-init 2-layer GPT2LMHeadModel (no download), in eval mode: dropout off, so its
    graph and the model compute exactly the same thing."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=67, n_positions=16,
                     use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval(), (torch.randint(0, 67, (2, 8)),)


PASS_MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, tuple[Any, ...]]], str,
                             dict[str, str]]] = {
    # name: (builder, capture method, {tied alias: canonical name})
    "mlp": (tiny_mlp, "symbolic_trace", {}),
    "tiny_gpt": (tiny_gpt, "symbolic_trace", {"head.weight": "tok.weight"}),
    "hf_gpt2": (tiny_hf_gpt2, "export", {"lm_head.weight": "transformer.wte.weight"}),
}


def logits(out: Any) -> torch.Tensor:
    """The tensor output of a model (a Hugging Face model returns an output object)."""
    return out.logits if hasattr(out, "logits") else out


# ---- error cases --------------------------------------------------------------------------


class DataDependentBranch(nn.Module):
    """Python control flow on a tensor value: neither symbolic_trace nor export can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if h.sum() > 0:  # CAPTURE-FAILS-HERE: branch
            return h
        return -h


class ItemLoopBound(nn.Module):
    """A loop bound read from a tensor with ``.item()`` (a data-dependent trip count)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        for _ in range(int(x.abs().sum().item()) % 3 + 1):  # CAPTURE-FAILS-HERE: loop
            h = h * 2
        return h


class WithBuffer(nn.Module):
    """A Linear followed by a BatchNorm (which has buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def batch_norm_model() -> tuple[WithBuffer, torch.Tensor]:
    """A WithBuffer model and an input whose batch statistics move the running ones."""
    torch.manual_seed(0)
    return WithBuffer(), torch.randn(8, 4) + 3


def snapshot(named: Iterator[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]
             ) -> dict[str, torch.Tensor]:
    items = named.items() if isinstance(named, dict) else named
    return {k: v.detach().clone() for k, v in items}


def assert_unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert after.keys() == before.keys()
    for key, value in after.items():
        torch.testing.assert_close(value, before[key], atol=0, rtol=0, msg=key)


def small_mlp() -> MLP:
    torch.manual_seed(0)
    return MLP((4, 5, 3))


def bad_inputs(tmpdir: str) -> dict[str, Callable[[], dict[str, Any]]]:
    """Name -> a function returning compile_osdp's keyword arguments for one bad input.

    Every one of them must raise an OSDPError on every rank before any collective.
    """
    x = torch.randn(2, 4)

    def plan_file(name: str, text: str) -> str:
        path = os.path.join(tmpdir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def mlp_plan(name: str, params: dict[str, Any]) -> str:
        data = {"format": "osdp-fx-plan", "version": 1, "params": params}
        return plan_file(name, json.dumps(data))

    all_full = {"layers.0.weight": "full_shard", "layers.0.bias": "full_shard",
                "layers.1.weight": "full_shard", "layers.1.bias": "full_shard"}
    return {
        "not_a_module": lambda: dict(model=lambda t: t * 2, example_inputs=(x,)),
        "inputs_wrong_shape": lambda: dict(model=small_mlp(), example_inputs=(torch.randn(2, 7),)),
        "inputs_wrong_dtype": lambda: dict(
            model=small_mlp(), example_inputs=(torch.ones(2, 4, dtype=torch.int64),)),
        "inputs_not_a_tuple": lambda: dict(model=small_mlp(), example_inputs={"x": x}),
        "unknown_strategy": lambda: dict(model=small_mlp(), example_inputs=(x,), plan="fsdp"),
        "plan_not_a_string": lambda: dict(model=small_mlp(), example_inputs=(x,), plan=3),
        "missing_plan_file": lambda: dict(
            model=small_mlp(), example_inputs=(x,), plan=os.path.join(tmpdir, "nope.json")),
        "plan_bad_json": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=plan_file("bad.json", '{"format": "osdp-fx-plan", "version": 1, "params": {')),
        "plan_without_format": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=plan_file("noformat.json", json.dumps({"version": 1, "params": all_full}))),
        "plan_wrong_version": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=plan_file("v2.json", json.dumps(
                {"format": "osdp-fx-plan", "version": 2, "params": all_full}))),
        "plan_unknown_param": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=mlp_plan("unknown.json", {**all_full, "layers.7.weight": "replicate"})),
        "plan_missing_params": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=mlp_plan("missing.json", {"layers.0.weight": "replicate"})),
        "plan_unknown_strategy_in_file": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=mlp_plan("zero3.json", {**all_full, "layers.1.bias": "zero3"})),
        "plan_shape_mismatch": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=mlp_plan("shape.json", {
                **all_full, "layers.0.weight": {"strategy": "full_shard", "shape": [4, 5]}})),
        "plan_for_another_mesh": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=plan_file("mesh.json", json.dumps(
                {"format": "osdp-fx-plan", "version": 1, "ranks_per_node": 3,
                 "default": "hybrid_shard"}))),
        "memory_limit_words": lambda: dict(
            model=small_mlp(), example_inputs=(x,), memory_limit="8 gigs"),
        "memory_limit_negative": lambda: dict(
            model=small_mlp(), example_inputs=(x,), memory_limit=-1),
        "memory_limit_bool": lambda: dict(
            model=small_mlp(), example_inputs=(x,), memory_limit=True),
        "prefetch_negative": lambda: dict(
            model=small_mlp(), example_inputs=(x,), plan="full_shard", prefetch=-1),
        "plan_file_bad_prefetch": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=plan_file("prefetch.json", json.dumps(
                {"format": "osdp-fx-plan", "version": 1, "prefetch": "two", "params": all_full}))),
        "plan_file_bad_bucket": lambda: dict(
            model=small_mlp(), example_inputs=(x,),
            plan=plan_file("bucket.json", json.dumps(
                {"format": "osdp-fx-plan", "version": 1, "gather_bucket_bytes": 0,
                 "params": all_full}))),
        "autotune_with_a_plan": lambda: dict(
            model=small_mlp(), example_inputs=(x,), plan="full_shard", autotune=2),
        "autotune_negative": lambda: dict(model=small_mlp(), example_inputs=(x,), autotune=-1),
        "capture_branch": lambda: dict(model=DataDependentBranch(), example_inputs=(x,)),
        "capture_item_loop": lambda: dict(model=ItemLoopBound(), example_inputs=(x,)),
    }


_COLLECTIVES = (
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "send", "recv",
)


@contextlib.contextmanager
def collectives_forbidden() -> Iterator[list[str]]:
    """Make every torch.distributed collective raise (and record its name) inside the block."""
    from osdp_fx.runtime import collectives as osdp_collectives

    called: list[str] = []

    def forbid(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            called.append(name)
            raise AssertionError(f"collective {name} was called")
        return call

    with contextlib.ExitStack() as stack:
        for name in _COLLECTIVES:
            if hasattr(dist, name):
                stack.enter_context(mock.patch.object(dist, name, forbid(name)))
        for name in ("_all_gather_flat_impl", "_reduce_scatter_flat_impl"):
            stack.enter_context(mock.patch.object(osdp_collectives, name, forbid(name)))
        yield called


def bad_inputs_report(rank: int, world: int, *, tmpdir: str) -> dict[str, dict[str, Any]]:
    """Compile every bad input of :func:`bad_inputs` with collectives forbidden; report each."""
    mine = os.path.join(tmpdir, f"rank{rank}")
    os.makedirs(mine, exist_ok=True)
    report = {}
    for name, make in bad_inputs(mine).items():
        kwargs = make()
        with collectives_forbidden() as called:
            try:
                compile_osdp(kwargs.pop("model"), kwargs.pop("example_inputs"), **kwargs)
                outcome: dict[str, Any] = {"raised": None}
            except Exception as exc:
                outcome = {"raised": type(exc).__name__, "osdp": isinstance(exc, OSDPError),
                           "message": str(exc)}
        outcome["collectives"] = list(called)
        report[name] = outcome
    return report


def compile_per_rank_plan(rank: int, world: int, *, plans: list[Any]) -> None:
    """Compile a small MLP with rank-specific plans (for the plan-mismatch check)."""
    model = small_mlp()
    compile_osdp(model, (torch.randn(2, 4),), plan=plans[rank])


def compile_with_devices(rank: int, world: int, *, devices_world: int) -> None:
    compile_osdp(small_mlp(), (torch.randn(2, 4),), Devices(world_size=devices_world))


def train_one_step(rank: int, world: int, *, plan: str) -> dict[str, Any]:
    """A healthy compile, forward, backward and state-dict round trip (checks a world works)."""
    model = small_mlp()
    compiled = compile_osdp(model, (torch.randn(2, 4),), plan=plan)
    x = torch.full((2, 4), float(rank + 1))
    compiled(x).square().mean().backward()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return {"rank_sum": total.item(), "grads": compiled.full_grads(),
            "state": compiled.full_state_dict()}

"""Functions that run on every rank of a test world (importable by spawned processes)."""

from __future__ import annotations

import json
from typing import Any

import torch

from osdp_fx import compile_osdp

from .held import held_numel
from .models import batches, build, cast_forward, local


def mixed_plan_file(model: str, path: Any, strategies: list[str]) -> str:
    """A plan file giving the model's parameters ``strategies`` in turn, one by one."""
    net, _ = build(model)
    params = {name: strategies[i % len(strategies)]
              for i, (name, _) in enumerate(net.named_parameters())}
    with open(path, "w") as f:
        json.dump({"format": "osdp-fx-plan", "version": 1, "params": params}, f)
    return str(path)


def train(rank: int, world: int, *, model: str, plan: Any, steps: int = 5, lr: float = 0.05,
          local_batch: int = 2, seed: int = 0, mixed_precision: Any = None,
          devices: Any = None, memory_limit: Any = None) -> dict[str, Any]:
    """Train ``model`` with SGD under ``plan`` for ``steps``; return losses and final state.
    ``memory_limit="between"``: the limit a quarter of the way from the predicted peak of
    ``full_shard`` to that of ``replicate`` (each compiled first, not trained)."""
    data = [local(b, rank, world) for b in batches(model, global_batch=local_batch * world,
                                                    steps=steps)]
    if memory_limit == "between":
        peaks = [compile_osdp(build(model, seed)[0], data[0][:1], devices, plan=uniform,
                              mixed_precision=mixed_precision).plan.peak_memory_bytes
                 for uniform in ("full_shard", "replicate")]
        memory_limit = peaks[0] + (peaks[1] - peaks[0]) // 4
    net, loss_fn = build(model, seed)
    compiled = compile_osdp(net, data[0][:1], devices, plan=plan,
                            mixed_precision=mixed_precision, memory_limit=memory_limit)
    return {
        "losses": sgd_losses(compiled, loss_fn, data, lr),
        "state": compiled.full_state_dict(),
        "plan": compiled.plan.to_dict(),
        "local_numel": {n: held_numel(p) for n, p in compiled.named_parameters()},
    }


def sgd_losses(compiled: Any, loss_fn: Any, data: list[Any], lr: float) -> list[float]:
    """Train ``compiled`` with SGD, one step per batch of ``data``; the losses."""
    opt = torch.optim.SGD(compiled.parameters(), lr=lr)
    losses = []
    for batch in data:
        loss = loss_fn(compiled(*batch[:1]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def reference_train(model: str, *, world: int, steps: int = 5, lr: float = 0.05,
                    local_batch: int = 2, seed: int = 0,
                    param_dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Single-process training on the full global batch (run in the test process); with
    ``param_dtype``, computing with parameters and floating inputs cast to it, fp32 updates."""
    net, loss_fn = build(model, seed)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    losses = []
    forward = cast_forward(net, param_dtype)

    for batch in batches(model, global_batch=local_batch * world, steps=steps):
        loss = loss_fn(forward(batch[0]), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "state": net.state_dict()}


def assert_matches_single_process(results: list[dict[str, Any]], model: str,
                                  world_size: int) -> None:
    """Results of :func:`train` on every rank equal :func:`reference_train` on the global batch:
    the mean loss over ranks to 1e-5 at every step, every rank's full state to 1e-4."""
    ref = reference_train(model, world=world_size)
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(ref["losses"]), atol=1e-5, rtol=0)
    for rank_result in results:
        state = rank_result["state"]
        assert list(state) == list(ref["state"]), "full_state_dict keys differ from the model's"
        for key, expected in ref["state"].items():
            torch.testing.assert_close(state[key], expected, atol=1e-4, rtol=0, msg=key)


def assert_trained_like(runs: list[dict[str, Any]], losses: list[float],
                        state: dict[str, torch.Tensor], *, label: str = "",
                        state_key: str = "state", atol: float = 1e-5) -> None:
    """Every rank's run (its ``losses`` and full state under ``state_key``) against one
    process's: the mean loss over ranks and every rank's state to ``atol``."""
    mean = torch.tensor([r["losses"] for r in runs]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(losses), atol=atol, rtol=0, msg=label)
    for r in runs:
        for key, expected in state.items():
            torch.testing.assert_close(r[state_key][key], expected, atol=atol, rtol=0,
                                       msg=f"{label}: {key}")


def memory_profile(rank: int, world: int, *, plan: str, width: int = 512, depth: int = 4,
                   batch: int = 8, prefetch: int | None = None) -> dict[str, int]:
    """Live tensor bytes after forward and peaks of forward and backward, for a Linear stack."""
    from osdp_fx.examples import MLP
    from osdp_fx.runtime.memory import LiveTensorTracker

    torch.manual_seed(0)
    net = MLP((width,) * (depth + 1), bias=False)
    x = torch.randn(batch, width)
    compiled = compile_osdp(net, (x,), plan=plan, prefetch=prefetch)
    del net
    tracker = LiveTensorTracker()
    with tracker:
        out = compiled(x)
        loss = out.square().mean()
        after_forward = tracker.settle(below_bytes=width * width * 4 // 2)
        forward_peak = tracker.peak_bytes
        tracker.reset_peak()
        loss.backward()
        del out, loss
        backward_peak = tracker.peak_bytes
    return {"after_forward": after_forward, "forward_peak": forward_peak,
            "backward_peak": backward_peak}


class FrozenAndBuffers(torch.nn.Module):
    """A frozen layer, a trainable layer, a float buffer and an integer parameter."""

    def __init__(self, buffer_value: float) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.full((4,), buffer_value))
        self.offset = torch.nn.Parameter(torch.tensor([3, 5]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(x)) * self.scale + self.offset.sum()


def frozen_and_buffers(rank: int, world: int, *, plan: str) -> dict[str, Any]:
    """Every rank starts from different values; compile must make them rank 0's."""
    torch.manual_seed(rank)
    net = FrozenAndBuffers(buffer_value=float(rank + 1))
    x = torch.randn(2, 8)
    compiled = compile_osdp(net, (x,), plan=plan)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    compiled(x).sum().backward()
    frozen_grads = [compiled.get_parameter(n).grad for n in ("frozen.weight", "frozen.bias")]
    opt.step()
    return {"state": compiled.full_state_dict(), "plan": compiled.plan.to_dict(),
            "frozen_grads_none": all(g is None for g in frozen_grads)}


def memory_prediction(rank: int, world: int, *, model: str, plan: str, optimizer: str,
                      local_batch: int = 8, mixed_precision: Any = None,
                      devices: Any = None) -> dict[str, Any]:
    """Predicted peak memory of a step against the live-tensor tracker's measurement."""
    from .models import with_loss

    net = with_loss(model)
    batch = local(batches(model, global_batch=local_batch * world, steps=1)[0], rank, world)
    compiled = compile_osdp(net, batch, devices, plan=plan, optimizer=optimizer,
                            mixed_precision=mixed_precision)
    del net
    return _peak_against_tracker(compiled, batch, optimizer)


def _peak_against_tracker(compiled: Any, batch: tuple[Any, ...],
                          optimizer: str) -> dict[str, Any]:
    """``compiled``'s predicted peak against the live-tensor tracker's over a step on
    ``batch`` (after two warm-up steps), and where the prediction peaks."""
    from osdp_fx.runtime.memory import measure_step_peak_bytes

    params = list(compiled.parameters())
    opt = (torch.optim.AdamW(params, lr=1e-3) if optimizer == "adamw"
           else torch.optim.SGD(params, lr=0.1))

    def step() -> None:
        compiled(*batch).backward()
        opt.step()

    measured = measure_step_peak_bytes(step, params, opt, warmup_steps=2,
                                       zero_grad=lambda: opt.zero_grad(set_to_none=True))
    return {"predicted": compiled.plan.peak_memory_bytes, "measured": measured,
            "peak_at": compiled.plan.prediction.peak_at}


def mixed_plan_peak(rank: int, world: int, *, plan_path: str) -> dict[str, Any]:
    """An MLP of 512-wide layers with biases (64 -> 512 -> 512 -> 512 -> 64) under the plan
    file ``plan_path``: its predicted peak against the live-tensor tracker's, SGD, after two
    warm-up steps."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            dims = (64, 512, 512, 512, 64)
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
            return x.square().mean()

    torch.manual_seed(0)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(rank))
    return _peak_against_tracker(compile_osdp(Net(), (x,), plan=plan_path, optimizer="sgd"),
                                 (x,), "sgd")


def searched_plan(rank: int, world: int, *, model: str, plan_dir: str,
                  local_batch: int = 8) -> dict[str, Any]:
    """Search under a limit halfway between the peaks of all-full_shard in 64 KiB buckets (the
    least memory; named, full_shard gathers a block at a time, as FSDP2) and all-replicate;
    then reload the saved plan file, and search again under a limit nothing can meet."""
    from osdp_fx import OSDPError
    from osdp_fx.runtime.memory import measure_step_peak_bytes

    from .models import with_loss

    batch = local(batches(model, global_batch=local_batch * world, steps=1)[0], rank, world)
    least = f"{plan_dir}/full_shard_small_buckets.{rank}.json"
    with open(least, "w") as f:
        json.dump({"format": "osdp-fx-plan", "version": 1, "default": "full_shard",
                   "params": {}, "gather_bucket_bytes": 65536}, f)
    peaks = {s: compile_osdp(with_loss(model), batch, plan=p, optimizer="sgd").plan.peak_memory_bytes
             for s, p in (("replicate", "replicate"), ("full_shard", least))}
    limit = (peaks["replicate"] + peaks["full_shard"]) // 2
    compiled = compile_osdp(with_loss(model), batch, memory_limit=limit, optimizer="sgd")
    params = list(compiled.parameters())
    opt = torch.optim.SGD(params, lr=0.1)

    def step() -> None:
        compiled(*batch).backward()
        opt.step()

    measured = measure_step_peak_bytes(step, params, opt, zero_grad=lambda: opt.zero_grad(set_to_none=True))
    path = f"{plan_dir}/searched.json"
    if rank == 0:
        compiled.plan.save(path)
    torch.distributed.barrier()
    reloaded = compile_osdp(with_loss(model), batch, plan=path, optimizer="sgd").plan
    again = compile_osdp(with_loss(model), batch, memory_limit=limit, optimizer="sgd").plan
    try:
        compile_osdp(with_loss(model), batch, memory_limit=peaks["full_shard"] // 4)
        too_small = ""
    except OSDPError as exc:
        too_small = f"{type(exc).__name__}: {exc}"
    return {"peaks": peaks, "limit": limit, "plan": compiled.plan, "measured": measured,
            "reloaded_hash": reloaded.hash(), "again_hash": again.hash(), "too_small": too_small}


def export_rank0(rank: int, world: int, *, model: str, plan: str) -> dict[str, Any]:
    """Train 2 steps, export with rank0_only/cpu_offload, load into the unwrapped class."""
    net, loss_fn = build(model)
    data = [local(b, rank, world) for b in batches(model, global_batch=2 * world, steps=2)]
    compiled = compile_osdp(net, data[0][:1], plan=plan)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.05)
    for batch in data:
        loss_fn(compiled(*batch[:1]), batch).backward()
        opt.step()
        opt.zero_grad()
    exported = compiled.full_state_dict(rank0_only=True, cpu_offload=True)
    everyone = compiled.full_state_dict()
    fresh, _ = build(model, seed=1)
    loaded = False
    if rank == 0:
        fresh.load_state_dict(exported, strict=True)
        loaded = all(torch.equal(fresh.state_dict()[k], everyone[k]) for k in everyone)
    return {"n_keys": len(exported), "loaded": loaded,
            "devices": {str(v.device) for v in exported.values()}}


def forwards_without_backward(rank: int, world: int, *, model: str, plan: str,
                              calls: int = 4) -> dict[str, Any]:
    """Python tensors alive after each of ``calls`` forwards with autograd on and no backward
    (evaluation without torch.no_grad), then whether a training step still works."""
    import gc

    from .models import with_loss

    batch = local(batches(model, global_batch=4 * world, steps=1)[0], rank, world)
    compiled = compile_osdp(with_loss(model), batch, plan=plan)
    alive = []
    for _ in range(calls):
        compiled(*batch)
        gc.collect()
        alive.append(sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor)))
    loss = compiled(*batch)
    loss.backward()
    return {"alive": alive, "loss": loss.item(),
            "grads": all(p.grad is not None for p in compiled.parameters())}


def slowest_rank_times(rank: int, world: int, *, mismatch: bool = False) -> dict[str, Any]:
    """Each rank's measured node times before and after ``slowest_rank_times_pass``; with
    ``mismatch`` rank 1 profiles a deeper model (a different graph)."""
    from osdp_fx.core.node_meta import osdp_meta
    from osdp_fx.errors import PlanMismatchError
    from osdp_fx.examples import MLP
    from osdp_fx.passes.capture import capture
    from osdp_fx.passes.profile import profile_graph_pass, slowest_rank_times_pass

    class Net(torch.nn.Module):
        def __init__(self, sizes: tuple[int, ...]) -> None:
            super().__init__()
            self.mlp = MLP(sizes)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.mlp(x), y)

    net = Net((24, 40, 8) if mismatch and rank == 1 else (24, 40, 33, 8))
    batch = local(batches("mlp", global_batch=4 * world, steps=1)[0], rank, world)
    gm = capture(net, batch).gm
    profile_graph_pass(gm, batch, warmup=0, repeats=1)

    def times() -> list[tuple[float, float]]:
        return [(p.fwd_time_s, p.bwd_time_s) for n in gm.graph.nodes
                if (p := osdp_meta(n).profile) is not None and p.fwd_time_s is not None]

    before = times()
    try:
        slowest_rank_times_pass(gm)
    except PlanMismatchError as e:
        return {"error": str(e)}
    return {"before": before, "after": times()}


def detect_to_json(rank: int, world: int, *, out_dir: str) -> None:
    """``detect_devices`` on this rank, written to ``node.<rank>.json``; and with the same host
    taken as one node per rank (measuring the inter-node figures) to ``nodes.<rank>.json``."""
    from osdp_fx.planner.detect import detect_devices

    detect_devices(memory_limit="1GiB").to_json(f"{out_dir}/node.{rank}.json")
    detect_devices(ranks_per_node=1).to_json(f"{out_dir}/nodes.{rank}.json")


def links_measured_twice(rank: int, world: int, *, ranks_per_node: int) -> list[list[str]]:
    """The link figures of a world of nodes measured twice in a row (each measurement makes
    its node's group), as a process measures once for ``detect_devices()`` and again when
    ``compile_osdp`` without devices measures its own: the figures' names each time, then the
    names of the per-collective link figures, then those of the timed sizes with the ranks
    they were timed over."""
    import torch

    from osdp_fx.planner import detect

    # two small sizes, three runs: the groups are under test here, not the figures (restored
    # after: the world is shared with other tests)
    saved = detect._COLLECTIVE_SIZES_BYTES, detect._COLLECTIVE_REPEATS
    detect._COLLECTIVE_SIZES_BYTES, detect._COLLECTIVE_REPEATS = (4096, 16384), 3
    try:
        runs = [detect._measure_links(None, torch.device("cpu"), world, ranks_per_node)
                for _ in range(2)]
        return [sorted(figures) + sorted(figures["collective_links"])
                + sorted(f"{key}:{times['group_size']}"
                         for key, times in figures["collective_times"].items())
                for figures in runs]
    finally:
        detect._COLLECTIVE_SIZES_BYTES, detect._COLLECTIVE_REPEATS = saved


def wall_per_cpu_second(rank: int, world: int) -> float:
    """This rank's wall seconds per second of its own work while every rank works at once
    (``detect._wall_per_cpu_second``)."""
    import torch.distributed as dist

    from osdp_fx.planner import detect

    return detect._wall_per_cpu_second(dist.barrier)

"""Cases for split weights as one parameter (issue 58): under a plan that splits linears the
compiled module shows the model's names and shapes, plans answer for the model's names, training
(gradients included: zero_grad, no_sync) is one process's, ``state_dict()`` is local, and a
collective called on one rank alone raises CollectiveError instead of hanging."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from osdp_fx import Devices, clip_grad_norm_, compile_osdp
from osdp_fx.examples import MLP

from .clip_cases import write_split_plan as write_biased_split_plan  # noqa: F401
from .models import local

STEPS = 3
LR = 0.05


def readme_model() -> nn.Module:
    """The README's example model (no biases)."""
    return nn.Sequential(nn.Linear(64, 512, bias=False), nn.GELU(),
                         nn.Linear(512, 512, bias=False), nn.GELU(),
                         nn.Linear(512, 64, bias=False))


def biased_mlp() -> nn.Module:
    return MLP((13, 27, 11, 5))  # layers.1 is 11x27 with a bias: split in 3 uneven parts


MODELS = {"readme": (readme_model, 64, 64), "biased": (biased_mlp, 13, 5)}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name][0]()


def data(name: str, *, global_batch: int, steps: int, seed: int = 1) -> list[tuple[Any, ...]]:
    _, n_in, n_out = MODELS[name]
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, n_in, generator=gen),
             torch.randn(global_batch, n_out, generator=gen)) for _ in range(steps)]


def _groups(module: nn.Module) -> dict[str, list[tuple[list[str], int]]]:
    """Two optimizer recipes' param groups (names, elements): by ``p.dim()`` (nanoGPT's
    weight decay rule) and by name (no decay for biases)."""
    named = list(module.named_parameters())
    recipes = {"dim": [[(n, p) for n, p in named if p.dim() >= 2],
                       [(n, p) for n, p in named if p.dim() < 2]],
               "name": [[(n, p) for n, p in named if "bias" not in n],
                        [(n, p) for n, p in named if "bias" in n]]}
    return {k: [(sorted(n for n, _ in g), sum(p.numel() for _, p in g)) for g in groups]
            for k, groups in recipes.items()}


def _plan_lookups(compiled: Any, names: list[str]) -> dict[str, Any]:
    """``plan[name]`` and ``plan.explain(name)`` for each of the model's parameter names."""
    out = {}
    for name in names:
        entry = compiled.plan[name]
        parts = [p.name for p in getattr(entry, "parts", ())]
        out[name] = {"kind": type(entry).__name__, "strategy": entry.strategy, "parts": parts,
                     "explained": name in compiled.plan.explain(name)
                     and all(p in compiled.plan.explain(name) for p in parts)}
    return out


def _reference(name: str, batches: list[Any], *, adamw: bool) -> dict[str, Any]:
    """One process on the global batches: losses, gradients of the first step, final state."""
    net = build(name)
    opt = (torch.optim.AdamW(net.parameters(), lr=1e-3) if adamw
           else torch.optim.SGD(net.parameters(), lr=LR))
    losses, grads, norms = [], None, []
    for x, y in batches:
        loss = F.mse_loss(net(x), y)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in net.named_parameters()}
        if adamw:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "norms": norms,
            "state": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def _train(compiled: Any, batches: list[Any], *, adamw: bool) -> dict[str, Any]:
    opt = (torch.optim.AdamW(compiled.parameters(), lr=1e-3) if adamw
           else torch.optim.SGD(compiled.parameters(), lr=LR))
    split = {name for name in compiled.param_table.splits}
    losses, grads, norms, layout = [], None, [], {}
    for x, y in batches:
        loss = F.mse_loss(compiled(x), y)
        loss.backward()
        if grads is None:
            grads = compiled.full_grads()  # collective
            table = compiled.param_table
            layout = {  # a split weight's gradient: laid out like it; its parts hold none
                name: {"grad_like_param": tuple(_local(p.grad).shape) == tuple(_local(p).shape)
                       and type(p.grad) is type(p.data),
                       "parts_without_grad": all(table.local(part).grad is None
                                                 for part in table.parts(name))}
                for name, p in compiled.named_parameters() if name in split}
        if adamw:
            norms.append(float(clip_grad_norm_(compiled, 0.5)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    after_zero = {n: p.grad is None for n, p in compiled.named_parameters()}
    return {"losses": losses, "grads": grads, "norms": norms, "layout": layout,
            "after_zero": after_zero, "state": compiled.full_state_dict(), "opt": opt}


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def identity(rank: int, world: int, *, plans: dict[str, tuple[str, Any]],
             path: str) -> dict[str, Any]:
    """Under each plan (label -> (model, plan)): names, shapes, optimizer recipes' groups and
    the plan's answers for the model's names; training like one process (SGD, and for the
    README's model AdamW with clipping as its example does); gradients after ``zero_grad``,
    under ``no_sync()``; ``state_dict()`` on rank 0 alone; DCP of ``state_dict()`` into a model
    under other splits and back."""
    out: dict[str, Any] = {}
    for label, (name, plan) in plans.items():
        model = build(name)
        reference_names = {n: (p.dim(), tuple(p.shape)) for n, p in model.named_parameters()}
        reference_groups = _groups(model)
        batches = data(name, global_batch=4 * world, steps=STEPS)
        mine = [local(b, rank, world) for b in batches]
        adamw = name == "readme"
        compiled = compile_osdp(model, mine[0][:1], plan=plan,
                                optimizer="adamw" if adamw else "sgd",
                                **({"memory_limit": "4MiB"} if plan is None else {}))
        result: dict[str, Any] = {
            "model_names": reference_names,
            "names": {n: (p.dim(), tuple(p.shape)) for n, p in compiled.named_parameters()},
            "model_groups": reference_groups, "groups": _groups(compiled),
            "splits": dict(compiled.plan.splits),
            "lookups": _plan_lookups(compiled, list(reference_names)),
        }
        trained = _train(compiled, mine, adamw=adamw)
        result.update({k: v for k, v in trained.items() if k != "opt"})
        if rank == 0:
            result["reference"] = _reference(name, batches, adamw=adamw)

        # no_sync: two micro-batches, the first inside no_sync, from zeroed gradients
        micro = data(name, global_batch=4 * world, steps=2, seed=5)
        compiled.zero_grad(set_to_none=True)
        with compiled.no_sync():
            F.mse_loss(compiled(local(micro[0], rank, world)[0]),
                       local(micro[0], rank, world)[1]).backward()
        x, y = local(micro[1], rank, world)
        F.mse_loss(compiled(x), y).backward()
        result["accumulated"] = compiled.full_grads()
        compiled.zero_grad(set_to_none=True)
        if rank == 0:
            # the reference starts from the trained state
            net = build(name)
            net.load_state_dict(trained["state"])
            result["accumulated_reference"] = _accumulated_reference_from(net, micro)

        # state_dict() on rank 0 alone: local, so it returns; then both ranks go on together
        if rank == 0:
            start = time.perf_counter()
            state = compiled.state_dict()
            result["state_dict_s"] = time.perf_counter() - start
            params = dict(compiled.named_parameters())
            result["state_dict"] = {
                k: {"type": type(v).__name__, "shape": tuple(v.shape),
                    "shares": k in params and _local(v).untyped_storage().data_ptr()
                    == _local(params[k]).untyped_storage().data_ptr()}
                for k, v in state.items()}
        loss = F.mse_loss(compiled(mine[0][0]), mine[0][1])
        loss.backward()  # collectives on both ranks: still in step
        compiled.zero_grad(set_to_none=True)
        result["after_lone_state_dict"] = compiled.full_state_dict()

        # DCP of state_dict(): into a model under other splits (none), and back
        result["dcp"] = _dcp_across_plans(compiled, name, mine[0][:1], f"{path}/{label}")
        out[label] = result
        del compiled, trained
    return out


def _accumulated_reference_from(net: nn.Module, micro: list[Any]) -> dict[str, torch.Tensor]:
    """Gradients of the sum of the micro-batches' mean losses, on the global micro-batches."""
    for x, y in micro:
        F.mse_loss(net(x), y).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def _dcp_across_plans(compiled: Any, name: str, inputs: tuple[Any, ...], path: str) -> bool:
    """``dcp.save(compiled.state_dict())`` loads (``dcp.load`` into ``state_dict()``, then
    ``load_state_dict``) into the model compiled under full_shard without splits, and that
    one's back into a model under the first one's plan: every full tensor equal. Handed to
    ``load_state_dict`` itself, the split state raises InputError and loads nothing."""
    from osdp_fx.errors import InputError
    from osdp_fx.runtime.sharded import is_split_chunks

    want = compiled.full_state_dict()
    dcp.save(compiled.state_dict(), checkpoint_id=f"{path}/split")
    other = compile_osdp(build(name, seed=11), inputs, plan="full_shard", optimizer="sgd")
    before = other.full_state_dict()
    foreign = any(is_split_chunks(_local(v)) for v in compiled.state_dict().values())
    try:  # a split weight's local tensor that is not a chunk of it: refused
        other.load_state_dict(compiled.state_dict())
        if foreign:
            return False
    except InputError as exc:
        if not foreign or "dcp.load" not in str(exc):
            return False
        after = other.full_state_dict()
        if not all(torch.equal(before[k], after[k]) for k in before):
            return False
    state = other.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/split")
    other.load_state_dict(state)
    got = other.full_state_dict()
    same = all(torch.equal(want[k], got[k]) for k in want)
    dcp.save(other.state_dict(), checkpoint_id=f"{path}/unsplit")
    back = compile_osdp(build(name, seed=12), inputs, plan=compiled.plan, optimizer="sgd")
    state = back.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/unsplit")
    back.load_state_dict(state)
    again = back.full_state_dict()
    # load_state_dict alone: the unsplit model's Shard(0) DTensors (gathered, then cut into
    # the parts), and the parameters themselves (keep_vars=True) of a model under this plan
    direct = compile_osdp(build(name, seed=13), inputs, plan=compiled.plan, optimizer="sgd")
    direct.load_state_dict(other.state_dict())
    from_unsplit = direct.full_state_dict()
    kept = compile_osdp(build(name, seed=14), inputs, plan=compiled.plan, optimizer="sgd")
    kept.load_state_dict(compiled.state_dict(keep_vars=True))
    from_vars = kept.full_state_dict()
    return same and all(torch.equal(want[k], t[k]) for t in (again, from_unsplit, from_vars)
                        for k in want)


def lone_collective(rank: int, world: int, plan: Any, call: str) -> dict[str, Any]:
    """Rank 0 alone calls ``call`` (``full_state_dict`` or ``save_checkpoint``), a collective;
    rank 1 waits, then both finish. Rank 0's error and how long it took."""
    from osdp_fx import save_checkpoint

    torch.manual_seed(0)
    # given devices: a fresh world would measure its machine first, which is not under test
    compiled = compile_osdp(biased_mlp(), (torch.randn(4, 13),), Devices(), plan=plan,
                            optimizer="sgd")
    dist.barrier()
    out: dict[str, Any] = {}
    if rank == 0:
        start = time.perf_counter()
        try:
            if call == "full_state_dict":
                compiled.full_state_dict()
            else:
                save_checkpoint(f"/tmp/osdp-lone-{time.time_ns()}", compiled)
            out["error"] = None
        except Exception as exc:  # noqa: BLE001  (the test checks which)
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["seconds"] = time.perf_counter() - start
    else:
        time.sleep(8)  # past rank 0's collective timeout (4 s)
    out["state_dict_keys"] = list(copy.copy(compiled.state_dict()))  # local: fine alone
    return out


def lone_state_dict_under_every_strategy(rank: int, world: int) -> dict[str, float]:
    """Under each named strategy (the world as 2 nodes of one rank for the two-level ones),
    rank 0 alone calls ``state_dict()``: seconds it took, by plan; then both ranks take a step
    together, which a collective left half-done by the lone call would hang or fail."""
    from osdp_fx import Devices

    seconds = {}
    for plan in ("replicate", "shard_grad_op", "full_shard", "hybrid_shard", "hierarchical"):
        torch.manual_seed(0)
        model, x = biased_mlp(), torch.randn(4, 13)
        devices = Devices(world_size=world, ranks_per_node=1) if plan in (
            "hybrid_shard", "hierarchical") else None
        compiled = compile_osdp(model, (x,), devices, plan=plan, plan_cache=False)
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            state = compiled.state_dict()
            seconds[plan] = time.perf_counter() - start
            assert set(state) == set(model.state_dict()), plan
        compiled(x).sum().backward()  # both ranks, together again
        dist.barrier()
    return seconds

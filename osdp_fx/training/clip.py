"""Gradient clipping by the global norm of a compiled model's gradients.

``clip_grad_norm_(compiled, max_norm)`` is ``torch.nn.utils.clip_grad_norm_`` for an
:class:`~osdp_fx.module.OSDPModule`: the norm is taken over the whole model's gradients, as if they
were the full (unsharded) gradients of one process, and every rank gets the same norm.

* A sharded parameter's ``.grad`` is a DTensor like the parameter: this rank's rows of the
  averaged gradient; every element of the full gradient lives on exactly one rank, except under
  hybrid_shard, where it lives on one rank of every node. Each rank adds up the p-th powers of
  its local elements (the padding is not among them), divided by the number of
  ranks holding the same chunk, and one all-reduce (SUM; MAX for the inf norm, which copies do
  not change) over the world combines them.
* A replicated parameter's ``.grad`` is already averaged and identical on every rank, so it is
  counted once: each rank adds its local value after the all-reduce, never into it.
* Parameters without a gradient (frozen, non-float, unused this step) are skipped.
* A split weight's parts are counted each by its own strategy (a replicated part once, a
  sharded one by its rows on each rank), from their views of the weight's gradient; the
  weight's gradient is scaled once.

Every gradient is then multiplied in place by ``min(1, max_norm / (total + 1e-6))``, exactly as
torch does.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist

from ..errors import InputError
from ..module import OSDPModule
from ..runtime.collectives import (
    WORLD,
    all_reduce_sum_,
    group_size,
    resolve_group,
)
from ..runtime.sharded import local_of

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    compiled: object,
    max_norm: float,
    norm_type: float | str = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip the gradients of a compiled model by their global norm, in place.

    Args:
        compiled: the module returned by :func:`osdp_fx.compile_osdp`, after ``backward()``.
        max_norm: the largest norm the gradients may have after clipping.
        norm_type: the p of the p-norm (a positive number), or ``inf`` (``float("inf")`` or
            ``"inf"``) for the largest absolute element.
        error_if_nonfinite: raise ``RuntimeError`` (on every rank) instead of clipping when the
            total norm is nan or infinite.

    Returns:
        The total norm of the whole model's gradients before clipping (viewed as one vector),
        a 0-d tensor equal on every rank.

    Collective: every rank of the world must call it, with the same arguments, after the same
    backward.
    """
    if not isinstance(compiled, OSDPModule):
        hint = ("; for an uncompiled module use torch.nn.utils.clip_grad_norm_(model.parameters(), "
                "max_norm)" if isinstance(compiled, torch.nn.Module) else "")
        raise InputError(
            f"clip_grad_norm_ needs the module returned by compile_osdp, got "
            f"{type(compiled).__name__}: pass `compiled` from `compiled = compile_osdp(model, "
            f"inputs)`, whose norm is taken over every rank's shards{hint}"
        )
    max_norm = _as_float("max_norm", max_norm)
    if max_norm < 0 or math.isnan(max_norm):
        raise InputError(f"clip_grad_norm_: max_norm must be >= 0, got {max_norm}")
    p = _as_float("norm_type", norm_type)
    if not (p > 0):
        raise InputError(
            f"clip_grad_norm_: norm_type must be a positive number or inf, got {norm_type!r}; "
            "use 2.0 (Euclidean) or float('inf') (largest absolute element)"
        )

    sharded: list[tuple[torch.Tensor | None, int]] = []  # (gradient, copies of each element)
    replicated: list[torch.Tensor | None] = []
    table = compiled.param_table
    for entry in table.entries.values():  # one entry per group: tied parameters counted once
        if not table.local(entry.name).requires_grad:
            continue
        # a part of a split weight: its view of the weight's gradient, laid out as the part is
        grad = table.grad(entry.name)
        if not entry.sharded:
            replicated.append(grad)
        else:
            sharded.append((grad, entry.layout.copies))
    # what is scaled: each parameter's gradient once (a split weight's, not its parts')
    trainable = [table.param(g) for g in table.groups if table.param(g).requires_grad]

    if not trainable:
        return torch.tensor(0.0)
    # Chosen from the parameters (the same on every rank), not from which grads exist.
    acc = torch.float64 if any(q.dtype == torch.float64 for q in trainable) else torch.float32
    device = trainable[0].device

    # a sharded gradient's local tensor holds this rank's rows, without the padding (a split
    # weight's part's, with its zero padding)
    local = {copies: [local_of(g).reshape(-1) for g, c in sharded
                      if c == copies and g is not None]
             for copies in sorted({c for _, c in sharded})}
    rep = [local_of(g) for g in replicated if g is not None]
    if math.isinf(p):
        total = _max_abs([g for grads in local.values() for g in grads], acc, device)
        if sharded and group_size(WORLD) > 1:
            # MAX drops a nan on some reductions; carry "some rank saw nan" as a second value.
            both = torch.stack([torch.where(total.isnan(), 0.0, total), total.isnan().to(acc)])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=resolve_group(WORLD))
            total = both[0] if both[1] == 0 else both[0].new_tensor(float("nan"))
        total = torch.maximum(total, _max_abs(rep, acc, device))  # maximum propagates nan
    else:
        total = sum((_sum_pow(grads, p, acc, device) / copies for copies, grads in local.items()),
                    torch.zeros((), dtype=acc, device=device))
        if sharded:
            all_reduce_sum_(total, WORLD)
        total = (total + _sum_pow(rep, p, acc, device)).pow(1.0 / p)

    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {p} for the gradients of the compiled model is non-finite "
            f"({total.item()}), so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for q in trainable:
            if q.grad is not None:
                grad = local_of(q.grad)
                grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
    return total


def _as_float(what: str, value: object) -> float:
    if isinstance(value, str) and value.lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if (isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor))
            or (isinstance(value, torch.Tensor) and value.numel() != 1)):
        raise InputError(f"clip_grad_norm_: {what} must be a number, got {value!r}")
    return float(value)


def _sum_pow(grads: list[torch.Tensor], p: float, acc: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """Sum over ``grads`` of ``|g|^p``, via per-tensor norms as torch computes them."""
    total = torch.zeros((), dtype=acc, device=device)
    for g in grads:
        if g.numel():
            total += torch.linalg.vector_norm(g, p, dtype=acc).to(device).pow(p)
    return total


def _max_abs(grads: list[torch.Tensor], acc: torch.dtype, device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=acc, device=device)
    for g in grads:
        if g.numel():
            total = torch.maximum(total, torch.linalg.vector_norm(g, math.inf, dtype=acc).to(device))
    return total

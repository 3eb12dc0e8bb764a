"""An optimizer's step over the local tensors of the compiled module's DTensor parameters.

[Note: local optimizer steps]
Under a plan that shards some parameters, the compiled module hands them to the optimizer as
DTensors (``runtime/sharded.py``), as FSDP2 does: ``p.shape`` is the model's, and the
optimizer's state (``exp_avg``, ``momentum_buffer``) is made of DTensors like ``p``, which
``state_dict()`` and ``torch.distributed.checkpoint`` read. Every operation of the step then
goes through DTensor's dispatch, tens of microseconds per parameter and operation on the host,
for an update that is elementwise: each rank computes it on its local tensors either way.

So for torch's elementwise optimizers (:data:`ELEMENTWISE`, their exact classes), a step pre-hook
(torch's global ``register_optimizer_step_pre_hook``) hands the step, in place of the
optimizer, a view of it over local tensors: the same object's attributes, with parameter groups
whose osdp-fx parameters are replaced by their local tensors (detached aliases whose ``.grad``
is the gradient's local tensor) and a state whose DTensors are replaced by their local tensors.
The step updates the same storages as it would through the DTensors. The step's post-hook puts
back what the step added: the state it created for a parameter (on the first step), wrapped as
DTensors of the parameter's spec, as torch would have made it, and any group setting it wrote.
The user's optimizer, its groups and its state hold what they would without the view.

The view is taken only where it computes what the DTensor step computes: every gradient and
state DTensor of an osdp-fx parameter has the parameter's placements and local shape, no
closure is passed (it would compute the gradients after the view read them), no group is
``differentiable``, and torch.compile is not tracing the step. Otherwise the step runs over
the DTensors, as without this module. Parameters of other libraries (an FSDP2 module's
DTensors) are never replaced: only those the runtime marked (:func:`adopt`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_MARK = "_osdp_local_step"
"""The attribute that marks a parameter whose local tensor the optimizer may step."""
_VIEW = "_osdp_local_view"
"""The attribute of an optimizer's view that holds (the optimizer, its (parameter, alias)
pairs, the view's groups)."""
SCALAR_STATE = frozenset({"step", "eta", "mu", "mu_product"})
"""State entries the elementwise optimizers keep as plain scalars, never like the parameter."""

_installed = False
_enabled = True


def _elementwise() -> tuple[type, ...]:
    o = torch.optim
    return (o.SGD, o.Adam, o.AdamW, o.Adagrad, o.Adamax, o.NAdam, o.RAdam, o.RMSprop, o.ASGD,
            o.Adadelta)


ELEMENTWISE: tuple[type, ...] = _elementwise()
"""The optimizers whose step is elementwise in every parameter, gradient and state tensor."""


def adopt(param: torch.Tensor) -> torch.Tensor:
    """Mark ``param``, a DTensor parameter of the compiled module, as one whose optimizer step
    may run over its local tensor, and install the optimizer hooks (once per process)."""
    global _installed
    param.__dict__[_MARK] = True
    if not _installed:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        register_optimizer_step_pre_hook(_pre_step)
        register_optimizer_step_post_hook(_post_step)
        _installed = True
    return param


@contextlib.contextmanager
def over_dtensors() -> Iterator[None]:
    """Steps inside run over the DTensors themselves (what the benchmarks compare against)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "_spec") and hasattr(t, "_local_tensor")


def _pre_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if (not _enabled or type(optimizer) not in ELEMENTWISE
            or any(a is not None for a in args[1:]) or kwargs.get("closure") is not None
            or torch.compiler.is_compiling()):
        return None
    view = _local_view(optimizer)
    if view is None:
        return None
    return (view, *args[1:]), kwargs


def _local_view(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer with local tensors for its marked parameters, or None where any part of
    the step would not be elementwise over them."""
    groups, pairs = [], []
    state: collections.defaultdict[torch.Tensor, Any] = collections.defaultdict(dict)
    with torch.no_grad():
        for group in optimizer.param_groups:
            if group.get("differentiable"):
                return None
            params = []
            for p in group["params"]:
                if not p.__dict__.get(_MARK):
                    params.append(p)
                    if p in optimizer.state:
                        state[p] = optimizer.state[p]
                    continue
                local = p._local_tensor
                placements = p._spec.placements
                grad = p.grad
                if grad is not None and not (
                        _is_dtensor(grad) and grad._spec.placements == placements
                        and grad._local_tensor.shape == local.shape):
                    return None
                alias = local.detach()
                alias.grad = None if grad is None else grad._local_tensor
                if p in optimizer.state:
                    entries = {}
                    for key, value in optimizer.state[p].items():
                        if _is_dtensor(value):
                            if (value._spec.placements != placements
                                    or value._local_tensor.shape != local.shape):
                                return None
                            value = value._local_tensor
                        entries[key] = value
                    state[alias] = entries
                params.append(alias)
                pairs.append((p, alias))
            groups.append({**group, "params": params})
    if not pairs:
        return None
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = groups
    view.state = state
    view.__dict__[_VIEW] = (optimizer, pairs, groups)
    return view


def _post_step(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
    view = args[0] if args else None
    if view is optimizer or view is None or _VIEW not in view.__dict__:
        return
    original, pairs, groups = view.__dict__.pop(_VIEW)
    of_alias = {id(alias): p for p, alias in pairs}
    for key, entries in view.state.items():
        p = of_alias.get(id(key))
        if p is None:  # a plain parameter: its state dict itself
            if original.state.get(key) is not entries:
                original.state[key] = entries
            continue
        kept = original.state.get(p)
        if kept is None:
            kept = original.state[p] = {}
        for name, value in entries.items():
            old = kept.get(name)
            if old is value or (_is_dtensor(old) and old._local_tensor is value):
                continue
            kept[name] = _like(p, name, value)
    for group, stepped in zip(original.param_groups, groups):
        for name, value in stepped.items():
            if name != "params" and group.get(name) is not value:
                group[name] = value
    for _, alias in pairs:
        alias.grad = None


def _like(param: torch.Tensor, name: str, value: Any) -> Any:
    """A state entry the step made over ``param``'s local tensor as the DTensor step makes it:
    a tensor of the local tensor's shape becomes a DTensor of ``param``'s placements, a scalar
    stays as it is."""
    local = param._local_tensor
    if (name in SCALAR_STATE or not isinstance(value, torch.Tensor)
            or value.shape != local.shape):
        return value
    from torch.distributed.tensor import DTensor

    if value.dtype == param.dtype and value.stride() == local.stride():
        return DTensor(value, param._spec, requires_grad=False)
    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)

"""Runtime of a recomputed region: the submodule the recompute pass calls in place of the
region's operators.

:class:`RecomputedRegion` runs its body (a small GraphModule of the region's operators) through
``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: in forward nothing the body saves
for backward is kept but its inputs; backward re-runs the body to re-create it. ``selective``
regions use torch's selective activation checkpointing
(``create_selective_checkpoint_contexts``): the outputs of the operators in
``regions.SELECTIVE_SAVED_OPS`` are cached in forward and reused, the rest recomputed. The RNG
state is saved and restored around the recomputation (``preserve_rng_state``), so dropout draws
the same mask twice.

The region's inputs include the gathered parameters it reads (the all-gather stays outside the
body). Checkpoint saves its inputs with the saved-tensor hooks active around it, so a gathered
full_shard parameter is kept as a handle by ``StepContext`` and backward's re-gather (the one
backward does without recomputation too) feeds the recomputation: no second all-gather.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ..core.regions import SELECTIVE_SAVED_OPS, Recompute
from .params import region_saves

_SAVED_OPS = frozenset(
    getattr(torch.ops.aten, name) for name in SELECTIVE_SAVED_OPS
    if hasattr(torch.ops.aten, name))


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    packet = getattr(op, "overloadpacket", op)
    return (CheckpointPolicy.MUST_SAVE if packet in _SAVED_OPS
            else CheckpointPolicy.PREFER_RECOMPUTE)


selective_contexts = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
"""``checkpoint``'s ``context_fn`` of a selective region (also timed by ``detect_devices``)."""


class RecomputedRegion(nn.Module):
    """A region whose saved activations are dropped after forward and recomputed in backward
    (module docstring). ``policy``: ``selective`` or ``full`` ([Note: recompute policies])."""

    def __init__(self, body: fx.GraphModule, policy: str) -> None:
        super().__init__()
        assert policy != Recompute.SAVE, "a saved region is not wrapped"
        self.body = body
        self.policy = str(Recompute(policy))

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.body(*args)
        kwargs: dict[str, Any] = {}
        if self.policy == Recompute.SELECTIVE:
            kwargs["context_fn"] = selective_contexts
        with region_saves():
            return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=True,
                              **kwargs)

    def extra_repr(self) -> str:
        return f"policy={self.policy}"

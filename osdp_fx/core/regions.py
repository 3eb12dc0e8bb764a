"""Regions of a captured graph that activation recomputation treats as one unit, and the
policies a region can run under: the vocabulary the plan, the cost models and the recompute
pass share.

A *region* is the run of operators one repeated submodule computes: a child of an
``nn.ModuleList`` / ``nn.Sequential`` (its module path ends in an index, e.g.
``model.blocks.3``), read from torch's ``nn_module_stack`` node metadata. Parameters and their
mixed-precision casts never belong to a region: they stay outside and are passed in, so the
all-gather of a sharded parameter is not re-run when the region is recomputed ([Note: recompute
and sharding] in ``passes/recompute.py``).

[Note: recompute policies]
``save``: autograd keeps what the region's operators save (no recomputation).
``selective``: the outputs of the matrix products and attention (:func:`kept_by_selective`) are
kept; everything else the region saves (pointwise ops, norms, softmax, views of parameters) is
dropped after forward and recomputed in backward.
``full``: only the region's inputs are kept; backward re-runs its whole forward.
"""

from __future__ import annotations

import enum
import re

from torch import fx

from ..errors import PlanError
from .node_meta import NodeRole, osdp_meta


class Recompute(str, enum.Enum):
    """What a region keeps for backward ([Note: recompute policies])."""

    SAVE = "save"
    SELECTIVE = "selective"
    FULL = "full"

    def __str__(self) -> str:
        return self.value


POLICIES = tuple(Recompute)

SELECTIVE_SAVED_OPS = frozenset({
    "linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "conv1d", "conv2d", "conv3d",
    "convolution", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
})
"""Operators whose outputs a ``selective`` region keeps (by name: torch functions, tensor
methods and aten overload packets); the recompute runtime saves the aten ops of these names."""

_INDEXED = re.compile(r"\.\d+$")


def op_name(node: fx.Node) -> str:
    """The operator's name: ``linear`` for ``F.linear`` and ``aten.linear.default`` alike."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def kept_by_selective(node: fx.Node) -> bool:
    """Whether a ``selective`` region keeps this operator's outputs (a matrix product or
    attention), rather than recomputing them."""
    return node.op in ("call_function", "call_method") and op_name(node) in SELECTIVE_SAVED_OPS


def region_of(node: fx.Node) -> str | None:
    """The outermost indexed submodule (``model.blocks.3``) the node was traced in, if any."""
    stack = node.meta.get("nn_module_stack") or {}
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if _INDEXED.search(path):
            return path
    return None


def _outside(node: fx.Node) -> bool:
    """Nodes a region never contains: inputs, outputs, parameters (and a replicated one's local
    tensor) and their casts."""
    return (node.op in ("placeholder", "output", "get_attr")
            or osdp_meta(node).role in (NodeRole.PARAM, NodeRole.LOCAL, NodeRole.CAST))


def find_regions(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Each region's operators in graph order, keyed by module path in graph order. A region
    must be one contiguous run of operators (parameters and casts between them aside), contain
    no ``call_module`` and produce a tensor; others are left out."""
    runs: dict[str, list[fx.Node]] = {}
    broken: set[str] = set()
    last: str | None = None
    for node in graph.nodes:
        if _outside(node):
            continue
        name = region_of(node)
        if name is not None and name in runs and last != name:
            broken.add(name)  # the module's operators are interleaved with others
        if name is not None:
            runs.setdefault(name, []).append(node)
            if node.op == "call_module":
                broken.add(name)
        last = name
    return {n: ops for n, ops in runs.items() if n not in broken and len(ops) > 1}


def check_policy(policy: str, *, where: str) -> Recompute:
    """``policy`` as a :class:`Recompute`; raises PlanError naming the choices."""
    try:
        return Recompute(policy)
    except ValueError:
        raise PlanError(f"{where}: recompute policy {policy!r} is unknown; use one of "
                        f"{', '.join(p.value for p in POLICIES)}") from None

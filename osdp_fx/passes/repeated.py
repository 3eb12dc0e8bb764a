"""Repeated blocks: the regions of a graph that are the same graph, wired alike.

The profile pass and the sequence analysis run a graph node by node under fake tensors, where a
node's profile and elements are functions of its operator and its inputs' metadata alone
([Note: same work, one profile] in ``profile_node.py``). A transformer repeats one block: the
80 decoder layers of a Llama-3-70B are 80 copies of its 75 nodes. A block whose nodes are those
of a block run before it, read the same way, on inputs of the same metadata, therefore has that
block's profile node for node, and its outputs have that block's outputs' metadata: the
profiler gives it that block's profiles, renamed, and fresh tensors like its outputs, without
running it ([Note: repeated blocks]).

A *block* is one region of ``core/regions.py`` (a child of an ``nn.ModuleList``) together with
the parameters and casts between its operators: the contiguous run of nodes from its first
operator to its last.

[Note: repeated blocks]
What this module proves before a run (:func:`repeated_blocks`): two blocks of one kind have the
same nodes in the same order with the same operators and constants, each argument read from the
same position (a node of the block, or the block's n-th input from before it), the same
parameter and buffer shapes, dtypes and flags (and which of them are one tensor), and the same
outputs read (where a node's readers all take
an item of its tuple). What the profiler checks during the run (``NodeProfiler``), when it
reaches a block: whether a block of its kind ran on inputs whose metadata equal its own inputs'
(shapes, strides, storages, dtypes, ``requires_grad``, which share a storage, which are
parameters), and whose outputs were plain fresh tensors (no output shares a storage with
another, an input or a parameter). If not, the block runs like any other nodes. A block that
writes into one of its inputs in place is never repeated. ``tests/passes/test_repeated.py``
checks that profiles and elements so made equal those of running every block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..core.regions import find_regions
from .profile_node import PLAIN, outputs_read, writes_inputs


@dataclasses.dataclass(frozen=True)
class Block:
    """One block: a region's operators and the parameters and casts between them."""

    name: str
    """The region's module path (``model.layers.3``)."""
    nodes: tuple[fx.Node, ...]
    """Its nodes in graph order, a contiguous run."""
    inputs: tuple[fx.Node, ...]
    """The nodes before it that its nodes read, in the order they are first read (each node's
    ``all_input_nodes`` in turn)."""
    outputs: tuple[fx.Node, ...]
    """Its nodes (not ``get_attr``) that a node after it reads."""
    kind: int = -1
    """Blocks of the same kind have the same signature ([Note: repeated blocks])."""


def repeated_blocks(gm: fx.GraphModule) -> dict[fx.Node, Block]:
    """The blocks of ``gm`` whose signature another block has ([Note: repeated blocks]), by
    their first node; the node in one block's position ``i`` is the ``i``-th of any other of its
    kind."""
    kinds: dict[Hashable, list[Block]] = {}
    for block in _blocks(gm):
        signature = _signature(gm, block)
        if signature is not None:
            kinds.setdefault(signature, []).append(block)
    return {b.nodes[0]: dataclasses.replace(b, kind=k)
            for k, blocks in enumerate(v for v in kinds.values() if len(v) > 1) for b in blocks}


def _blocks(gm: fx.GraphModule) -> list[Block]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = list(gm.graph.nodes)
    out = []
    for name, ops in find_regions(gm.graph).items():
        run = nodes[order[ops[0]]:order[ops[-1]] + 1]
        inside = set(run)
        inputs = dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside)
        outputs = tuple(n for n in run if n.op != "get_attr"
                        and any(u not in inside for u in n.users))
        out.append(Block(name, tuple(run), tuple(inputs), outputs))
    return out


def _signature(gm: fx.GraphModule, block: Block) -> Hashable | None:
    """What a block computes, up to the names of its nodes, its parameters and its inputs; None
    when it holds something this cannot compare (or writes into an input)."""
    position = {n: i for i, n in enumerate(block.nodes)}
    source = {n: i for i, n in enumerate(block.inputs)}
    tied: dict[int, int] = {}
    parts: list[Any] = []
    for n in block.nodes:
        if n.op not in ("call_function", "call_method", "get_attr"):
            return None
        if n.op == "get_attr":
            value, is_param = _attribute(gm, str(n.target))
            if value is None:
                return None
            parts.append(("get_attr", tuple(value.shape), value.stride(), value.dtype,
                          value.requires_grad, is_param, tied.setdefault(id(value), len(tied))))
            continue
        leaves, spec = pytree.tree_flatten((n.args, n.kwargs))
        args: list[Any] = []
        for x in leaves:
            if isinstance(x, fx.Node):
                args.append(("in", position[x]) if x in position else ("input", source[x]))
            elif isinstance(x, slice):
                args.append(("slice", x.start, x.stop, x.step))
            elif isinstance(x, PLAIN):
                args.append((type(x), x))
            else:
                return None
        if writes_inputs(n) and any(a[0] == "input" for a in args):
            return None
        parts.append((n.op, n.target, str(spec), tuple(args), outputs_read(n)))
    signature = tuple(parts)
    try:
        hash(signature)
    except TypeError:
        return None
    return signature


def _attribute(gm: fx.GraphModule, target: str) -> tuple[torch.Tensor | None, bool]:
    """The parameter or buffer a ``get_attr`` reads, and whether it is a parameter; None when it
    is neither."""
    for get, is_param in ((gm.get_parameter, True), (gm.get_buffer, False)):
        try:
            return get(target), is_param
        except AttributeError:
            pass
    return None, False


@dataclasses.dataclass(frozen=True)
class TensorLike:
    """What a fresh tensor like a block's output needs: its storage and its view of it."""

    storage_numel: int
    dtype: torch.dtype
    device: torch.device
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    is_leaf: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorLike:
        return cls(t.untyped_storage().nbytes() // t.element_size(), t.dtype, t.device,
                   tuple(t.shape), t.stride(), t.storage_offset(), t.requires_grad, t.is_leaf)

    def make(self) -> torch.Tensor:
        """A tensor with this metadata on a storage of its own (in the ambient fake mode)."""
        base = torch.empty(self.storage_numel, dtype=self.dtype, device=self.device)
        if self.requires_grad and not self.is_leaf:  # a view of a non-leaf keeps in-place legal
            return (base.requires_grad_() * 1).as_strided(self.shape, self.stride, self.offset)
        view = base.as_strided(self.shape, self.stride, self.offset).detach()
        return view.requires_grad_(self.requires_grad)


def inputs_key(values: list[Any], param_storages: set[int]) -> Hashable | None:
    """The metadata of a block's input values that its nodes' profiles depend on ([Note:
    repeated blocks]); None when a value is of a kind this cannot compare."""
    storages: dict[int, int] = {}
    same: dict[int, int] = {}
    parts: list[Any] = []
    for value in values:
        leaves, spec = pytree.tree_flatten(value)
        parts.append(str(spec))
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key = x.untyped_storage()._cdata
                parts.append((tuple(x.shape), x.stride(), x.storage_offset(),
                              x.untyped_storage().nbytes(), x.dtype, x.device, x.requires_grad,
                              x.is_leaf, key in param_storages,
                              storages.setdefault(key, len(storages)),
                              same.setdefault(id(x), len(same))))
            elif isinstance(x, PLAIN):
                parts.append((type(x), x))
            else:
                return None
    return tuple(parts)


def outputs_like(values: list[Any], taken: set[int]) -> list[Any] | None:
    """Per output value, its pytree with tensors as :class:`TensorLike`; None when an output is
    of a kind this cannot remake, or shares a storage with another or with ``taken`` (the
    storages of the block's inputs and parameters)."""
    seen = set(taken)
    out = []
    for value in values:
        leaves, spec = pytree.tree_flatten(value)
        made: list[Any] = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                key = x.untyped_storage()._cdata
                if key in seen:
                    return None
                seen.add(key)
                made.append(TensorLike.of(x))
            elif isinstance(x, PLAIN):
                made.append(x)
            else:
                return None
        out.append(pytree.tree_unflatten(made, spec))
    return out


def remake(like: Any) -> Any:
    """A value with the metadata ``like`` records (from :func:`outputs_like`)."""
    return pytree.tree_map_only(TensorLike, TensorLike.make, like)

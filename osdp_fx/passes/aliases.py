"""Analysis pass: which nodes' outputs share storage with which parameters.

The sharding pass frees a gathered full_shard parameter after the last forward use of the
parameter *or any view of it* (``W.t()``, ``W.view(...)``, ``W[idx]`` in an export graph, and
views of its mixed-precision cast, which the shard pass folds into the all-gather); this
pass finds those views by running the graph once on the example inputs and comparing storages.
It writes ``osdp_meta(node).aliases`` and never changes the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._pytree import tree_leaves

from ..core.node_meta import NodeRole, osdp_meta, set_osdp_meta
from .capture import unchanged_state
from .pipeline import GraphPass
from .profile import fake_of


class _AliasInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, storages: dict[int, str],
                 fakes: dict[int, torch.Tensor]) -> None:
        super().__init__(gm)
        self.storages = storages
        self.fakes = fakes  # id of a meta tensor of gm -> its fake stand-in
        self.casts: list[torch.Tensor] = []

    def get_attr(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = super().get_attr(target, args, kwargs)
        return self.fakes.get(id(value), value)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if osdp_meta(n).role == NodeRole.CAST and isinstance(result, torch.Tensor):
            # A mixed-precision cast is the parameter as computed with: its views count too.
            # Keep it alive, so that no later tensor reuses its storage's address.
            self.casts.append(result)
            self.storages[result.untyped_storage()._cdata] = n.args[0].target
        names = frozenset(
            self.storages[key]
            for leaf in tree_leaves(result)
            if isinstance(leaf, torch.Tensor)  # meta tensors' views share their storage too
            and (key := leaf.untyped_storage()._cdata) in self.storages
        )
        if names:
            set_osdp_meta(n, aliases=names)
        return result


def annotate_aliases_pass(gm: fx.GraphModule, example_inputs: tuple[Any, ...], *,
                          meta_device: torch.device | None = None) -> PassResult:
    """Annotate every node with the parameters its output aliases (see module docstring).

    A model on the meta device (``meta_device``: where it will be materialised, which an
    export graph's tensor factories name) runs under FakeTensorMode, its meta tensors standing
    in as fake tensors of ``meta_device``."""
    params = {n.target: gm.get_parameter(n.target) for n in gm.graph.nodes
              if n.op == "get_attr" and osdp_meta(n).role == NodeRole.PARAM}
    mode: Any = contextlib.nullcontext()
    fakes: dict[int, torch.Tensor] = {}
    if meta_device is not None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = {id(t): fake_of(t, mode, meta_device)
                 for t in (*gm.parameters(), *gm.buffers()) if t.device.type == "meta"}
        example_inputs = tuple(fake_of(x, mode, meta_device)
                               if isinstance(x, torch.Tensor) else x for x in example_inputs)
    storages = {fakes.get(id(p), p).untyped_storage()._cdata: name for name, p in params.items()}
    with torch.no_grad(), unchanged_state(gm), mode:
        _AliasInterpreter(gm, storages, fakes).run(*example_inputs)
    return PassResult(gm, False)


@dataclasses.dataclass(frozen=True)
class AnnotateAliases(GraphPass, name="annotate_aliases", requires={"normalized"},
                      ensures={"aliases"}):
    """The pipeline's ``annotate_aliases`` (``passes/pipeline.py``):
    :func:`annotate_aliases_pass` on ``example_inputs``."""

    example_inputs: tuple[Any, ...]
    meta_device: torch.device | None = None

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        return annotate_aliases_pass(graph_module, self.example_inputs,
                                     meta_device=self.meta_device)

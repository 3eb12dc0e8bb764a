"""Analysis pass: which nodes' outputs share storage with which parameters.

The sharding pass frees a gathered full_shard parameter after the last forward use of the
parameter *or any view of it* (``W.t()``, ``W.view(...)``, ``W[idx]`` in an export graph, and
views of its mixed-precision cast, which the shard pass folds into the all-gather); this
pass finds those views by running the graph once on the example inputs and comparing storages.
It writes ``osdp_meta(node).aliases`` and never changes the graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._pytree import tree_leaves

from ..capture import unchanged_state
from ..meta import osdp_meta, set_osdp_meta


class _AliasInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, storages: dict[int, str]) -> None:
        super().__init__(gm)
        self.storages = storages
        self.casts: list[torch.Tensor] = []

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if osdp_meta(n).role == "cast" and isinstance(result, torch.Tensor):
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


def annotate_aliases_pass(gm: fx.GraphModule, example_inputs: tuple[Any, ...]) -> PassResult:
    """Annotate every node with the parameters its output aliases (see module docstring)."""
    storages = {
        gm.get_parameter(n.target).untyped_storage()._cdata: n.target
        for n in gm.graph.nodes if n.op == "get_attr" and osdp_meta(n).role == "param"
    }
    with torch.no_grad(), unchanged_state(gm):
        _AliasInterpreter(gm, storages).run(*example_inputs)
    return PassResult(gm, False)

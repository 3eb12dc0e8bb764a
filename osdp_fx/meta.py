"""The one node-metadata key osdp-fx owns: ``node.meta["osdp"]``, an :class:`OSDPNodeMeta`.

Passes read and write it only through :func:`osdp_meta` and :func:`set_osdp_meta`, and copy it
onto the nodes they create. torch's own keys (``val``, ``tensor_meta``, ``nn_module_stack``) are
read, never written.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import fx

META_KEY = "osdp"


@dataclasses.dataclass
class OSDPNodeMeta:
    """What osdp-fx knows about one node."""

    role: str = "op"
    """'param' (a parameter's get_attr), 'all_gather', 'free', or 'op' for everything else."""
    param: str | None = None
    """Canonical name of the parameter group this node reads, gathers or frees."""
    aliases: frozenset[str] = frozenset()
    """Canonical names of parameters whose storage this node's output shares (views of them)."""
    profile: Any = None
    """Measured costs of this node, written by the profile pass (``passes.profile.NodeProfile``)."""


def osdp_meta(node: fx.Node) -> OSDPNodeMeta:
    """The node's OSDPNodeMeta, created empty on first access."""
    meta = node.meta.get(META_KEY)
    if meta is None:
        meta = node.meta[META_KEY] = OSDPNodeMeta()
    return meta


def set_osdp_meta(node: fx.Node, **fields: Any) -> OSDPNodeMeta:
    """Replace the given fields of the node's OSDPNodeMeta and return it."""
    meta = dataclasses.replace(osdp_meta(node), **fields)
    node.meta[META_KEY] = meta
    return meta

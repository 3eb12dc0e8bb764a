"""The one node-metadata key osdp-fx owns: ``node.meta["osdp"]``, an :class:`OSDPNodeMeta`.

Passes read and write it only through :func:`osdp_meta` and :func:`set_osdp_meta`, and copy it
onto the nodes they create. torch's own keys (``val``, ``tensor_meta``, ``nn_module_stack``) are
read, never written.
"""

from __future__ import annotations

import dataclasses
import enum

from torch import fx

META_KEY = "osdp"


class NodeRole(str, enum.Enum):
    """What a node is to osdp-fx (``OSDPNodeMeta.role``); written by the passes named."""

    OP = "op"
    """Any other node."""
    PARAM = "param"
    """A parameter's ``get_attr`` (capture, ``passes/split_linear.py`` for the parts)."""
    LOCAL = "local"
    """A replicated parameter's local tensor, read from its ``Replicate()`` DTensor under a plan
    that shards others (``passes/shard.py``)."""
    CAST_INPUT = "cast_input"
    """A floating input cast to the compute dtype (``passes/precision.py``)."""
    CAST = "cast"
    """A parameter cast to the compute dtype (``passes/precision.py``)."""
    PREFETCH = "prefetch"
    """An all-gather started ahead of its use (``passes/shard.py``)."""
    ALL_GATHER = "all_gather"
    """A sharded parameter's all-gather, or a bucket's (``passes/shard.py``)."""
    GATHERED = "gathered"
    """One parameter taken out of a bucket's all-gather (``passes/shard.py``)."""
    FREE = "free"
    """The release of a gathered parameter after its last forward use (``passes/shard.py``)."""
    RECOMPUTE = "recompute"
    """A region run through activation checkpointing (``passes/recompute.py``)."""

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class NodeProfile:
    """Measured costs of one node, for one training step at the profiled batch size."""

    fwd_flops: int
    """FLOPs of the node's forward (FlopCounterMode: matmuls, convolutions, attention)."""
    bwd_flops: int
    """FLOPs of the node's backward: gradients of its inputs that require grad."""
    input_bytes: int
    """Bytes of the tensors the node reads (arguments, parameters included)."""
    output_bytes: int
    """Bytes of the tensors the node returns (numel x element size, summed over outputs)."""
    output_is_view: bool
    """True when every tensor output shares storage with an input or parameter (no new memory)."""
    saved_bytes: int
    """Bytes of the distinct storages autograd keeps for backward, parameters' storages excluded."""
    saved_inputs: tuple[str, ...]
    """Names of the argument nodes whose tensors are among those saved (shared activations)."""
    grad_input_bytes: int
    """Bytes of the gradients the backward produces (0 when no input requires grad)."""
    param_bytes: int
    """For a parameter's get_attr node: numel x element size of the parameter; else 0."""
    fwd_time_s: float | None
    """Median measured forward time (autograd recording on); None when profiled with fake=True."""
    bwd_time_s: float | None
    """Median measured backward time; None when profiled with fake=True."""
    saved_params: tuple[str, ...] = ()
    """Names of the parameter (get_attr) argument nodes whose tensors autograd saves."""
    saved_output_bytes: int = 0
    """Bytes of the node's own outputs among the saved storages (counted in saved_bytes too)."""
    saved_input_bytes: int = 0
    """Bytes of the saved storages that are the node's (non-parameter) inputs."""
    fwd_transient_bytes: int = 0
    """Peak bytes the forward allocates beyond what it leaves alive (workspaces); 0 if fake."""
    bwd_transient_bytes: int = 0
    """Peak bytes the backward allocates beyond the gradients it returns; 0 if fake."""
    grad_passthrough: tuple[str, ...] = ()
    """Names of the argument nodes whose gradient the backward returns as the output's gradient
    itself, the same storage (an addition's two operands, a clone): no new tensor."""
    attention: bool = False
    """The node is a fused attention kernel (scaled dot-product attention): a roofline
    estimate of it runs at ``Devices.attention_efficiency`` of the matmul rate."""
    host_time_s: float | None = None
    """Median host seconds dispatching the node's forward and backward together, where the
    host runs apart from the device (a GPU: [Note: timing a node on a GPU]); None where the
    host computes (the CPU, whose node times are host times) or unmeasured."""
    compute_dtype: str = ""
    """Dtype the node computes in (its first floating input's, else output's, e.g. 'bfloat16';
    '' when it has none): the roofline takes that dtype's throughput (``Devices.flops_per_s``)."""

    @classmethod
    def zero(cls, *, output_bytes: int = 0, param_bytes: int = 0, output_is_view: bool = False,
             timed: bool = True) -> NodeProfile:
        """A node that costs nothing to run (placeholder, output, guards, non-tensor ops)."""
        time_s = 0.0 if timed else None
        return cls(
            fwd_flops=0, bwd_flops=0, input_bytes=0, output_bytes=output_bytes,
            output_is_view=output_is_view, saved_bytes=0, saved_inputs=(), grad_input_bytes=0,
            param_bytes=param_bytes, fwd_time_s=time_s, bwd_time_s=time_s,
        )


@dataclasses.dataclass
class OSDPNodeMeta:
    """What osdp-fx knows about one node."""

    role: NodeRole = NodeRole.OP
    """What the node is (:class:`NodeRole`)."""
    param: str | None = None
    """Canonical name of the parameter group this node reads, gathers or frees."""
    aliases: frozenset[str] = frozenset()
    """Canonical names of parameters whose storage this node's output shares (views of them)."""
    profile: NodeProfile | None = None
    """Measured costs of this node, written by the profile pass (``passes/profile.py``)."""
    converts_to_compute_dtype: bool | None = None
    """For a dtype conversion of a graph torch.export captured for mixed precision, traced with
    the floating parameters and inputs in the compute dtype: whether it converts to that dtype
    ([Note: conversions in low precision] in ``passes/precision.py``); None elsewhere."""


def osdp_meta(node: fx.Node) -> OSDPNodeMeta:
    """The node's OSDPNodeMeta, created empty on first access."""
    meta = node.meta.get(META_KEY)
    if meta is None:
        meta = node.meta[META_KEY] = OSDPNodeMeta()
    return meta


def set_osdp_meta(node: fx.Node, **fields: object) -> OSDPNodeMeta:
    """Replace the given fields of the node's OSDPNodeMeta and return it."""
    meta = dataclasses.replace(osdp_meta(node), **fields)
    node.meta[META_KEY] = meta
    return meta

"""How each node's tensors grow with the sequence length (an analysis: the graph is unchanged).

The profile measures bytes at the example's shape, and activations are taken to scale linearly
with the batch size. How they scale with the sequence length differs by node: a projection's
output is linear in it, eager attention scores are quadratic, a weight is constant. This
analysis runs the profile pass's node-by-node measurement under ``FakeTensorMode`` (no values,
no compute) at the example's and two shorter sequence lengths and records, per node, the
elements of its output, of its inputs that are not parameters, and of both, and the bytes it
saves that are neither and its forward and backward temporaries, at each;
``cost_models/shapes.py`` fits a quadratic in the sequence length through the three points.
Only the nodes whose profile shows such bytes are profiled (a tenth of a GPT's nodes; the
factors of the others would multiply zero bytes), the others only run.
The sequence dimension is dimension 1 of every input that has the example's sequence length
there ([Note: input shapes] in ``core/io_spec.py``).

Before and after (a node of a traced GPT, the example 4 x 16 tokens, points 16, 12, 8)::

    %matmul : [num_users=1] = call_function[target=operator.matmul](args = (%q, %k_t))
    numels["matmul"][0][:3] == (4096, 4096, 8192)  # 4 * 4 heads * s * s; q, k: 2 * 4 * 4 * s * 8
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..cost_models.shapes import sequence_points
from ..runtime.memory import LiveTensorTracker
from .profile import NodeProfiler

log = logging.getLogger(__name__)

NodeNumels = dict[str, tuple[tuple[int, ...], ...]]
"""Node name -> per sequence length (output elements, elements of its inputs that are not
parameters, their sum, bytes it saves that are neither, its forward and backward transient
bytes)."""


def sequence_numels(gm: fx.GraphModule, example_inputs: Sequence[Any], *, seq_len: int,
                    meta_device: torch.device | str = "cpu",
                    profiled: Collection[str] | None = None,
                    share_repeats: bool = True) -> NodeNumels | None:
    """Elements per node at each of :func:`sequence_points` (``seq_len`` the example's); None
    when the graph does not run at another sequence length (the model fixes it). Only the
    nodes named in ``profiled`` (None: all) are profiled for the bytes they save or hold beyond
    their tensors (0 for the others); a block that repeats an earlier one takes its elements
    without running (``share_repeats``, [Note: repeated blocks] in ``repeated.py``)."""
    points = sequence_points(seq_len)
    if not points:
        return None
    runs: list[dict[str, tuple[int, ...]]] = []
    for s in points:
        inputs = [_resized(x, seq_len, s) for x in example_inputs]
        try:
            with _quiet(logging.getLogger("torch._subclasses.fake_tensor")):
                runs.append(_Numels(gm, torch.device(meta_device), profiled,
                                    share_repeats=share_repeats).numels(inputs, s))
        except Exception as exc:  # the model fixes its sequence length
            log.info("the graph does not run at sequence length %d (%s: %s): memory is "
                     "predicted for the example's sequence length only", s,
                     type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
    return {name: tuple(run[name] for run in runs) for name in runs[0]}


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """``logger`` silent inside (FakeTensorMode logs, as an error, the failure of an operator
    that this analysis expects when the model fixes its sequence length)."""
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _resized(x: Any, seq_len: int, s: int) -> Any:
    """``x`` with ``s`` in its sequence dimension (the profiler makes it fake)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] != seq_len:
        return x
    shape = (x.shape[0], s, *x.shape[2:])
    return torch.zeros(shape, dtype=x.dtype, device=x.device).requires_grad_(x.requires_grad)


def _numel(value: Any) -> int:
    return sum(t.numel() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


class _FakeLiveTracker(LiveTensorTracker):
    """A LiveTensorTracker that counts fake tensors too: the bytes they would take."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._count(t.untyped_storage())
        return out


def _not_leaf(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy with a gradient function if it is a leaf that requires grad (autograd
    refuses an in-place operator on such a leaf)."""
    return t.clone() if t.requires_grad and t.is_leaf else t


class _NoFlops(contextlib.nullcontext):
    """FLOPs not counted (a fifth of the analysis's time)."""

    def __enter__(self) -> _NoFlops:
        return self

    def get_total_flops(self) -> int:
        return 0


class _Numels(NodeProfiler):
    """The profile pass's node-by-node run under FakeTensorMode, the bytes it measures kept here
    (the graph's profile is not touched)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device,
                 full: Collection[str] | None = None, *, share_repeats: bool = True) -> None:
        super().__init__(gm, warmup=0, repeats=0, fake=True, meta_device=device,
                         share_repeats=share_repeats)
        self.full = full
        """The nodes profiled (None: all); the others are only run, for their elements."""
        self.out: dict[str, tuple[int, ...]] = {}

    def numels(self, inputs: list[Any], seq: int) -> dict[str, tuple[int, ...]]:
        self.profile(inputs, label=f"sizes at sequence length {seq}")
        return self.out

    def tracker(self) -> Any:
        return _FakeLiveTracker()

    def flop_counter(self) -> Any:
        return _NoFlops()

    def _run_node(self, n: fx.Node) -> Any:
        if self.full is None or n.name in self.full:
            result, p = self._run_and_profile(n)
            held = (p.saved_bytes - p.saved_output_bytes - p.saved_input_bytes,
                    p.fwd_transient_bytes, p.bwd_transient_bytes)
            if self.full is not None:  # not a leaf: a later node run as is may change it
                result = pytree.tree_map_only(torch.Tensor, _not_leaf, result)
        else:  # only run, as the model runs (a tenth of the time of a profiled node)
            with torch.enable_grad():
                result, held = fx.Interpreter.run_node(self, n), (0, 0, 0)
        out = _numel(result)
        inputs = sum(_numel(self.env[a]) for a in n.all_input_nodes if a.op != "get_attr")
        self.out[n.name] = (out, inputs, out + inputs, *held)
        return result

    def _take_profile(self, n: fx.Node, twin: fx.Node) -> None:
        self.out[n.name] = self.out[twin.name]

"""How each node's tensors grow with the sequence length (an analysis: the graph is unchanged).

The profile measures bytes at the example's shape, and activations are taken to scale linearly
with the batch size. How they scale with the sequence length differs by node: a projection's
output is linear in it, eager attention scores are quadratic, a weight is constant. This
analysis runs the graph under ``FakeTensorMode`` (no values, no compute) at two more sequence
lengths and records, per node, the elements of its output, of its inputs that are not
parameters, and of both, at each; ``cost_models/shapes.py`` fits a quadratic in the sequence
length through the three points. The sequence dimension is dimension 1 of every input that has the example's
sequence length there ([Note: input shapes] in ``io_spec.py``).

Before and after (a node of a traced GPT, the example 4 x 16 tokens, points 16, 12, 8)::

    %matmul : [num_users=1] = call_function[target=operator.matmul](args = (%q, %k_t))
    numels["matmul"][0] == (4096, 4096, 8192)   # 4 * 4 heads * s * s; q and k: 2 * 4 * 4 * s * 8
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from ..cost_models.shapes import sequence_points
from .profile import fake_of

log = logging.getLogger(__name__)

NodeNumels = dict[str, tuple[tuple[int, int, int], ...]]
"""Node name -> per sequence length (output elements, elements of its inputs that are not
parameters, their sum)."""


def sequence_numels(gm: fx.GraphModule, example_inputs: Sequence[Any], *, seq_len: int,
                    meta_device: torch.device | str = "cpu") -> NodeNumels | None:
    """Elements per node at each of :func:`sequence_points` (``seq_len`` the example's); None
    when the graph does not run at another sequence length (the model fixes it)."""
    points = sequence_points(seq_len)
    if not points:
        return None
    runs: list[dict[str, tuple[int, int, int]]] = []
    for s in points:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        inputs = [_resized(x, seq_len, s, mode, meta_device) for x in example_inputs]
        try:
            with _quiet(logging.getLogger("torch._subclasses.fake_tensor")):
                runs.append(_Numels(gm, mode, torch.device(meta_device)).numels(inputs))
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


def _resized(x: Any, seq_len: int, s: int, mode: FakeTensorMode,
             meta_device: torch.device | str) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    fake = fake_of(x, mode, torch.device(meta_device))
    if x.dim() < 2 or x.shape[1] != seq_len:
        return fake
    shape = (x.shape[0], s, *x.shape[2:])
    with mode:
        out = torch.zeros(shape, dtype=x.dtype, device=fake.device)
    return out.requires_grad_(x.requires_grad)


def _numel(value: Any) -> int:
    return sum(t.numel() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


class _Numels(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, device: torch.device) -> None:
        super().__init__(gm)
        self.mode, self.device = mode, device
        self.out: dict[str, tuple[int, int, int]] = {}

    def numels(self, inputs: list[Any]) -> dict[str, tuple[int, int, int]]:
        with self.mode, torch.no_grad():
            self.run(*inputs, enable_io_processing=False)
        return self.out

    def get_attr(self, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        value = super().get_attr(target, args, kwargs)
        return fake_of(value, self.mode, self.device) if isinstance(value, torch.Tensor) \
            else value

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        out = _numel(result)
        inputs = sum(_numel(self.env[a]) for a in n.all_input_nodes if a.op != "get_attr")
        self.out[n.name] = (out, inputs, out + inputs)
        return result

"""One compiled module's runtime: its gradient synchronisation, and the state each forward
enters and leaves.

``OSDPModule.forward`` runs its graph module inside :meth:`ModuleRuntime.forward`. Entering and
leaving it are runtime code that ``torch.compile`` runs as is ([Note: torch.compile] in
``compile_support.py``): under ``torch.compile(compiled)`` only the regions of the graph are
compiled (``compiled_regions.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from .accumulation import GradSync
from .params import module_scope


@dataclasses.dataclass(frozen=True)
class ModuleRuntime:
    """What one compiled module's forwards share."""

    grad_sync: GradSync
    """Its reducer, reduce-scatter queue and ``no_sync()`` state."""
    regather: bool
    """Whether freed parameters are re-gathered in backward (saved-tensor hooks are installed
    only then: without them autograd keeps its own handling of saved tensors, double backward
    included)."""
    prefetch: int
    """How many parameters ahead backward's re-gathers start."""

    def forward(self) -> ForwardScope:
        """A context for one forward; set its ``output``, then call :meth:`ForwardScope.end`."""
        return ForwardScope(self)


class ForwardScope:
    """One forward of a compiled module: entered, the module scope (``module_scope``) is
    active; :meth:`end` hooks the output for its backward."""

    def __init__(self, runtime: ModuleRuntime) -> None:
        self.runtime = runtime
        self.output: Any = None
        self._sync = False
        self._stack = contextlib.ExitStack()

    @torch.compiler.disable
    def __enter__(self) -> ForwardScope:
        self._sync, scatters = self.runtime.grad_sync.begin_forward()
        self._stack.enter_context(module_scope(scatters, regather=self.runtime.regather,
                                               prefetch=self.runtime.prefetch))
        return self

    @torch.compiler.disable
    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @torch.compiler.disable
    def end(self) -> Any:
        """The forward's output, hooked for its backward (``GradSync.end_forward``)."""
        return self.runtime.grad_sync.end_forward(self.output, self._sync)

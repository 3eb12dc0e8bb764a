"""A small pass runner: names each pass, logs what it did, wraps failures with the pass's name."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

log = logging.getLogger(__name__)

Pass = Callable[[fx.GraphModule], PassResult]


class PassFailed(RuntimeError):
    """A pass raised an internal error (not a user error); the message names the pass."""


def run_passes(
    gm: fx.GraphModule, passes: Iterable[tuple[str, Pass]], *, disabled: Iterable[str] = ()
) -> fx.GraphModule:
    """Run ``passes`` in order on ``gm``; skip those named in ``disabled``."""
    from ..errors import OSDPError

    skip = set(disabled)
    for name, fn in passes:
        if name in skip:
            log.info("pass %s: disabled", name)
            continue
        start = time.perf_counter()
        try:
            result = fn(gm)
        except OSDPError:
            raise
        except Exception as exc:
            raise PassFailed(f"pass {name!r} failed: {type(exc).__name__}: {exc}") from exc
        gm = result.graph_module
        log.info("pass %s: %s in %.3f s", name, "modified" if result.modified else "no change",
                 time.perf_counter() - start)
    return gm

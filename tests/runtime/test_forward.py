"""One compiled module's forward scope (osdp_fx/runtime/forward.py): entering asks GradSync
where this forward's gradients go and makes that the active module scope (with the step
context that re-gathers freed parameters when the plan asks for it), leaving pops it, even
after an error; ``end`` hands the output to GradSync with the forward's sync flag."""

from __future__ import annotations

import pytest
import torch

from osdp_fx.runtime import params
from osdp_fx.runtime.forward import ModuleRuntime
from osdp_fx.runtime.regather import StepContext


class StubSync:
    def __init__(self, synced: bool) -> None:
        self.synced, self.scatters, self.ended = synced, object(), []

    def begin_forward(self):
        return self.synced, self.scatters

    def end_forward(self, output, sync):
        self.ended.append((output, sync))
        return ("hooked", output)


@pytest.mark.parametrize("regather", [False, True])
def test_the_scope_is_active_inside_and_gone_after(regather):
    sync = StubSync(synced=True)
    runtime = ModuleRuntime(sync, regather=regather, prefetch=3)
    assert params._scope() is None
    with runtime.forward() as scope:
        active = params._scope()
        assert active.scatters is sync.scatters and params._scatters() is sync.scatters
        if regather:
            assert isinstance(active.step, StepContext)
            assert active.step is params._active()
        else:
            assert active.step is None and params._active() is None
        scope.output = torch.ones(2)
    assert params._scope() is None
    result = scope.end()
    assert result[0] == "hooked" and sync.ended == [(scope.output, True)]


def test_a_no_sync_forward_ends_unsynchronised_and_an_error_still_pops_the_scope():
    sync = StubSync(synced=False)
    runtime = ModuleRuntime(sync, regather=True, prefetch=1)
    with pytest.raises(RuntimeError, match="boom"), runtime.forward():
        raise RuntimeError("boom")
    assert params._scope() is None
    with runtime.forward() as scope:
        scope.output = "out"
    scope.end()
    assert sync.ended == [("out", False)]

"""A rank that fails in the middle of a step makes the others fail too, within the timeout.

Rank 1 of a 2-rank gloo world (process group ``timeout=`` 10 s, set as users set it in
``init_process_group``) fails after the forward of its second training step; rank 0 is then in
the backward's collectives (full_shard: re-gathers and reduce-scatters). Rank 0 must end with an
exception, never hang. The three faults run in three worlds at the same time (one fixture) to
keep the wall time down; ``BOUND_S`` is only a hang guard on the test, not a performance claim.
"""

from __future__ import annotations

import pytest
import torch
from harness import fault_cases as fc

TIMEOUT_S = 10.0  # init_process_group(..., timeout=timedelta(seconds=TIMEOUT_S))
BOUND_S = 60.0  # hang guard: start-up of six processes on a busy 2-core machine + the timeout


@pytest.fixture(scope="module")
def faults():
    return fc.run_faults(fc.FAULTS, timeout_s=TIMEOUT_S, bound_s=BOUND_S)


def check_survivor(result, *, within_s):
    assert not result["hung"], f"rank 0 did not report within {BOUND_S} s: {result}"
    rank0 = result["rank0"]
    assert not rank0["ok"], "rank 0 finished the step although rank 1 failed"
    assert rank0["type"] == "RuntimeError", rank0["traceback"]
    # The error reached rank 0 in the backward it entered after the fault, not earlier.
    assert rank0["error_at"] >= rank0["entered_backward"]
    assert result["detect_s"] <= within_s, result["detect_s"]
    assert result["rank0_exitcode"] == 0, "rank 0 did not exit by itself after the error"
    return rank0["error"]


def test_peer_raises_and_exits(faults):
    """The failing process ends (an uncaught exception): rank 0 fails at once, well before the
    timeout, with gloo's 'Connection closed by peer'."""
    r = faults["raise"]
    assert r["rank1"]["type"] == "InjectedFault" and r["rank1_exitcode"] == 1
    error = check_survivor(r, within_s=TIMEOUT_S + 5)
    assert "Connection closed by peer" in error or "Connection reset by peer" in error, error


def test_peer_raises_and_stays_alive(faults):
    """The failing rank stays alive outside any collective: only the process group's timeout
    ends rank 0's wait, after TIMEOUT_S seconds, with gloo's 'Timed out waiting 10000ms'."""
    r = faults["raise_and_linger"]
    assert r["rank1"]["type"] == "InjectedFault"
    error = check_survivor(r, within_s=TIMEOUT_S + 5)
    assert f"Timed out waiting {int(TIMEOUT_S * 1000)}ms" in error, error
    assert r["detect_s"] >= TIMEOUT_S - 0.5, "failed before the timeout: not the timeout path"


def test_peer_killed(faults):
    """SIGKILL: rank 0 fails at once with gloo's 'Connection reset by peer' (or 'closed')."""
    r = faults["kill"]
    assert "rank1" not in r and r["rank1_exitcode"] == -9
    error = check_survivor(r, within_s=TIMEOUT_S + 5)
    assert "Connection reset by peer" in error or "Connection closed by peer" in error, error


def test_replicated_gradients_are_averaged_after_a_failed_backward(worlds):
    results = worlds(2).run(fc.backward_fails_then_trains)
    torch.testing.assert_close(results[0]["grad"], results[1]["grad"], rtol=0, atol=0)

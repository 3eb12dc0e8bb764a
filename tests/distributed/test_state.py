"""Buffers and parameters start from rank 0's values; frozen and integer parameters stay put
(sharded like the others, never reduced)."""

from __future__ import annotations

import pytest
import torch
from harness import cases


@pytest.mark.parametrize("plan", ["full_shard", "replicate"])
def test_rank0_values_win_and_frozen_params_are_never_reduced(worlds, plan):
    results = worlds(2).run(cases.frozen_and_buffers, plan=plan)
    torch.manual_seed(0)
    rank0_initial = cases.FrozenAndBuffers(buffer_value=1.0).state_dict()

    for r in results:
        assert r["frozen_grads_none"]
        params = r["plan"]["params"]
        # a frozen parameter takes the plan's strategy, an integer one too
        for name in ("frozen.weight", "offset"):
            assert params[name] == {**params[name], "strategy": plan, "note": "frozen"}
        assert params["head.weight"]["strategy"] == plan
        for key in ("scale", "frozen.weight", "frozen.bias", "offset"):
            torch.testing.assert_close(r["state"][key], rank0_initial[key], rtol=0, atol=0)
        for key in r["state"]:
            torch.testing.assert_close(r["state"][key], results[0]["state"][key], rtol=0, atol=0)
    # The trainable head did train.
    assert not torch.equal(results[0]["state"]["head.weight"], rank0_initial["head.weight"])

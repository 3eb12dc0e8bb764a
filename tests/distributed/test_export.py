"""full_state_dict(rank0_only=True, cpu_offload=True) exports a model the original class loads."""

from __future__ import annotations

import pytest
from harness import cases


@pytest.mark.parametrize("plan", ["full_shard", "shard_grad_op"])
@pytest.mark.parametrize("model", ["gpt", "hf_gpt2"])
def test_rank0_export_loads_into_the_unwrapped_model(worlds, model, plan):
    results = worlds(2).run(cases.export_rank0, model=model, plan=plan)
    assert results[0]["n_keys"] > 0 and results[0]["loaded"]
    assert results[0]["devices"] == {"cpu"}
    assert results[1]["n_keys"] == 0

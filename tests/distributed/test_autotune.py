"""``compile_osdp(autotune=K)`` on a real gloo world: it times the best predicted plans on the
example inputs, every rank keeps the same one, the plan records the measured times, the model's
values are left alone, and training with the kept plan matches one process."""

from __future__ import annotations

import re

from harness import autotune_cases as ac
from harness import cases

LIMIT = 560_000  # bytes: the harness GPT's search finds several distinct plans that fit


def test_autotune_keeps_a_measured_plan_that_every_rank_agrees_on(worlds):
    results = worlds(2).run(ac.train_autotuned, model="gpt", limit=LIMIT, autotune=3)
    assert len({r["hash"] for r in results}) == 1
    for r in results:
        timed = r["plan"]["autotuned"]
        assert len(timed) >= 2, r["table"]  # several distinct plans fit at this limit
        assert len({t["hash"] for t in timed}) == len(timed)
        predicted_best = min(timed, key=lambda t: t["predicted_step_s"])["hash"]
        # the fastest measured is in force, or the predicted best when the timing cannot tell
        # them apart (autotune.keep_index)
        assert r["hash"] in (timed[0]["hash"], predicted_best)
        assert all(t["measured_step_s"] > 0 and t["predicted_step_s"] > 0 for t in timed)
        assert [t["measured_step_s"] for t in timed] == sorted(
            t["measured_step_s"] for t in timed)
        assert r["plan"]["autotuned"] == results[0]["plan"]["autotuned"]  # the same times
        assert re.search(rf"autotuned: .*{r['hash']} [\d.]+ ms \(predicted [\d.]+\) in force",
                         r["table"]), r["table"]
        assert r["model_unchanged"]
    cases.assert_matches_single_process(results, "gpt", 2)

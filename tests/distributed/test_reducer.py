"""Replicated gradients are all-reduced in buckets started during backward (overlapped), in
bucket order, and average the ranks' gradients exactly as an all-reduce at the end would."""

from __future__ import annotations

import torch
from harness import reducer_cases


def test_buckets_start_during_backward_and_average_the_ranks_gradients(worlds):
    results = worlds(2).run(reducer_cases.overlapped_buckets)
    expected = {n: (g0 + g1) / 2 for (n, g0), g1 in zip(
        reducer_cases.local_grads(0).items(), reducer_cases.local_grads(1).values())}
    for r in results:
        assert r["buckets"] == 4
        # when backward reaches layer 0's output, layers 3, 2 and 1 (buckets 0-2) have their
        # gradients and their all-reduces have started; layer 0's (bucket 3) has not
        assert r["started_at_first_layer"] == [3, 3]
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7)


def test_gloo_reduce_scatter_holds_its_input_once(worlds):
    """On gloo a reduce-scatter is an all-reduce of a copy of the input ([Note: gloo
    reduce-scatter]): osdp-fx makes that copy itself, or reduces a buffer handed over in place,
    so what is alive once it completes is the input (unless handed over) and the chunk, not the
    copy gloo's own reduce_scatter_tensor keeps in its work object."""
    numel = 1 << 18
    results = worlds(2).run(reducer_cases.gloo_reduce_scatter, numel=numel)
    total = torch.arange(numel, dtype=torch.float32) * 3  # (rank 0 + 1) + (rank 1 + 1)
    for rank, r in enumerate(results):
        for consume in (False, True):
            torch.testing.assert_close(r[consume]["chunk"], total.chunk(2)[rank], rtol=0, atol=0)
        assert r[False]["input_kept"] and r[False]["extra_bytes"] == 0
        # handed over: reduced in place and freed
        assert not r[True]["input_kept"] and r[True]["extra_bytes"] == -numel * 4


def test_a_send_buffer_handed_to_an_all_gather_is_freed_when_it_completes(worlds):
    """A bucket's all-gather sends its members' shards concatenated, a buffer of the runtime's
    own: it is released when the gather is waited for, not when gloo's worker thread lets go
    of its work object (a few milliseconds late, which now and then made a step of the
    memory-promise Llama measure up to 0.4 MiB over its prediction). One the caller keeps
    stays."""
    numel = 1 << 16
    for r in worlds(2).run(reducer_cases.gloo_all_gather_send_buffer, numel=numel):
        for consume in (False, True):
            torch.testing.assert_close(r[consume]["gathered"],
                                       torch.arange(2 * numel, dtype=torch.float32),
                                       rtol=0, atol=0)
        assert r[False]["send_bytes"] == numel * 4 and r[True]["send_bytes"] == 0


def test_an_all_gather_output_is_the_callers_alone_when_waited_for(worlds):
    """gloo's worker thread holds a completed collective's tensors until it loops round ([Note:
    gloo's last reference]): ``wait()`` returns a CPU all-gather's output only once the worker
    has let go, so that a gathered weight is freed where its last user drops it."""
    gathers, numel = 200, 1 << 12
    for r in worlds(2).run(reducer_cases.gloo_all_gather_outputs_let_go, gathers=gathers,
                           numel=numel):
        assert r["held_elsewhere"] == 0
        assert r["total"] == gathers * numel * (1.0 + 2.0)


def test_replicated_parameters_of_a_mixed_plan_get_their_gradients_as_replicate_does(
        worlds, tmp_path):
    """Under a plan that shards one group, the replicated parameters are ``Replicate()``
    DTensors whose local tensors the graph reads as autograd leaves ([Note: a replicated
    parameter's local leaf]): each gets a DTensor gradient equal to what ``replicate`` gives,
    accumulated over two backwards, fresh after ``zero_grad``, after ``.double()`` too, and
    the post-accumulate-grad hooks registered on the parameter run once per backward."""
    plan = tmp_path / "mixed.json"
    plan.write_text('{"format": "osdp-fx-plan", "version": 1, "default": "replicate", '
                    '"params": {"layers.0.weight": "full_shard"}}')
    results = worlds(2).run(reducer_cases.replicated_in_a_mixed_plan, plan=str(plan))
    for r in results:
        mixed, plain = r["mixed"], r["replicate"]
        replicated = [n for n in mixed["placements"] if n != "layers.0.weight"]
        assert replicated and all(mixed["placements"][n] == "(Replicate(),)" for n in replicated)
        assert mixed["placements"]["layers.0.weight"] == "(Shard(dim=0),)"
        # the graph's leaves: the local tensors, before and after ``.double()`` converted them
        for leaves in mixed["leaves"]:
            assert {n: leaves[n] for n in replicated} == dict.fromkeys(replicated, True)
        for n in replicated:
            assert mixed["hooks"][n] == ["DTensor"] * 4, n  # once a backward, p.grad set
            assert mixed["double"][n] == (torch.float64, "DTensor"), n
            for key in ("once", "again"):
                torch.testing.assert_close(mixed[key][n], plain[key][n], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(mixed["twice"][n], 2 * mixed["once"][n],
                                       rtol=1e-6, atol=1e-7)
        assert all(calls == ["Tensor"] * 4 for calls in plain["hooks"].values())


def test_the_collective_clock_counts_launches_and_waits(worlds):
    """``collective_clock()`` counts each collective the runtime starts and each first wait for
    one (a blocking collective as a wait), only while it is open, and a clock opened inside it
    takes what runs inside from the outer one ([Note: the collective clock])."""
    for rank, r in enumerate(worlds(2).run(reducer_cases.clocked_collectives)):
        assert r["before"] == [1.0] * 8 and r["buckets"] == 2
        assert r["after_reducer"] == (2, 2)  # the reducer's two buckets, started and awaited
        launches, waits, launch_s, wait_s = r["counts"]
        assert (launches, waits) == (4, 4) and launch_s > 0 and wait_s > 0
        assert r["inner"][:2] == (0, 1) and r["inner"][2] > 0
        assert r["gathered"] == [0.0] * 4 + [1.0] * 4 and r["chunk"] == [2.0, 2.0]

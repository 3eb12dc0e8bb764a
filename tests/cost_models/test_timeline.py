"""Unit tests of the timeline memory model's pieces that need no profiled graph."""

from __future__ import annotations

import warnings
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from osdp_fx.cost_models.live_bytes import Timeline
from osdp_fx.cost_models.timeline import BATCH, Category, _envelope


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.integers(0, 200)), min_size=1, max_size=15),
    st.integers(1, 8),
)
def test_envelope_equals_the_max_over_all_time_points(lines, profiled_batch):
    expr = _envelope(list(lines), profiled_batch)
    for b in (1, 2, 3, 7, 16, 100, 10_000):
        expected = max(Fraction(s * b, profiled_batch) + f for s, f in lines)
        assert Fraction(str(expr.subs(BATCH, b))) == expected


def test_sweep_reads_the_peak_after_allocations_and_before_frees():
    tl = Timeline()
    tl.alive(0, 2, 100, Category.ACTIVATIONS, scaled=True)  # an activation from t=0 to t=2
    tl.alive(1, 1, 50, Category.TEMPORARIES, scaled=False)  # a transient at t=1
    tl.alive(2, 3, 30, Category.GRADIENTS, scaled=False)  # allocated while the activation lives
    points = {t: (sum(s for s, _ in by.values()), sum(f for _, f in by.values()))
              for t, by in tl.sweep({Category.PARAMETERS: 7})}
    assert points == {0: (100, 7), 1: (100, 57), 2: (100, 37), 3: (0, 37)}
    by_category = dict(tl.sweep({Category.PARAMETERS: 7}))[2]
    assert by_category[Category.GRADIENTS] == (0, 30)
    assert by_category[Category.ACTIVATIONS] == (100, 0)
    assert by_category[Category.PARAMETERS] == (0, 7)


def test_the_searches_peak_equals_the_full_prediction():
    """``predict_peak_bytes`` (what the searches check plans with) gives the full prediction's
    peak: every strategy, recomputation, accumulation, another batch, prefetch and buckets."""
    import torch

    from osdp_fx.core.buckets import Schedule
    from osdp_fx.core.devices import Devices
    from osdp_fx.core.setting import StepSetting
    from osdp_fx.cost_models.timeline import predict_peak_bytes, predict_step_memory
    from osdp_fx.examples import GPTWithLoss, TinyGPT
    from osdp_fx.passes.capture import capture
    from osdp_fx.planner.analysis import analyze, param_states

    torch.manual_seed(0)
    net = GPTWithLoss(TinyGPT(vocab=64, dim=32, depth=2, heads=2, max_seq=16))
    x = torch.randint(0, 64, (2, 16))
    analysis = analyze(capture(net, (x,)), (x,), fake=True)
    names = list(analysis.captured.params)
    mixed = {n: ("replicate", "shard_grad_op", "full_shard")[i % 3] for i, n in enumerate(names)}
    for strategies in (mixed, {n: "full_shard" for n in names}, {n: "replicate" for n in names}):
        for kw, step in (({}, {}),
                         ({"recompute": {"model.blocks.0": "full",
                                         "model.blocks.1": "selective"}}, {}),
                         ({}, {"grad_accumulation": 3, "batch_size": 5}),
                         ({}, {"schedule": Schedule(prefetch=2, reduce_bucket_bytes=4096,
                                                    gather_bucket_bytes=1 << 20)})):
            args = dict(setting=StepSetting(Devices(world_size=2), optimizer="adamw", **step),
                        profiled_batch=2, **kw)
            states = param_states(analysis, strategies)
            full = predict_step_memory(analysis.captured.gm, states, **args).peak_bytes
            assert predict_peak_bytes(analysis.captured.gm, states, **args) == full, kw


def test_buffers_and_constants_are_held_throughout_once_each():
    """A module's buffers (one storage once, however many tensors view it) and the tensor
    constants its graph reads count in every point of the step; parameters do not."""
    import torch
    from torch import fx, nn

    from osdp_fx.cost_models.timeline import constant_bytes

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("mask", torch.ones(256))  # 1 KiB
            self.register_buffer("head", self.mask[:128])  # a view of the same storage

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.mask[:4] + self.head[:4]

    gm = fx.symbolic_trace(Net())
    gm.table = torch.zeros(64, dtype=torch.int64)  # a constant the graph reads: 512 B
    with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op == "output")), \
            warnings.catch_warnings():  # a plain attribute, as torch.export's lifted constants
        warnings.simplefilter("ignore")
        gm.graph.get_attr("table")
    gm.recompile()
    assert constant_bytes(gm) == 1024 + 512


_EVENT = st.tuples(st.integers(0, 30).map(lambda t: t / 4), st.integers(-4, 40).map(lambda d: d / 4),
                   st.integers(0, 10**9), st.sampled_from(list(Category)), st.booleans(),
                   st.sampled_from(["", "", "sync", "local"]))


@settings(max_examples=300, deadline=None)
@given(events=st.lists(_EVENT, max_size=40), base=st.integers(0, 10**6),
       micro=st.sampled_from(["sync", "local"]))
def test_the_peak_is_the_largest_total_of_the_sweep(events, base, micro):
    """The peak the searches ask for (one running total at the profiled batch, or per category
    at another) is the largest live total of the step-by-step sweep."""
    tl = Timeline()
    for start, length, nbytes, category, scaled, only in events:
        tl.alive(start, start + length, nbytes, category, scaled=scaled, only=only)
    points = tl.sweep({Category.PARAMETERS: base}, micro)
    for batch, profiled in ((4, 4), (8, 4), (3, 4)):
        expected = max((sum(sc * batch // profiled + fx for sc, fx in by.values())
                        for _, by in points), default=base)
        assert tl.peak({Category.PARAMETERS: base}, micro, batch, profiled) == expected

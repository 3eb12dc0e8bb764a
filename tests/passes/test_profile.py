"""Profile pass: closed-form FLOPs and bytes per node, sums equal to whole-model FlopCounterMode,
fake mode equal to real mode, graph unchanged."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from osdp_fx.core.node_meta import osdp_meta
from osdp_fx.errors import InputError
from osdp_fx.passes import profile as profile_module
from osdp_fx.passes.profile import NodeProfile, profile_graph_pass, summarize_profile

FAST = {"warmup": 0, "repeats": 1}
F32 = 4


# -- graphs in the canonical form: parameters read by get_attr, consumed by call_function -------

class _FunctionalTracer(fx.Tracer):
    """Keeps only parameter-free torch.nn modules as call_module; traces through the others."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return super().is_leaf_module(m, qualname) and not any(True for _ in m.parameters())


def trace(model: nn.Module) -> fx.GraphModule:
    return fx.GraphModule(model, _FunctionalTracer().trace(model))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 48), nn.Linear(48, 8)
        self.act, self.drop = nn.ReLU(inplace=True), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        a = F.scaled_dot_product_attention(self._heads(q), self._heads(k), self._heads(v),
                                           is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)


class TinyGPT(nn.Module):
    """Two blocks, SDPA attention, lm_head tied to the token embedding."""

    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 4, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList([Block(dim, heads), Block(dim, heads)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Params(nn.Module):
    """Holds parameters for the one-operator modules below."""

    def __init__(self, **params: torch.Tensor) -> None:
        super().__init__()
        for name, value in params.items():
            self.register_parameter(name, nn.Parameter(value))


class Linear(Params):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w, self.b)


class MatMul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


class Embedding(Params):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.w)


class Attention(nn.Module):
    def __init__(self, *, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)


class Transpose(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


def profiles_by_target(gm: fx.GraphModule) -> dict[str, NodeProfile]:
    return {str(n.target) if n.op in ("get_attr", "placeholder") else n.name: osdp_meta(n).profile
            for n in gm.graph.nodes}


def compute_node(gm: fx.GraphModule) -> NodeProfile:
    (node,) = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    return osdp_meta(node).profile


# -- closed-form expectations ------------------------------------------------------------------

@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_linear_flops_and_bytes(x_requires_grad: bool) -> None:
    m, k, n = 8, 12, 20
    gm = trace(Linear(w=torch.randn(n, k), b=torch.randn(n)))
    x = torch.randn(m, k, requires_grad=x_requires_grad)
    profile_graph_pass(gm, (x,), **FAST)
    p = compute_node(gm)
    assert p.fwd_flops == 2 * m * n * k
    assert p.bwd_flops == (4 if x_requires_grad else 2) * m * n * k  # grad of x, grad of W
    assert p.output_bytes == m * n * F32
    assert p.saved_bytes == m * k * F32  # x; the saved weight is parameter memory
    assert p.saved_inputs == ("x",)
    assert p.input_bytes == (m * k + n * k + n) * F32
    assert p.grad_input_bytes == ((m * k if x_requires_grad else 0) + n * k + n) * F32
    params = profiles_by_target(gm)
    assert params["w"].param_bytes == n * k * F32 and params["b"].param_bytes == n * F32
    assert params["x"].param_bytes == 0 and params["x"].output_bytes == m * k * F32
    assert p.fwd_time_s > 0 and p.bwd_time_s > 0


def test_matmul_flops_and_bytes() -> None:
    m, k, n = 6, 10, 14
    gm = trace(MatMul())
    a, b = torch.randn(m, k, requires_grad=True), torch.randn(k, n, requires_grad=True)
    profile_graph_pass(gm, (a, b), **FAST)
    p = compute_node(gm)
    assert (p.fwd_flops, p.bwd_flops) == (2 * m * n * k, 4 * m * n * k)
    assert p.saved_bytes == (m * k + k * n) * F32
    assert p.saved_inputs == ("a", "b")
    assert p.output_bytes == m * n * F32 and not p.output_is_view


def test_embedding_has_no_flops_and_counts_bytes() -> None:
    vocab, dim, batch, seq = 30, 8, 3, 5
    gm = trace(Embedding(w=torch.randn(vocab, dim)))
    idx = torch.randint(0, vocab, (batch, seq))
    profile_graph_pass(gm, (idx,), **FAST)
    p = compute_node(gm)
    assert (p.fwd_flops, p.bwd_flops) == (0, 0)
    assert p.output_bytes == batch * seq * dim * F32
    assert p.saved_bytes == batch * seq * idx.element_size()  # the indices, not the table
    assert p.grad_input_bytes == vocab * dim * F32
    assert profiles_by_target(gm)["w"].param_bytes == vocab * dim * F32


@pytest.mark.parametrize("is_causal", [False, True])
def test_cpu_sdpa_flops_follow_torch_formula(is_causal: bool) -> None:
    b, h, s, d = 2, 3, 16, 8
    gm = trace(Attention(is_causal=is_causal))
    qkv = [torch.randn(b, h, s, d, requires_grad=True) for _ in range(3)]
    profile_graph_pass(gm, tuple(qkv), **FAST)
    p = compute_node(gm)
    shape = (b, h, s, d)
    # torch's formula counts both bmms (QK^T and PV) and ignores causality
    assert p.fwd_flops == flop_counter.sdpa_flop_count(shape, shape, shape) == 4 * b * h * s * s * d
    assert p.bwd_flops == flop_counter.sdpa_backward_flop_count(shape, shape, shape, shape)
    assert p.bwd_flops == 10 * b * h * s * s * d
    # q, k, v, the output and the per-row logsumexp are kept for backward
    assert p.saved_bytes == 4 * b * h * s * d * F32 + b * h * s * F32
    assert p.saved_inputs == ("k", "q", "v")


def test_cpu_sdpa_formula_registration_is_idempotent() -> None:
    profile_module._register_cpu_sdpa_flop_formulas()
    cpu_sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    assert cpu_sdpa in flop_counter.flop_registry
    assert cpu_sdpa.default._schema.name == "aten::_scaled_dot_product_flash_attention_for_cpu"


def test_view_node_allocates_nothing() -> None:
    gm = trace(Transpose())
    profile_graph_pass(gm, (torch.randn(4, 5, requires_grad=True),), **FAST)
    p = compute_node(gm)
    assert p.output_is_view and p.saved_bytes == 0 and p.fwd_flops == 0


class RepeatKV(nn.Module):
    """Grouped-query attention's key repeat (Hugging Face's ``repeat_kv``): the reshape of an
    expanded tensor copies it, and the matmul after it saves the copy."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        b, h, s, d = k.shape
        k = k[:, :, None].expand(b, h, 2, s, d).reshape(b, 2 * h, s, d)
        return q @ k.transpose(-1, -2)


def test_reshape_of_an_expanded_input_is_a_copy() -> None:
    """The profile runs each node on copies of its inputs: an expanded input keeps its stride-0
    layout, so the reshape after it copies as it does in the model (a contiguous stand-in made
    the reshape a view, and the copy attention saves went uncounted)."""
    gm = trace(RepeatKV())
    q, k = torch.randn(2, 4, 8, 16, requires_grad=True), torch.randn(2, 2, 8, 16,
                                                                    requires_grad=True)
    profile_graph_pass(gm, (q, k), **FAST)
    by_target = {str(n.target): osdp_meta(n).profile for n in gm.graph.nodes
                 if n.op in ("call_function", "call_method")}
    expand, reshape = by_target["expand"], by_target["reshape"]
    assert expand.output_is_view
    assert not reshape.output_is_view and reshape.output_bytes == 2 * 4 * 8 * 16 * F32
    matmul = next(p for t, p in by_target.items() if "matmul" in t)
    assert matmul.saved_input_bytes >= reshape.output_bytes  # the copy is saved, not the view


class Residual(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y) * y


def test_an_addition_passes_its_gradient_through_and_a_product_does_not() -> None:
    """The backward of ``x + y`` returns the gradient it received for both operands (one
    storage); that of ``s * y`` computes new ones."""
    gm = trace(Residual())
    profile_graph_pass(gm, (torch.randn(4, 5, requires_grad=True),
                            torch.randn(4, 5, requires_grad=True)), **FAST)
    add, mul = [osdp_meta(n).profile for n in gm.graph.nodes if n.op == "call_function"]
    assert add.grad_passthrough == ("x", "y")
    assert mul.grad_passthrough == ()


# -- whole models: per-node sums equal FlopCounterMode on the model ----------------------------

def whole_model_flops(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> tuple[int, int]:
    with FlopCounterMode(display=False) as fwd:
        out = gm(*inputs)
    out = out if isinstance(out, torch.Tensor) else out[0]
    with FlopCounterMode(display=False) as bwd:
        out.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.fixture(scope="module")
def hf_gpt2() -> tuple[fx.GraphModule, tuple[torch.Tensor, ...]]:
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100,
                                     n_positions=16, use_cache=False, bos_token_id=0,
                                     eos_token_id=0)
    ids = torch.randint(0, 100, (2, 8))
    model = transformers.GPT2LMHeadModel(config)
    return torch.export.export(model, (ids,), strict=False).module(), (ids,)


def _models(hf_gpt2):
    torch.manual_seed(0)
    return {
        "mlp": lambda: (trace(MLP()), (torch.randn(4, 16),)),
        "gpt": lambda: (trace(TinyGPT()), (torch.randint(0, 50, (2, 16)),)),
        "hf_gpt2": lambda: hf_gpt2,
    }


@pytest.mark.parametrize("name", ["mlp", "gpt", "hf_gpt2"])
def test_node_flops_sum_to_whole_model(name: str, request: pytest.FixtureRequest) -> None:
    hf = request.getfixturevalue("hf_gpt2") if name == "hf_gpt2" else None
    gm, inputs = _models(hf)[name]()
    before = str(gm.graph)
    result = profile_graph_pass(gm, inputs, **FAST)
    assert result.graph_module is gm and not result.modified
    assert str(gm.graph) == before
    summary = summarize_profile(gm)
    fwd, bwd = whole_model_flops(gm, inputs)
    assert fwd > 0 and bwd > 0
    assert (summary.fwd_flops, summary.bwd_flops) == (fwd, bwd)
    assert summary.num_nodes == len(gm.graph.nodes)
    assert summary.fwd_time_s > 0 and summary.bwd_time_s > 0
    # tied weights (TinyGPT tok/head, GPT-2 wte/lm_head) count once
    assert summary.param_bytes == sum(p.numel() * p.element_size() for p in gm.parameters())

    # fake mode: same FLOPs and bytes on every node, no times and no measured transients
    real = {n.name: osdp_meta(n).profile for n in gm.graph.nodes}
    profile_graph_pass(gm, inputs, fake=True)
    for node in gm.graph.nodes:
        fake = osdp_meta(node).profile
        assert fake.fwd_time_s is None and fake.bwd_time_s is None, node.name
        untimed = {"fwd_time_s": None, "bwd_time_s": None, "fwd_transient_bytes": 0,
                   "bwd_transient_bytes": 0}
        assert fake == NodeProfile(**{**real[node.name].__dict__, **untimed}), node.format_node()
    assert str(gm.graph) == before


def test_gpt_attention_is_counted() -> None:
    gm = trace(TinyGPT())
    profile_graph_pass(gm, (torch.randint(0, 50, (2, 16)),), **FAST)
    attention = [osdp_meta(n).profile for n in gm.graph.nodes
                 if n.target is F.scaled_dot_product_attention]
    assert len(attention) == 2
    assert all(p.fwd_flops == 4 * 2 * 4 * 16 * 16 * 8 for p in attention)


def test_fake_mode_on_meta_model() -> None:
    with torch.device("meta"):
        model = TinyGPT()
    gm = trace(model)
    profile_graph_pass(gm, (torch.randint(0, 50, (2, 16), device="meta"),), fake=True)
    summary = summarize_profile(gm)
    reference = trace(TinyGPT())
    profile_graph_pass(reference, (torch.randint(0, 50, (2, 16)),), **FAST)
    expected = summarize_profile(reference)
    assert (summary.fwd_flops, summary.bwd_flops) == (expected.fwd_flops, expected.bwd_flops)
    assert summary.saved_bytes == expected.saved_bytes
    assert summary.fwd_time_s is None


def test_outputs_unchanged_after_profiling() -> None:
    torch.manual_seed(0)
    gm = trace(TinyGPT())
    idx = torch.randint(0, 50, (2, 16))
    expected = gm(idx)
    profile_graph_pass(gm, (idx,), **FAST)
    torch.testing.assert_close(gm(idx), expected, rtol=0, atol=0)


# -- user errors -------------------------------------------------------------------------------

def test_module_with_parameters_is_rejected() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(InputError, match="owns parameters"):
        profile_graph_pass(gm, (torch.randn(2, 4),), **FAST)


def test_wrong_number_of_inputs_is_rejected() -> None:
    gm = trace(MLP())
    with pytest.raises(InputError, match="2 example inputs for a graph with 1 placeholders"):
        profile_graph_pass(gm, (torch.randn(4, 16), torch.randn(4, 16)), **FAST)


def test_meta_inputs_need_fake_mode() -> None:
    gm = trace(MLP())
    with pytest.raises(InputError, match="fake=True"):
        profile_graph_pass(gm, (torch.randn(4, 16, device="meta"),), **FAST)


def test_summary_needs_a_profile() -> None:
    with pytest.raises(InputError, match="run profile_graph_pass"):
        summarize_profile(trace(MLP()))


def test_hugging_face_model_on_meta_profiles_like_the_one_on_the_cpu():
    """GPT-2 from transformers on the meta device (captured by export, whose tensor factories
    then name the CPU, not meta) gets, node by node, the FLOPs and bytes of the same model built
    on the CPU and profiled for real."""
    pytest.importorskip("transformers")
    from osdp_fx.examples import hf_gpt2_meta
    from osdp_fx.passes.capture import capture

    shape = {"n_layer": 1, "n_embd": 64, "n_head": 4, "vocab": 97, "seq": 32, "batch": 2}
    meta_model, meta_inputs = hf_gpt2_meta(**shape)
    meta = capture(meta_model, meta_inputs)
    assert meta.method == "export" and meta.materialize_device == torch.device("cpu")
    assert not [n.format_node() for n in meta.gm.graph.nodes
                if "meta" in str(n.args) + str(n.kwargs)]
    profile_graph_pass(meta.gm, meta_inputs, fake=True)

    torch.manual_seed(0)
    with torch.device("cpu"):
        real_model = type(meta_model)(type(meta_model.model)(meta_model.model.config))
    real_inputs = (torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"])),)
    real = capture(real_model, real_inputs)
    assert real.materialize_device is None
    profile_graph_pass(real.gm, real_inputs, **FAST)

    fields = ("fwd_flops", "bwd_flops", "output_bytes", "saved_bytes", "param_bytes")
    real_profiles = {n.name: osdp_meta(n).profile for n in real.gm.graph.nodes}
    compared = 0
    for n in meta.gm.graph.nodes:
        mine, theirs = osdp_meta(n).profile, real_profiles[n.name]
        assert [getattr(mine, f) for f in fields] == [getattr(theirs, f) for f in fields], n.name
        compared += 1
    assert compared == len(real_profiles) > 50
    assert sum(osdp_meta(n).profile.fwd_flops for n in meta.gm.graph.nodes) > 0


# -- the whole graph's time ([Note: the whole graph's time]) ----------------------------------

def test_node_times_are_scaled_to_the_whole_graph_keeping_their_shares() -> None:
    """Node times inflated to 10 s each are brought down to what running the whole graph
    takes (far under a second for this MLP), forward and backward apart, each node keeping its
    share of its sum; the parameters' gradients and the graph are left as they were."""
    torch.manual_seed(0)
    gm, x = trace(MLP()), torch.randn(4, 16)
    profile_graph_pass(gm, (x,), **FAST)
    timed = [n for n in gm.graph.nodes if osdp_meta(n).profile.fwd_time_s]
    for k, n in enumerate(timed):
        profile = osdp_meta(n).profile
        osdp_meta(n).profile = dataclasses.replace(
            profile, fwd_time_s=10.0 * (k + 1),
            bwd_time_s=20.0 * (k + 1) if profile.bwd_time_s else 0.0)
    before = {n: (osdp_meta(n).profile.fwd_time_s, osdp_meta(n).profile.bwd_time_s)
              for n in timed}
    code = gm.code
    fwd_scale, bwd_scale = profile_module.scale_to_whole_graph(gm, (x,), warmup=1, repeats=3)
    assert 0 < fwd_scale < 1e-2 and 0 < bwd_scale < 1e-2
    fwd = sum(osdp_meta(n).profile.fwd_time_s for n in timed)
    bwd = sum(osdp_meta(n).profile.bwd_time_s for n in timed)
    assert 0 < fwd < 1.0 and 0 < bwd < 1.0
    for n, (f, b) in before.items():
        assert osdp_meta(n).profile.fwd_time_s == pytest.approx(f * fwd_scale)
        assert osdp_meta(n).profile.bwd_time_s == pytest.approx(b * bwd_scale)
    assert all(p.grad is None for p in gm.parameters())
    assert gm.code == code


class _TimedSleep(torch.autograd.Function):
    """Sleeps the next (forward, backward) seconds of ``_SleepLayer.runs`` in its forward and
    its backward (none once they are used up)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        fwd_s, ctx.bwd_s = _SleepLayer.runs.pop(0) if _SleepLayer.runs else (0.0, 0.0)
        time.sleep(fwd_s)
        return x * 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(ctx.bwd_s)
        return grad


class _SleepLayer(nn.Module):
    runs: list[tuple[float, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _TimedSleep.apply(x)


def test_the_whole_graph_is_the_median_of_its_runs_sums() -> None:
    """The whole graph's time is the median of the runs' forward-and-backward sums (a step's),
    not the sum of the forward's and the backward's medians; it is shared between them as
    their medians are. Runs of (0, 60), (60, 0) and (20, 10) ms: the median sum is 60 ms where
    the medians add up to 30, shared two to one. The bounds allow a loaded machine's sleeps to
    overrun by a few milliseconds."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), _SleepLayer())
    tracer = _FunctionalTracer()
    tracer.is_leaf_module = lambda m, qualname: isinstance(m, _SleepLayer)  # type: ignore
    gm, x = fx.GraphModule(model, tracer.trace(model)), torch.randn(4, 16)
    profile_graph_pass(gm, (x,), **FAST)
    _SleepLayer.runs = [(0.0, 0.0), (0.0, 0.06), (0.06, 0.0), (0.02, 0.01)]  # warmup first
    assert profile_module.scale_to_whole_graph(gm, (x,), warmup=1, repeats=3) is not None
    assert not _SleepLayer.runs
    timed = [n for n in gm.graph.nodes if osdp_meta(n).profile.fwd_time_s]
    fwd = sum(osdp_meta(n).profile.fwd_time_s for n in timed)
    bwd = sum(osdp_meta(n).profile.bwd_time_s for n in timed)
    assert 0.058 < fwd + bwd < 0.09
    assert 1.3 < fwd / bwd < 3.0


def test_node_times_are_scaled_to_given_times_keeping_their_shares() -> None:
    """``scale_to_times`` (a split graph given its unsplit graph's computation): forward and
    backward sums become the given seconds, each node's time the same share of its sum."""
    torch.manual_seed(0)
    gm, x = trace(MLP()), torch.randn(4, 16)
    profile_graph_pass(gm, (x,), **FAST)
    timed = [n for n in gm.graph.nodes if osdp_meta(n).profile.fwd_time_s]
    fwd_before = sum(osdp_meta(n).profile.fwd_time_s for n in timed)
    bwd_before = sum(osdp_meta(n).profile.bwd_time_s for n in timed)
    shares = {n: osdp_meta(n).profile.fwd_time_s / fwd_before for n in timed}
    scales = profile_module.scale_to_times(gm, 0.5, 0.25)
    assert scales == pytest.approx((0.5 / fwd_before, 0.25 / bwd_before))
    assert sum(osdp_meta(n).profile.fwd_time_s for n in timed) == pytest.approx(0.5)
    assert sum(osdp_meta(n).profile.bwd_time_s for n in timed) == pytest.approx(0.25)
    for n, share in shares.items():
        assert osdp_meta(n).profile.fwd_time_s == pytest.approx(0.5 * share)


def test_the_whole_graph_is_timed_on_real_cpu_tensors_only() -> None:
    gm, x = trace(MLP()), torch.randn(4, 16)
    assert profile_module.times_whole_graph(gm, (x,), fake=False)
    assert not profile_module.times_whole_graph(gm, (x,), fake=True)
    assert not profile_module.times_whole_graph(gm, (x.to("meta"),), fake=False)


def test_the_whole_graph_is_timed_only_where_asked_and_not_under_fake_tensors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    gm, x = trace(MLP()), torch.randn(4, 16)
    calls = []
    original = profile_module.scale_to_whole_graph

    def counted(*args, **kwargs):  # the real scaling, counted
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(profile_module, "scale_to_whole_graph", counted)
    profile_graph_pass(gm, (x,), **FAST)
    assert not calls
    profile_graph_pass(gm, (x,), **FAST, fake=True, whole_graph=True)
    assert not calls
    profile_graph_pass(gm, (x,), **FAST, whole_graph=True)
    assert len(calls) == 1


def test_the_whole_graph_is_timed_for_as_many_runs_as_fill_its_seconds() -> None:
    """``whole_graph_runs``: ``WHOLE_GRAPH_SECONDS`` over the nodes' summed times, clamped
    between the least asked and ``WHOLE_GRAPH_MAX_REPEATS``."""
    torch.manual_seed(0)
    gm, x = trace(MLP()), torch.randn(4, 16)
    profile_graph_pass(gm, (x,), **FAST)
    timed = [n for n in gm.graph.nodes if osdp_meta(n).profile.fwd_time_s]
    limit = profile_module.WHOLE_GRAPH_MAX_REPEATS

    def with_total(seconds: float) -> int:  # every node's time set so that they sum to it
        for n in timed:
            osdp_meta(n).profile = dataclasses.replace(
                osdp_meta(n).profile, fwd_time_s=seconds / len(timed), bwd_time_s=0.0)
        return profile_module.whole_graph_runs(gm, least=5)

    assert with_total(1e-4) == limit  # a tiny graph: the most runs
    assert with_total(1.0) == 5  # a long one: the least
    target = profile_module.WHOLE_GRAPH_SECONDS
    assert with_total(target / 7.5) == 8  # in between: as many as fill the seconds
    assert profile_module.whole_graph_runs(gm, least=limit + 5) == limit + 5

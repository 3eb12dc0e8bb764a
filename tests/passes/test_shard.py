"""The shard pass (osdp_fx/passes/shard.py) at world size 1, without a process group.

Before the pass a captured graph has no collectives; after it, for a uniform plan:

============== ======================== ============================ ======================
strategy       all_gather_param nodes   free_param nodes             prefetch_param nodes
============== ======================== ============================ ======================
full_shard     one per parameter group  one per parameter group      one per gather but
shard_grad_op  one per parameter group  none                         the first (prefetch 1)
replicate      none                     none                         none
============== ======================== ============================ ======================

and the compiled model computes the original's outputs and gradients, keeps the keys (and the
tying) of ``model.state_dict()`` in ``full_state_dict()``, and prints its collectives.
"""

from __future__ import annotations

import copy
import json
import operator
from typing import Any

import pytest
import torch
from harness import property_cases as pc
from harness.held import held_numel
from torch import fx, nn

from osdp_fx import compile_osdp
from osdp_fx.core.buckets import SMALL_PARAM_BYTES, block_of, gather_buckets
from osdp_fx.core.node_meta import osdp_meta
from osdp_fx.examples import GPTWithLoss, TinyGPT, lm_loss
from osdp_fx.passes.aliases import annotate_aliases_pass
from osdp_fx.passes.capture import capture
from osdp_fx.passes.shard import shard_parameters_pass
from osdp_fx.plan.plan import Plan
from osdp_fx.plan.request import ParamSpec, build_plan
from osdp_fx.runtime.params import (
    all_gather_param,
    all_gather_params,
    free_param,
    make_shard,
    prefetch_param,
    prefetch_params,
)

STRATEGIES = ("replicate", "shard_grad_op", "full_shard")


def gathers(gm: fx.GraphModule) -> list[fx.Node]:
    """Collective gather nodes: one parameter's, or a bucket's of small ones."""
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (all_gather_param, all_gather_params)]


def gathered(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, tuple[int, ...], fx.Node]]:
    """(gather node, parameter get_attr, shape, node giving the full parameter) per parameter."""
    out = []
    for node in gathers(gm):
        if node.target is all_gather_param:
            out.append((node, node.args[0], node.args[1], node))
            continue
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        out += [(node, shard, shape, items[i])
                for i, (shard, shape) in enumerate(zip(node.args[0], node.args[1]))]
    return out


def frees(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is free_param]


def prefetches(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (prefetch_param, prefetch_params)]


def loss_of(out: Any, inputs: tuple[Any, ...]) -> torch.Tensor:
    out = pc.logits(out)
    if out.dim() == 3:  # a language model: next-token loss on its own input
        return lm_loss(out, inputs[0])
    return out.square().mean()


_before: dict[str, Any] = {}


def _captured_before(name: str, model: Any, inputs: tuple[Any, ...]) -> Any:
    """The graph of ``name``'s model before sharding, captured once per model (the tests only
    read it; every strategy's fixture builds the same model from the same seed)."""
    if name not in _before:
        _before[name] = capture(copy.deepcopy(model), inputs).gm
    return _before[name]


@pytest.fixture(scope="module", params=[(m, s) for m in sorted(pc.PASS_MODELS)
                                        for s in STRATEGIES], ids=lambda p: "-".join(p))
def run(request) -> dict[str, Any]:
    """Compile one model under one uniform strategy; run one forward and backward."""
    name, strategy = request.param
    model, inputs = pc.PASS_MODELS[name][0]()
    reference = copy.deepcopy(model)  # compiled replicated parameters are the model's tensors
    before = _captured_before(name, model, inputs)
    compiled = compile_osdp(model, inputs, plan=strategy)
    out = compiled(*inputs)
    loss_of(out, inputs).backward()
    ref_out = reference(*inputs)
    loss_of(ref_out, inputs).backward()
    return {"name": name, "strategy": strategy, "inputs": inputs, "compiled": compiled,
            "before": before, "reference": reference, "out": out, "ref_out": ref_out}


def test_collective_nodes_before_and_after(run):
    before, after = run["before"], run["compiled"].graph_module
    groups = [n for n, _ in run["reference"].named_parameters()]
    assert (len(gathers(before)), len(frees(before))) == (0, 0)
    expected = {"replicate": (0, 0), "shard_grad_op": (len(groups), 0),
                "full_shard": (len(groups), len(groups))}[run["strategy"]]
    assert (len(gathered(after)), len(frees(after))) == expected
    n_collectives = len(gathers(after))
    assert (n_collectives == 0) == (run["strategy"] == "replicate")
    n_items = sum(len(g.users) for g in gathers(after) if g.target is all_gather_params)
    n_prefetches = max(0, n_collectives - 1)
    assert len(prefetches(after)) == n_prefetches
    assert len(after.graph.nodes) == (len(before.graph.nodes) + n_collectives + n_items
                                      + expected[1] + n_prefetches)


def test_each_gather_but_the_first_starts_right_after_the_previous_one(run):
    gm = run["compiled"].graph_module
    nodes = gathers(gm)
    assert not nodes or len(nodes[0].args) == 4  # the first is not prefetched
    for previous, node in zip(nodes, nodes[1:]):
        param, _, _, group, started = node.args
        assert started.target in (prefetch_param, prefetch_params)
        assert started.args == (param, group)
        shards = param if isinstance(param, tuple) else (param,)
        chain = [previous, *shards, started]
        assert all(a.next is b for a, b in zip(chain, chain[1:]))


def test_each_sharded_parameter_is_gathered_once(run):
    gm, strategy = run["compiled"].graph_module, run["strategy"]
    full = {n: p for n, p in run["reference"].named_parameters()}
    seen = []
    for node, param, shape, _ in gathered(gm):
        node_strategy, group = node.args[2:4]
        assert param.op == "get_attr" and osdp_meta(param).role == "param"
        assert set(param.users) == {node, *node.args[4:]}, node.format_node()
        assert tuple(shape) == tuple(full[param.target].shape)
        assert (node_strategy, group) == (strategy, "world")
        seen.append(param.target)
        # The get_attrs moved to just before the gather (or its prefetch), before every use.
        first_user = node.args[4] if len(node.args) > 4 else node
        assert param.next is first_user or param.next.op == "get_attr"
    assert sorted(seen) == ([] if strategy == "replicate" else sorted(full))


def test_free_follows_every_forward_use(run):
    gm = run["compiled"].graph_module
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    full_of = {full: param.target for _, param, _, full in gathered(gm)}
    for node in frees(gm):
        (full,) = node.args
        param = full_of[full]
        views = [n for n in gm.graph.nodes if param in osdp_meta(n).aliases]
        uses = [u for v in [full, *views] for u in v.users if u is not node]
        assert uses and max(order[u] for u in uses) < order[node], node.format_node()


def test_local_parameters_are_shards(run):
    compiled, strategy = run["compiled"], run["strategy"]
    for name, ref in run["reference"].named_parameters():
        local = compiled.get_parameter(name)
        assert local.shape == ref.shape, name  # sharded ones too: a parameter keeps its shape
        if strategy != "replicate":  # world size 1, no process group: the one shard, whole
            assert held_numel(local) == ref.numel(), name
    assert len(list(compiled.parameters())) == len(list(run["reference"].parameters()))


def test_outputs_and_gradients_equal_the_original(run):
    torch.testing.assert_close(pc.logits(run["out"]), pc.logits(run["ref_out"]),
                               atol=1e-6, rtol=0)
    grads = run["compiled"].full_grads()
    ref = dict(run["reference"].named_parameters())
    assert grads.keys() == ref.keys()
    for name, p in ref.items():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=0, msg=name)


def test_full_state_dict_keeps_keys_and_ties(run):
    state = run["compiled"].full_state_dict()
    ref_state = run["reference"].state_dict()
    assert list(state) == list(ref_state)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, atol=0, rtol=0, msg=key)
    ties = pc.PASS_MODELS[run["name"]][2]
    for alias, canon in ties.items():
        assert state[alias].data_ptr() == state[canon].data_ptr()


def test_printed_code_shows_the_collectives(run, capsys):
    print(run["compiled"].code)
    code = capsys.readouterr().out
    n_gathers = code.count("all_gather_param(") + code.count("all_gather_params(")
    n_frees = code.count("free_param(")
    assert (n_gathers, n_frees) == (len(gathers(run["compiled"].graph_module)),
                                    len(frees(run["compiled"].graph_module)))
    if run["strategy"] != "replicate":
        assert f"'{run['strategy']}', 'world'" in code


# ---- views and outputs of full_shard parameters ----------------------------------------------


class LateView(nn.Module):
    """Uses a view of ``w`` (``wt``) long after the last direct use of ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5))
        self.v = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wt = self.w.t()
        h = torch.tanh(x @ self.w)
        h = h * self.v
        return h @ wt


class ReturnsParamView(nn.Module):
    """Returns a view of its parameter: it must not be freed in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x @ self.w, self.w.t()


def compile_and_compare(model: nn.Module, x: torch.Tensor, plan: str) -> Any:
    reference = copy.deepcopy(model)
    compiled = compile_osdp(model, (x,), plan=plan)
    out, ref_out = compiled(x), reference(x)
    outs = out if isinstance(out, tuple) else (out,)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    sum(o.sum() for o in outs).backward()
    sum(o.sum() for o in ref_outs).backward()
    for o, r in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(o, r, atol=1e-6, rtol=0)
    grads = compiled.full_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=0, msg=name)
    return compiled


def test_free_waits_for_the_last_use_of_a_view():
    torch.manual_seed(0)
    compiled = compile_and_compare(LateView(), torch.randn(2, 5), "full_shard")
    gm = compiled.graph_module
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    param_of = {full: param.target for _, param, _, full in gathered(gm)}
    (free_w,) = [f for f in frees(gm) if param_of[f.args[0]] == "w"]
    last_matmul = max((n for n in gm.graph.nodes if n.target in ("matmul", "__matmul__")
                       or getattr(n.target, "__name__", "") == "matmul"), key=order.__getitem__)
    assert order[free_w] > order[last_matmul], gm.code


def test_parameter_returned_by_the_model_is_not_freed():
    torch.manual_seed(0)
    compiled = compile_and_compare(ReturnsParamView(), torch.randn(2, 3), "full_shard")
    assert len(gathers(compiled.graph_module)) == 1
    assert frees(compiled.graph_module) == []


class SpareLayer(nn.Module):
    """Owns a Linear its forward never calls: no get_attr node reads ``spare.*``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.spare = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_unused_parameter_is_sharded_as_planned():
    torch.manual_seed(0)
    compiled = compile_osdp(SpareLayer(), (torch.randn(2, 3),), plan="full_shard")
    assert compiled.plan["spare.weight"].strategy == "full_shard"
    state = compiled.full_state_dict()
    compiled.load_full_state_dict(state)
    spare = compiled.get_parameter("spare.weight")
    assert spare.shape == (3, 3) and held_numel(spare) == 9


# ---- the pass on its own, for a world it does not run in ---------------------------------------


def plan_for(captured: Any, strategy: str, world_size: int) -> Plan:
    specs = [ParamSpec(name=p.name, shape=p.shape, dtype=str(p.dtype).removeprefix("torch."),
                       element_size=torch.empty((), dtype=p.dtype).element_size(),
                       aliases=p.aliases, trainable=p.trainable, frozen=not p.requires_grad)
             for p in captured.params.values()]
    return build_plan({s.name: strategy for s in specs}, specs, world_size=world_size)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pass_result_and_shards_of_rank_1_of_3(strategy):
    model, inputs = pc.tiny_mlp()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    captured = capture(model, inputs)
    annotate_aliases_pass(captured.gm, inputs)
    result = shard_parameters_pass(captured.gm, plan=plan_for(captured, strategy, 3),
                                   world_size=3, rank=1)
    assert result.modified == (strategy != "replicate")
    for name, value in full.items():
        local = result.graph_module.get_parameter(name)
        if strategy == "replicate":
            assert local is model.get_parameter(name)
            continue
        row = value[0].numel() if value.dim() > 1 else 1
        n = -(-value.shape[0] // 3) * row  # whole rows
        padded = torch.cat([value.reshape(-1), value.new_zeros(3 * n - value.numel())])
        assert local.is_leaf and local.requires_grad
        torch.testing.assert_close(local.detach(), padded[n:2 * n], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("numel,world", [(7, 3), (1, 4), (8, 4), (5, 1)])
def test_make_shard_pads_and_slices(numel, world):
    full = torch.arange(1.0, numel + 1)
    shards = [make_shard(full, world_size=world, rank=r) for r in range(world)]
    n = -(-numel // world)
    assert all(s.shape == (n,) for s in shards)
    flat = torch.cat([s.detach() for s in shards])
    torch.testing.assert_close(flat[:numel], full, atol=0, rtol=0)
    assert not flat[numel:].any()


@pytest.mark.parametrize("rows,world", [(5, 2), (2, 4), (8, 4)])
def test_shards_are_whole_rows(rows, world):
    """Each rank's shard, less its padding, is torch.chunk's chunk of dim 0 (as FSDP2's)."""
    full = torch.arange(1.0, rows * 3 + 1).view(rows, 3)
    chunks = full.chunk(world)
    for r in range(world):
        shard = make_shard(full, world_size=world, rank=r).detach()
        assert shard.numel() == -(-rows // world) * 3
        mine = chunks[r].reshape(-1) if r < len(chunks) else full.new_zeros(0)
        torch.testing.assert_close(shard[:mine.numel()], mine, atol=0, rtol=0)
        assert not shard[mine.numel():].any()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_prefetch_distance_is_recorded_in_the_plan_and_its_file(tmp_path, prefetch):
    torch.manual_seed(0)  # 256 KiB weights: one gather each
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(4)])
    inputs = (torch.randn(4, 256),)
    compiled = compile_osdp(copy.deepcopy(model), inputs, plan="full_shard", prefetch=prefetch)
    gm = compiled.graph_module
    assert compiled.plan.schedule.prefetch == prefetch
    assert len(gathers(gm)) == 4
    assert len(prefetches(gm)) == (len(gathers(gm)) - prefetch if prefetch else 0)
    for earlier, node in zip(gathers(gm), gathers(gm)[prefetch:]) if prefetch else ():
        assert earlier.next.next is node.args[4]  # started right after that earlier gather
    compiled.plan.save(tmp_path / "plan.json")
    again = compile_osdp(copy.deepcopy(model), inputs, plan=str(tmp_path / "plan.json"))
    assert again.plan.schedule.prefetch == prefetch and again.plan.hash() == compiled.plan.hash()
    default = compile_osdp(copy.deepcopy(model), inputs, plan="full_shard")
    assert default.plan.schedule.prefetch == 1 and default.plan.hash() != compiled.plan.hash()
    torch.testing.assert_close(compiled(*inputs), default(*inputs), rtol=0, atol=0)


def test_a_bucket_with_a_parameter_that_is_not_small_stays_in_its_block():
    small, big = SMALL_PARAM_BYTES, SMALL_PARAM_BYTES + 1
    sizes = [("a", small), ("a", small), ("a", big), ("a", small), ("a", small), ("a", big)]
    blocks = ["b0", "b1", "b1", "b1", "b2", "b2"]
    # the small run spans b0 and b1; the big parameter of b1 cannot join it (it would span two
    # blocks), and the small one of b2 cannot join the big one's
    assert gather_buckets(sizes, 2**20, blocks) == [[0, 1], [2, 3], [4, 5]]
    assert gather_buckets(sizes, 2**20) == [[0, 1, 2, 3, 4, 5]]


def test_runs_of_small_parameters_share_a_bucket():
    small, big = SMALL_PARAM_BYTES, SMALL_PARAM_BYTES + 1
    sizes = [("a", small), ("a", small), ("a", big), ("a", small), ("a", small), ("b", small),
             ("b", small), ("a", big), ("a", big)]
    assert gather_buckets(sizes) == [[0, 1], [2], [3, 4], [5, 6], [7], [8]]


def test_frozen_and_trainable_parameters_share_a_blocks_bucket_not_a_small_run():
    """A LoRA block: frozen base weights and trainable adapters alternate. In a block's bucket
    they share one all-gather; a run of small ones (any length, across blocks) stops where
    frozen and trainable alternate, or a small model's run would be the whole model."""
    small, big = SMALL_PARAM_BYTES, SMALL_PARAM_BYTES + 1
    sizes = [("a", big), ("a", small), ("a", small), ("a", big), ("a", small), ("a", small)]
    frozen = [True, False, False, True, False, False]
    assert gather_buckets(sizes, 2**20, ["b0"] * 6, frozen) == [[0, 1, 2, 3, 4, 5]]
    # all small, no blocks, the default bucket: runs of one kind
    sizes = [("a", small)] * 6
    assert gather_buckets(sizes, frozen=frozen) == [[0], [1, 2], [3], [4, 5]]
    assert gather_buckets(sizes) == [[0, 1, 2, 3, 4, 5]]


def test_a_larger_bucket_holds_parameters_of_any_size_up_to_its_bytes():
    MiB = 2**20
    sizes = [("a", 2 * MiB), ("a", 1024), ("a", MiB), ("a", MiB), ("a", 1024), ("b", MiB),
             ("b", 1024), ("b", 3 * MiB), ("b", 4 * MiB), ("b", 1024), ("b", 1024)]
    # (2 MiB + 1 KiB + 1 MiB) > 3 MiB: the block-sized bucket starts again at the second MiB
    assert gather_buckets(sizes, 3 * MiB) == [[0, 1], [2, 3, 4], [5, 6], [7], [8], [9, 10]]
    assert gather_buckets(sizes, 3 * MiB + 1024) == [[0, 1, 2], [3, 4], [5, 6], [7], [8],
                                                     [9, 10]]


def test_a_parameter_belongs_to_the_outermost_indexed_submodule_of_its_name():
    assert block_of("blocks.3.attn.qkv.weight") == "blocks.3"
    assert block_of("model.layers.10.mlp.experts.2.w1") == "model.layers.10"
    assert block_of("model.tok.weight") is None and block_of("0.weight") is None


def test_a_gather_bucket_never_spans_two_blocks(tmp_path):
    """Buckets as large as the whole model still gather one block each (its 192 KiB weights are
    not small), as FSDP2 gathers one module's parameters, and the parameters outside the blocks
    (a 128 KiB embedding, the final norm) in runs of their own."""
    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=256, dim=128, depth=3, heads=2, max_seq=16))
    x = torch.randint(0, 256, (2, 16))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "osdp-fx-plan", "version": 1, "default": "full_shard",
                                "params": {}, "gather_bucket_bytes": 2**30}))
    gm = compile_osdp(model, (x,), plan=str(plan)).graph_module
    blocks = [{block_of(osdp_meta(m).param) for m in n.users} for n in gathers(gm)]
    assert blocks == [{None}, {"model.blocks.0"}, {"model.blocks.1"}, {"model.blocks.2"}, {None}]


def test_consecutive_small_parameters_share_one_gather():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.LayerNorm(256))
    x = torch.randn(4, 256)
    reference = copy.deepcopy(model)
    compiled = compile_osdp(model, (x,), plan="full_shard")
    gm = compiled.graph_module
    buckets = [[p.target for p in n.args[0]] if n.target is all_gather_params else [n.args[0].target]
               for n in gathers(gm)]
    # 256 KiB weights are gathered alone; the 1 KiB bias and LayerNorm parameters together
    assert buckets == [["0.weight"], ["0.bias"], ["2.weight"], ["2.bias", "3.weight", "3.bias"]]
    assert len(frees(gm)) == 6  # each member is still freed on its own
    compiled(x).square().mean().backward()
    reference(x).square().mean().backward()
    torch.testing.assert_close(compiled.full_state_dict(), reference.state_dict())
    grads = compiled.full_grads()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)

"""The recompute pass: regions become call_module nodes whose bodies hold their operators, the
graph computes the same values and gradients, and an unknown region is a PlanError (what a
region is: tests/core/test_regions.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from osdp_fx.core.node_meta import NodeRole, osdp_meta
from osdp_fx.core.regions import find_regions
from osdp_fx.errors import PlanError
from osdp_fx.examples import GPTWithLoss, TinyGPT
from osdp_fx.passes.capture import capture
from osdp_fx.passes.recompute import recompute_regions_pass


def _captured():
    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=64, dim=32, depth=3, heads=4, max_seq=16))
    x = torch.randint(0, 64, (2, 16))
    return capture(model, (x,)), x


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_pass_wraps_regions_and_keeps_values(policy):
    captured, x = _captured()
    gm = captured.gm
    reference = copy.deepcopy(gm)
    before = len(gm.graph.nodes)
    recompute_regions_pass(gm, policies={"model.blocks.0": policy, "model.blocks.2": policy,
                                         "model.blocks.1": "save"})
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [n.target for n in calls] == ["recompute_model_blocks_0", "recompute_model_blocks_2"]
    assert all(osdp_meta(n).role == NodeRole.RECOMPUTE for n in calls)
    assert len(gm.graph.nodes) < before
    # every parameter is still read in the outer graph and passed in
    assert all(any(a.op == "get_attr" for a in n.args) for n in calls)
    loss, ref = gm(x), reference(x)
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    loss.backward()
    ref.backward()
    for (name, p), q in zip(gm.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-7, msg=name)


def test_unknown_region_names_the_regions():
    captured, _ = _captured()
    with pytest.raises(PlanError, match="model.blocks.0"):
        recompute_regions_pass(captured.gm, policies={"blocks.9": "full"})
    with pytest.raises(PlanError, match="selective"):
        recompute_regions_pass(captured.gm, policies={"model.blocks.0": "sometimes"})

@pytest.mark.parametrize("policy, field", [("selective", "selective_op_time_s"),
                                           ("full", "full_recompute_op_time_s")])
def test_recomputed_regions_are_charged_checkpointing_per_operator(policy: str, field: str):
    """The step model charges a selective region ``Devices.selective_op_time_s`` per operator
    (selective checkpointing's dispatch mode wraps each) and a full one
    ``Devices.full_recompute_op_time_s`` (checkpointing's saved-tensor hooks); each figure is
    charged to its own policy's regions only, and nothing to a saved region."""
    from osdp_fx.core.devices import Devices
    from osdp_fx.cost_models.recompute import region_costs
    from osdp_fx.planner.analysis import analyze

    torch.manual_seed(0)
    model = GPTWithLoss(TinyGPT(vocab=64, dim=32, depth=2, heads=2, max_seq=16))
    x = (torch.randint(0, 64, (2, 16)),)
    captured = capture(model, x)
    facts = analyze(captured, x, fake=True).facts
    regions = find_regions(captured.gm.graph)
    plain, charged = (region_costs(facts, Devices(**{field: t})) for t in (0.0, 1e-3))
    assert regions and set(plain) == set(regions)
    for name, options in plain.items():
        ops = sum(n.op in ("call_function", "call_method", "call_module") for n in regions[name])
        assert {o.policy for o in options} == {"save", "selective", "full"}
        for before, after in zip(options, charged[name]):
            added = 1e-3 * ops if before.policy == policy else 0.0
            assert after.recompute_s == pytest.approx(before.recompute_s + added)


def test_the_body_reads_each_parameter_only_the_region_reads_through_grad_ready():
    """[Note: reduce-scatter in recomputed regions]: the first read of each parameter the region
    alone reads goes through ``grad_ready``; activations and the caller's tensors do not."""
    from osdp_fx.runtime.params import grad_ready

    captured, _ = _captured()
    gm = captured.gm
    region = find_regions(gm.graph)["model.blocks.1"]
    read = {a.target for n in region for a in n.all_input_nodes if a.op == "get_attr"}
    recompute_regions_pass(gm, policies={"model.blocks.1": "full"})
    call = next(n for n in gm.graph.nodes if n.op == "call_module")
    body = gm.get_submodule(call.target).body.graph
    placeholders = {p.name: a for p, a in zip(
        [n for n in body.nodes if n.op == "placeholder"], call.args)}
    ready = [n for n in body.nodes if n.target is grad_ready]
    wrapped = {placeholders[n.args[0].name].target for n in ready}
    assert wrapped == read and len(ready) == len(read)
    for n in ready:  # right before the first read, which reads it through grad_ready alone
        after = n.next
        while after.target is grad_ready:
            after = after.next
        assert len(n.args[0].users) == 1 and after in n.users

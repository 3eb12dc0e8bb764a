"""The plan cache (``planner/cache.py``): a second compile of the same model, inputs, devices and
options takes the saved plan (the same hash and splits, no search); anything else searches."""

from __future__ import annotations

import logging

import pytest
import torch
from harness import cache_cases

from osdp_fx import Devices, compile_osdp
from osdp_fx.errors import InputError
from osdp_fx.examples import MLP
from osdp_fx.planner.cache import CACHE_ENV, cache_dir, default_cache_dir


def _compile(cache, caplog, *, widths=(32, 64, 64, 8), batch=16, devices=None, **options):
    torch.manual_seed(0)
    net = MLP(widths)
    x = torch.randn(batch, widths[0])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="osdp_fx.api"):
        compiled = compile_osdp(net, (x,), devices or Devices(world_size=1, memory_bytes=2**30),
                                plan_cache=cache, **options)
    messages = [r.getMessage() for r in caplog.records if r.name == "osdp_fx.api"]
    return compiled, messages


def test_a_second_compile_takes_the_saved_plan(tmp_path, caplog):
    first, log1 = _compile(tmp_path, caplog)
    assert any("plan cache: no plan in" in m for m in log1), log1
    assert any(m.startswith("plan (profile, search):") for m in log1)
    entries = list(tmp_path.glob("*.json"))
    assert len(entries) == 1 and any(str(entries[0]) in m for m in log1)

    second, log2 = _compile(tmp_path, caplog)
    assert any(f"plan cache: using {entries[0]}" in m for m in log2), log2
    assert not any(m.startswith("plan (profile, search):") for m in log2)  # no search
    assert second.plan.hash() == first.plan.hash()
    assert second.plan.splits == first.plan.splits
    assert second.plan.prediction is not None  # predicted with the saved devices


def test_other_options_search_again(tmp_path, caplog):
    _compile(tmp_path, caplog)
    _, log = _compile(tmp_path, caplog, optimizer="sgd")
    assert any("plan cache: no plan in" in m for m in log)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_another_model_shape_or_devices_search_again(tmp_path, caplog):
    """Each of these misses the first compile's entry, searches and saves its own; each is
    then found again."""
    _compile(tmp_path, caplog)
    changes = {"model": {"widths": (32, 64, 48, 8)},
               "example shapes": {"batch": 8},
               "devices' figures": {"devices": Devices(world_size=1, memory_bytes=2**30,
                                                       compute_flops_per_s=2e11)},
               "memory limit": {"devices": Devices(world_size=1, memory_bytes=2**29)}}
    for what, change in changes.items():
        _, log = _compile(tmp_path, caplog, **change)
        assert any("plan cache: no plan in" in m for m in log), (what, log)
    assert len(list(tmp_path.glob("*.json"))) == 1 + len(changes)
    for what, change in changes.items():
        _, log = _compile(tmp_path, caplog, **change)
        assert any("plan cache: using" in m for m in log), (what, log)


def test_other_code_searches_again(tmp_path, caplog, monkeypatch):
    """A checkout whose osdp-fx source changed (the same version) does not take a plan an
    earlier code made."""
    from osdp_fx.planner import cache

    _compile(tmp_path, caplog)
    monkeypatch.setattr(cache, "code_digest", lambda: "another source")
    _, log = _compile(tmp_path, caplog)
    assert any("plan cache: no plan in" in m for m in log), log
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_the_cache_can_be_turned_off(tmp_path, caplog, monkeypatch):
    _, log = _compile(False, caplog)
    assert not any("plan cache" in m for m in log)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "from-env"))
    assert cache_dir(True) == tmp_path / "from-env" and cache_dir(False) is None
    monkeypatch.setenv(CACHE_ENV, "off")
    assert cache_dir(True) is None
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir(True) == default_cache_dir()
    with pytest.raises(InputError, match="plan_cache=3"):
        cache_dir(3)


def test_named_plans_are_not_cached(tmp_path, caplog):
    _, log = _compile(tmp_path, caplog, plan="full_shard")
    assert not any("plan cache" in m for m in log)
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.slow  # a search at world 2, with the devices measured
def test_rank_0_decides_for_every_rank(worlds, tmp_path):
    results = worlds(2).run(cache_cases.compile_twice, cache=str(tmp_path))
    assert len(list(tmp_path.glob("*.json"))) == 1  # written once, by rank 0
    first = results[0]["hashes"][0]
    assert all(r["hashes"] == [first, first] for r in results)
    # the same model, inputs and options in a world of one rank: another world, a search
    alone = cache_cases.compile_twice(0, 1, cache=str(tmp_path))
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert alone["hashes"][0] == alone["hashes"][1]


def test_without_devices_the_machine_is_measured_once_and_kept(tmp_path, caplog, monkeypatch):
    """``devices=None``: the figures are measured on this machine (``detect_devices``), the
    plan says so, and the measurement is kept next to the plans: a restart (a new process:
    here the in-process figures forgotten) reads it instead of measuring again."""
    from osdp_fx.planner import detect

    calls = []
    real = detect.detect_devices
    monkeypatch.setattr(detect, "detect_devices", lambda **kw: calls.append(kw) or real(**kw))
    monkeypatch.setattr(detect, "_detected_devices", {})

    def compile_mlp():
        torch.manual_seed(0)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="osdp_fx.api"):
            return compile_osdp(MLP((32, 64, 8)), (torch.randn(4, 32),), plan="replicate",
                                plan_cache=tmp_path)

    first = compile_mlp()
    assert len(calls) == 1
    assert first.plan.prediction.figures == "detected"
    assert "figures detected" in str(first.plan)
    kept = list((tmp_path / "devices").glob("*.json"))
    assert len(kept) == 1

    monkeypatch.setattr(detect, "_detected_devices", {})  # a new process
    second = compile_mlp()
    assert len(calls) == 1  # not measured again
    assert any(f"measured before on this machine, {kept[0]}" in r.getMessage()
               for r in caplog.records)
    assert second.plan.prediction.step_time_s == first.plan.prediction.step_time_s


def test_given_devices_are_not_measured_and_say_where_they_come_from(monkeypatch):
    from osdp_fx.planner import detect

    monkeypatch.setattr(detect, "detect_devices", lambda **kw: pytest.fail("measured"))
    net, x = MLP((32, 64, 8)), torch.randn(4, 32)
    assert compile_osdp(net, (x,), Devices(), plan="replicate",
                        plan_cache=False).plan.prediction.figures == "defaults"
    assert compile_osdp(net, (x,), Devices(compute_flops_per_s=3e11), plan="replicate",
                        plan_cache=False).plan.prediction.figures == "given"
    assert compile_osdp(net, (x,), Devices.preset("h100-sxm-8x", world_size=1),
                        plan="replicate", plan_cache=False).plan.prediction.figures == (
                            "preset:h100-sxm-8x")

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

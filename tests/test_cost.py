"""The cost model: 6 N D at an MFU gives time, GPU-hours, energy and dollars; each input is
validated; the inverse functions invert it; the catalog's board powers carry sources."""

from __future__ import annotations

import math

import pytest

import labsim
from labsim.cost import (
    PRICES,
    implied_mfu,
    implied_tokens,
    owned_usd_per_gpu_hour,
    run_cost,
    training_flops,
)
from labsim.hardware import GPUS

TDP = {"V100-32GB": 300, "A100-40GB": 400, "A100-80GB": 400, "H100-SXM": 700,
       "H100-PCIe": 350, "H200": 700, "MI250X": 560, "RTX-4090": 450, "A6000": 300,
       "H100-SXM-HBM2e": 500, "H100-NVL": 400, "H800": 700, "B200": 1000}


def test_every_gpu_has_a_board_power_with_its_source() -> None:
    assert {g.name: g.tdp_W for g in GPUS.values()} == TDP
    assert all(" W" in g.tdp_source for g in GPUS.values())


def test_gpt3_in_megatron_time() -> None:
    """Narayanan et al. 2021 section 5.1: 175B on 300B tokens on 1024 A100 at 140 TFLOP/s
    takes 34 days with 8TP/(nX); 6ND is 3/4 of 8TP (no recomputation counted)."""
    mfu = 140e12 / 312e12
    r = run_cost(175e9, 300e9, "A100-80GB", 1024, mfu)
    assert r.days == pytest.approx(34 * 0.75, rel=0.02)
    assert r.flops == training_flops(175e9, 300e9) == pytest.approx(3.15e23)


def test_hours_energy_and_dollars() -> None:
    r = run_cost(labsim.Transformer.preset("llama2-7b"), 1e9, labsim.dgx_h100(1), 8, 0.5,
                 usd_per_gpu_hour=2.0, usd_per_kwh=0.1, pue=1.2)
    wall = 6 * r.params * 1e9 / (8 * 989.4e12 * 0.5)
    assert r.wall_s == pytest.approx(wall)
    assert r.gpu_hours == pytest.approx(8 * wall / 3600)
    assert r.energy_J == pytest.approx(8 * 700 * wall * 1.2)
    assert r.dollars == pytest.approx(r.gpu_hours * 2.0 + r.energy_J / 3.6e6 * 0.1)
    assert r.flops_per_J == pytest.approx(r.flops / r.energy_J)
    assert run_cost(7e9, 1e9, "H100-SXM", 8, 0.5).dollars is None
    priced = run_cost(7e9, 1e9, "A100-40GB", 8, 0.5, usd_per_gpu_hour=PRICES["aws-p4d-on-demand"])
    assert priced.dollars == pytest.approx(priced.gpu_hours * 32.77 / 8)


def test_claim_001_16_arithmetic() -> None:
    assert PRICES["aws-p4d-on-demand"].usd_per_gpu_hour * 8 * 720 == pytest.approx(23594.4)
    tokens = implied_tokens(13e9, 30 * 86400, "A100-40GB", 8, 0.4)
    assert tokens == pytest.approx(30 * 86400 * 8 * 312e12 * 0.4 / (6 * 13e9))
    assert implied_mfu(13e9, tokens, 30 * 86400, "A100-40GB", 8) == pytest.approx(0.4)
    back = run_cost(13e9, tokens, "A100-40GB", 8, 0.4)
    assert back.days == pytest.approx(30)


def test_owned_rate() -> None:
    rate = owned_usd_per_gpu_hour(30000, 4, power_W=700, usd_per_kwh=0.1, pue=1.5,
                                  utilisation=0.5)
    assert rate == pytest.approx(30000 / (4 * 365.25 * 24) / 0.5 + 0.7 * 1.5 * 0.1)


@pytest.mark.parametrize("kwargs, word", [
    (dict(mfu=0), "mfu"), (dict(mfu=1.5), "mfu"), (dict(mfu=math.nan), "mfu"),
    (dict(gpus=0), "gpus"), (dict(gpus=2.5), "gpus"), (dict(tokens=-1), "tokens"),
    (dict(pue=0.9), "pue"), (dict(power_W=0), "power_W"), (dict(usd_per_gpu_hour=-1), "usd"),
    (dict(dtype="fp8"), "fp8"), (dict(gpu="TPU"), "unknown"), (dict(model="7B"), "model"),
])
def test_bad_inputs_name_the_fix(kwargs: dict, word: str) -> None:
    args = dict(model=7e9, tokens=1e9, gpu="A100-80GB", gpus=8, mfu=0.4) | kwargs
    with pytest.raises(ValueError, match=word):
        run_cost(args.pop("model"), args.pop("tokens"), args.pop("gpu"), args.pop("gpus"),
                 args.pop("mfu"), **args)


def test_a_gpu_without_power_needs_one() -> None:
    bare = labsim.GPU("X", {"bf16": 1e14}, 1e10, 1e12, "made up")
    with pytest.raises(ValueError, match="power_W"):
        run_cost(1e9, 1e9, bare, 1, 0.5)
    assert run_cost(1e9, 1e9, bare, 1, 0.5, power_W=100).energy_J > 0

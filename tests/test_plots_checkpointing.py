"""labsim.plots.checkpointing: measured trade-off and modelled bars."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from labsim.plots.checkpointing import recompute_tradeoff


def _m(label, saved, peak, step):
    return SimpleNamespace(label=label, saved_bytes=saved, peak_bytes=peak, step_s=step)


def test_one_or_two_panels():
    measured = [_m("none", 20e6, 21e6, 1.0), _m("every", 3e6, 4e6, 1.3)]
    assert len(recompute_tradeoff(measured).get_axes()) == 1
    fig = recompute_tradeoff(measured, {"none": 1e11, "selective": 2e10, "full": 1e9},
                             model_name="x")
    bars = fig.get_axes()[1].patches
    assert [round(b.get_height(), 3) for b in bars] == [100.0, 20.0, 1.0]


def test_empty_measurements_raise():
    with pytest.raises(ValueError):
        recompute_tradeoff([])

"""The memory explorer: its static figure is the pure function, and it redraws on change."""

from __future__ import annotations

import pytest

from labsim import Transformer
from labsim.widgets import memory_explorer, memory_figure


def test_static_figure_titles_the_verdict() -> None:
    fig = memory_figure(model=7.5e9, dp=64, micro_batch=0, device="A100-40GB")
    title = fig.axes[0].get_title()
    assert "fits: ZeRO-1, ZeRO-2, ZeRO-3" in title and "A100-40GB" in title
    fig = memory_figure(model=Transformer.preset("gpt2-124m"), dp=1, micro_batch=1)
    assert "fits: ZeRO-0" in fig.axes[0].get_title()
    fig = memory_figure(model="gpt3-175b", dp=1, micro_batch=1)  # nothing fits one GPU
    title = fig.axes[0].get_title()
    assert "nothing fits (at best ZeRO-" in title and "of 80)" in title and "fits:" not in title


@pytest.mark.slow
def test_explorer_redraws_and_carries_png() -> None:
    box = memory_explorer(model="gpt2-124m", dp=1)
    bundle = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["image/png"]
    first = box.png
    box.controls["model"].value = "gpt3-175b"
    assert box.png != first

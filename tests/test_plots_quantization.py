"""The int8 decode figure draws both panels for any catalog GPU."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from labsim.plots import int8_decode  # noqa: E402


def test_int8_decode_figure() -> None:
    fig = int8_decode("A100-80GB", batches=(1, 8), contexts=(0, 512))
    left, right = fig.axes
    assert left.get_xscale() == "log" and left.get_yscale() == "log"
    assert len(right.get_lines()) == 2 * 2 + 1  # 2 contexts x (weight-only, W8A8) + the 3x line
    assert "A100-80GB" in left.get_title()

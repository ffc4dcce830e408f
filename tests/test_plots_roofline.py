"""The roofline chart draws one roof per machine, knees at the ridge points, and the points."""

from __future__ import annotations

import numpy as np
import pytest

from labsim import Roofline
from labsim.plots import roofline


def test_roofs_and_points() -> None:
    cpu = Roofline("cpu", 1e11, 1e10)
    fig = roofline(["A100-80GB", cpu], [("matmul 512", 85.0, 5e10), ("add 1M", 0.08, 8e8)])
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    roofs = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2]
    assert len(roofs) == 2
    x, y = roofs[1].get_xdata(), roofs[1].get_ydata()
    np.testing.assert_allclose(y, np.minimum(1e11, x * 1e10))
    assert max(roofs[0].get_ydata()) == 312e12
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["matmul 512", "add 1M"]


def test_no_roof_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one roof"):
        roofline([])


def test_figure_shows_itself_once_as_png() -> None:
    fig = roofline(["H100-SXM"])
    assert fig._repr_png_().startswith(b"\x89PNG")


def test_labels_of_neighbouring_points_do_not_overprint() -> None:
    fig = roofline(["A100-80GB"], [("matmul 512", 85.0, 5e10), ("matmul 513", 86.0, 5.1e10),
                                    ("add 1M", 0.08, 8e8)])
    offsets = {t.get_text(): t.xyann[1] for t in fig.axes[0].texts}
    assert offsets["matmul 512"] != offsets["matmul 513"]
    assert offsets["add 1M"] == offsets["matmul 512"]  # far apart: the usual place

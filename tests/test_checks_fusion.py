"""labsim.checks.fusion: correct solutions pass; unfused or wrong ones fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labsim.checks import CheckFailed
from labsim.checks import fusion as check
from labsim.experiments.fusion import bias_gelu_dropout_residual
from labsim.fusion import fit_launch_model


def blocked(x, bias, residual, keep, p, chunk_rows=256):  # noqa: ANN001, ANN201
    out = torch.empty_like(x)
    for i in range(0, x.shape[0], chunk_rows):
        t = F.gelu(torch.add(x[i:i + chunk_rows], bias))
        t.mul_(keep[i:i + chunk_rows]).mul_(1 / (1 - p))
        torch.add(t, residual[i:i + chunk_rows], out=out[i:i + chunk_rows])
    return out


def test_correct_solutions_pass(capsys: pytest.CaptureFixture) -> None:
    check.fused_chain(blocked)
    check.launch_model(least_squares)
    assert capsys.readouterr().out.splitlines() == [
        "PASS fused_chain: 7/7 cases passed", "PASS launch_model: 7/7 cases passed"]


def least_squares(nbytes, times_s):  # noqa: ANN001, ANN201
    if len(set(nbytes)) < 2:
        raise ValueError("need two distinct sizes")
    n = len(nbytes)
    mx, my = sum(nbytes) / n, sum(times_s) / n
    slope = (sum((x - mx) * (y - my) for x, y in zip(nbytes, times_s))
             / sum((x - mx) ** 2 for x in nbytes))
    return my - slope * mx, 1 / slope


def unfused(x, b, r, k, p, chunk_rows=256):  # noqa: ANN001, ANN201
    return r + F.gelu(x + b) * k / (1 - p)


def test_the_unfused_chain_fails_the_fusion_check() -> None:
    with pytest.raises(CheckFailed, match="full-size tensors"):
        check.fused_chain(unfused)


@pytest.mark.parametrize("shortcut", ["lambda", "itself"])
def test_calling_or_passing_the_reference_fails(shortcut: str) -> None:
    fn = (bias_gelu_dropout_residual if shortcut == "itself" else
          lambda x, b, r, k, p, chunk_rows=256: bias_gelu_dropout_residual(x, b, r, k, p))
    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        check.fused_chain(fn)
    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        check.launch_model(fit_launch_model)


def test_forgetting_the_dropout_scale_fails() -> None:
    def unscaled(x, bias, residual, keep, p, chunk_rows=256):  # noqa: ANN001, ANN202
        return blocked(x, bias, residual, keep, 0.0, chunk_rows) - 0 * p
    with pytest.raises(CheckFailed, match="fused_chain"):
        check.fused_chain(unscaled)


def test_a_fit_that_swaps_the_terms_fails() -> None:
    def swapped(nbytes, times_s):  # noqa: ANN001, ANN202
        launch, bw = least_squares(nbytes, times_s)
        return bw, launch
    with pytest.raises(CheckFailed, match="launch_model"):
        check.launch_model(swapped)

"""labsim.experiments.fusion: the reference element-wise chain and its inputs."""

from __future__ import annotations

import math

import pytest
import torch

from labsim.experiments.fusion import bias_gelu_dropout_residual, chain_inputs


def test_chain_matches_the_formula_elementwise() -> None:
    inp = chain_inputs(3, 4, p=0.25, seed=1, dtype=torch.float64)
    got = bias_gelu_dropout_residual(*inp.args)
    for i in range(3):
        for j in range(4):
            z = float(inp.x[i, j] + inp.bias[j])
            gelu = 0.5 * z * (1 + math.erf(z / math.sqrt(2)))
            kept = gelu / 0.75 if inp.keep[i, j] else 0.0
            assert float(got[i, j]) == pytest.approx(kept + float(inp.residual[i, j]), rel=1e-12)


def test_inputs_are_seeded_and_shaped() -> None:
    a, b = chain_inputs(5, 7, seed=3), chain_inputs(5, 7, seed=3)
    assert torch.equal(a.x, b.x) and torch.equal(a.keep, b.keep)
    assert a.keep.dtype == torch.bool and a.bias.shape == (7,) and a.numel == 35
    assert not torch.equal(a.x, chain_inputs(5, 7, seed=4).x)


def test_p_zero_keeps_everything_and_bad_p_fails() -> None:
    inp = chain_inputs(2, 2, p=0.0)
    assert bool(inp.keep.all())
    with pytest.raises(ValueError, match="p must be"):
        bias_gelu_dropout_residual(inp.x, inp.bias, inp.residual, inp.keep, 1.0)
    with pytest.raises(ValueError):
        chain_inputs(0, 3)


@pytest.mark.slow
def test_compile_keeps_the_generated_kernel() -> None:
    from labsim.experiments.fusion import compile_and_time

    inp = chain_inputs(8, 32, p=0.1)
    compiled = compile_and_time(bias_gelu_dropout_residual, *inp.args, dynamic=True)
    (kernel,) = compiled.kernels()  # one fused kernel for the whole chain
    assert "fused" in kernel and "gelu" in kernel
    assert "out_ptr0" in compiled.kernel_source(kernel) or "out_ptr0" in compiled.code[0]
    with pytest.raises(ValueError, match="no kernel"):
        compiled.kernel_source("cpp_fused_nothing")

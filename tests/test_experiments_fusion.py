"""labsim.experiments.fusion: the reference element-wise chain and its inputs."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # Triton's own jitted helpers (tl.rand) run in its interpreter only if it is on when
    # triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


def test_triton_rand_is_uniform_in_float32_and_seeded() -> None:
    from labsim.experiments.fusion import dropout_keep, triton_rand

    u = triton_rand(7, 20000)
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert torch.equal(u, triton_rand(7, 20000)) and not torch.equal(u, triton_rand(8, 20000))
    assert torch.equal(triton_rand(7, 100), u[:100])  # element i's number depends on i alone
    keep = dropout_keep(7, (100, 200), 0.25)
    assert keep.shape == (100, 200) and keep.dtype == torch.bool
    assert torch.equal(keep.flatten(), u > 0.25)
    assert bool(dropout_keep(3, (4, 5), 0.0).all())


@pytest.mark.parametrize("seed", [0, 1, 2024, 2**31 - 1, 2**40 + 5, -3, 2**63 + 7])
def test_triton_rand_is_what_tl_rand_draws(seed: int) -> None:
    """Against Triton's own tl.rand, run by its interpreter (on from the first import)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from labsim.experiments.fusion import triton_rand
    from labsim.lab.launches import interpreting, library_interpreted

    if not (interpreting() and library_interpreted()):
        pytest.skip("needs Triton's interpreter from the first import")

    @triton.jit
    def draw(out_ptr, n, seed, BLOCK: tl.constexpr):  # noqa: N803
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offsets, tl.rand(seed, offsets), mask=offsets < n)

    out = torch.empty(3000)
    draw[(3,)](out, 3000, seed, BLOCK=1024)
    assert torch.equal(out, triton_rand(seed, 3000))


def test_time_per_call_batches_and_keeps_the_rounds() -> None:
    from labsim.experiments.fusion import calls_for, fmt_timing, time_add_sizes, time_per_call

    calls = []
    timed = time_per_call({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                          rounds=3, batch_s=1e-3, single=["b"])
    assert set(timed) == {"a", "b"} and all(len(t.times_s) == 3 for t in timed.values())
    assert calls.count("b") == 1 + 3  # a warm-up, then one call in each of three rounds
    assert calls.count("a") > calls.count("b")  # a batch of calls per round
    assert calls_for(lambda: None, 1e-9) == 1 and calls_for(lambda: None, 10.0) == 1000
    sizes = time_add_sizes([1, 1000], rounds=2)
    assert [(s.numel, s.nbytes) for s in sizes] == [(1, 12), (1000, 12000)]
    assert all(len(s.latency.times_s) == len(s.queued.times_s) == 2 for s in sizes)
    assert fmt_timing(sizes[0].queued).count("[") == 1

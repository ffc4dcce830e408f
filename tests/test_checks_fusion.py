"""labsim.checks.fusion: correct solutions pass; unfused, unmasked or wrong ones fail.

The fused chain is a Triton kernel: on a CPU it runs in Triton's interpreter, which must be on
when triton is first imported (its own jitted helpers, ``tl.rand``'s Philox among them, are
made then)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from labsim.checks import CheckFailed, ExerciseNotDone  # noqa: E402
from labsim.checks import fusion as check  # noqa: E402
from labsim.experiments.fusion import dropout_keep  # noqa: E402
from labsim.fusion import fit_launch_model  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from labsim.lab.launches import interpreting, library_interpreted  # noqa: E402

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not (interpreting() and library_interpreted()),
    reason="needs a GPU or Triton's interpreter from the first import")
interpreter_only = pytest.mark.skipif(
    not (interpreting() and library_interpreted()),
    reason="the interpreter bounds-checks loads; a compiled kernel's are not seen")

SQRT_HALF = 0.7071067811865476


# -- the solution and honest variants ------------------------------------------------------

@triton.jit
def chain_kernel(x_ptr, bias_ptr, residual_ptr, out_ptr, n_elements, hidden, p, seed,
                 BLOCK_SIZE: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    bias = tl.load(bias_ptr + offsets % hidden, mask=mask).to(tl.float32)
    residual = tl.load(residual_ptr + offsets, mask=mask).to(tl.float32)
    t = x + bias
    gelu = 0.5 * t * (1.0 + tl.erf(t * SQRT_HALF))
    keep = tl.rand(seed, offsets) > p
    y = tl.where(keep, gelu / (1.0 - p), 0.0) + residual
    tl.store(out_ptr + offsets, y, mask=mask)


def fused(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN201
    out = torch.empty_like(x)
    n = x.numel()
    chain_kernel[(triton.cdiv(n, block_size),)](x, bias, residual, out, n, x.shape[-1], p,
                                                seed, BLOCK_SIZE=block_size)
    return out


@triton.jit
def _gelu(t):  # noqa: ANN001, ANN202
    return t * 0.5 * (1.0 + tl.erf(t / 1.4142135623730951))


@triton.jit
def chain_kernel_helpers(x_ptr, bias_ptr, residual_ptr, out_ptr, n_elements, hidden, scale, p,
                         seed, BLOCK_SIZE: tl.constexpr):  # noqa: N803
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    column = offsets % hidden
    t = x + tl.load(bias_ptr + column, mask=mask, other=0.0).to(tl.float32)
    keep = (tl.rand(seed, offsets) > p).to(tl.float32)
    y = _gelu(t) * keep * scale
    y += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, y, mask=mask)


def fused_variant(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN201
    flat = x.contiguous().view(-1)
    out = torch.zeros_like(flat)
    grid = lambda meta: (triton.cdiv(meta["n_elements"], meta["BLOCK_SIZE"]),)  # noqa: E731
    chain_kernel_helpers[grid](flat, bias, residual.view(-1), out, flat.numel(), bias.numel(),
                               1.0 / (1.0 - p), p, seed, BLOCK_SIZE=block_size)
    return out.view(x.shape)


@needs_triton
@pytest.mark.parametrize("solution", [fused, fused_variant], ids=["tuple grid", "variant"])
def test_correct_solutions_pass(solution: object, capsys: pytest.CaptureFixture) -> None:
    check.fused_chain(solution)
    assert capsys.readouterr().out.splitlines() == ["PASS fused_chain: 8/8 cases passed"]


def test_a_least_squares_fit_passes(capsys: pytest.CaptureFixture) -> None:
    check.launch_model(least_squares)
    assert capsys.readouterr().out.splitlines() == ["PASS launch_model: 7/7 cases passed"]


def least_squares(nbytes, times_s):  # noqa: ANN001, ANN201
    if len(set(nbytes)) < 2:
        raise ValueError("need two distinct sizes")
    n = len(nbytes)
    mx, my = sum(nbytes) / n, sum(times_s) / n
    slope = (sum((x - mx) * (y - my) for x, y in zip(nbytes, times_s))
             / sum((x - mx) ** 2 for x in nbytes))
    return my - slope * mx, 1 / slope


# -- shortcuts that must fail ---------------------------------------------------------------

def _eager_with_mask(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
    keep = dropout_keep(seed, x.shape, p)
    return residual + F.gelu(x.float() + bias.float()).to(x.dtype) * keep / (1 - p)


def _torch_mask(seed: int, shape: torch.Size, p: float) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > p


def _eager(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
    return residual + F.gelu(x + bias) * _torch_mask(seed, x.shape, p) / (1 - p)


def test_the_eager_chain_fails() -> None:
    with pytest.raises(CheckFailed, match="launched no Triton kernel|torch operators"):
        check.fused_chain(_eager)
    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        check.fused_chain(_eager_with_mask)


def test_a_compiled_chain_fails() -> None:
    compiled = torch.compile(_eager, dynamic=True)

    def via_compile(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
        return compiled(x, bias, residual, p, seed)

    with pytest.raises(CheckFailed, match="calls labsim's own reference `torch.compile`"
                                          "|launched no Triton kernel"):
        check.fused_chain(via_compile)


@triton.jit
def _add_bias_gelu(x_ptr, bias_ptr, out_ptr, n_elements, hidden, BLOCK_SIZE: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    t = (tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
         + tl.load(bias_ptr + offsets % hidden, mask=mask).to(tl.float32))
    tl.store(out_ptr + offsets, 0.5 * t * (1.0 + tl.erf(t * SQRT_HALF)), mask=mask)


@triton.jit
def _dropout(t_ptr, out_ptr, n_elements, p, seed, BLOCK_SIZE: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    t = tl.load(t_ptr + offsets, mask=mask).to(tl.float32)
    keep = tl.rand(seed, offsets) > p
    tl.store(out_ptr + offsets, tl.where(keep, t / (1.0 - p), 0.0), mask=mask)


@triton.jit
def _add(a_ptr, b_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    a = tl.load(a_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, a + tl.load(b_ptr + offsets, mask=mask).to(tl.float32),
             mask=mask)


def _kernel_per_op(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
    n = x.numel()
    grid = (triton.cdiv(n, block_size),)
    t, u, out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
    _add_bias_gelu[grid](x, bias, t, n, x.shape[-1], BLOCK_SIZE=block_size)
    _dropout[grid](t, u, n, p, seed, BLOCK_SIZE=block_size)
    _add[grid](u, residual, out, n, BLOCK_SIZE=block_size)
    return out


@needs_triton
def test_a_kernel_per_op_fails() -> None:
    with pytest.raises(CheckFailed, match="launched 3 Triton kernels per call"):
        check.fused_chain(_kernel_per_op)


@triton.jit
def _unmasked(x_ptr, bias_ptr, residual_ptr, out_ptr, n_elements, hidden, p, seed,
              BLOCK_SIZE: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    t = (tl.load(x_ptr + offsets).to(tl.float32)
         + tl.load(bias_ptr + offsets % hidden).to(tl.float32))
    gelu = 0.5 * t * (1.0 + tl.erf(t * SQRT_HALF))
    y = tl.where(tl.rand(seed, offsets) > p, gelu / (1.0 - p), 0.0)
    tl.store(out_ptr + offsets, y + tl.load(residual_ptr + offsets).to(tl.float32))


@triton.jit
def _store_masked_only(x_ptr, bias_ptr, residual_ptr, out_ptr, n_elements, hidden, p, seed,
                       BLOCK_SIZE: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    t = (tl.load(x_ptr + offsets).to(tl.float32)
         + tl.load(bias_ptr + offsets % hidden).to(tl.float32))
    gelu = 0.5 * t * (1.0 + tl.erf(t * SQRT_HALF))
    y = tl.where(tl.rand(seed, offsets) > p, gelu / (1.0 - p), 0.0)
    tl.store(out_ptr + offsets, y + tl.load(residual_ptr + offsets).to(tl.float32),
             mask=offsets < n_elements)


def _launching(kernel: object):  # noqa: ANN202
    def wrapper(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
        out = torch.empty_like(x)
        n = x.numel()
        kernel[(triton.cdiv(n, block_size),)](x, bias, residual, out, n, x.shape[-1], p, seed,
                                              BLOCK_SIZE=block_size)
        return out
    return wrapper


@interpreter_only
@pytest.mark.parametrize("kernel", [_unmasked, _store_masked_only],
                         ids=["no mask", "stores masked, loads not"])
def test_a_kernel_that_ignores_the_tail_fails(kernel: object) -> None:
    with pytest.raises(CheckFailed, match=r"outside the tensor .* mask it \(offsets < "
                                          "n_elements\\)"):
        check.fused_chain(_launching(kernel))


@needs_triton
def test_a_store_past_the_end_is_seen_without_the_interpreter_s_bounds_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU run relies on: the guard elements after the output."""
    from labsim.lab.launches import LaunchLog

    monkeypatch.setattr(LaunchLog, "_check_inside", lambda *args: None)

    @triton.jit
    def loads_masked_only(x_ptr, bias_ptr, residual_ptr, out_ptr, n_elements, hidden, p,
                          seed, BLOCK_SIZE: tl.constexpr):  # noqa: N803
        offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_elements
        t = (tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
             + tl.load(bias_ptr + offsets % hidden, mask=mask, other=0.0).to(tl.float32))
        gelu = 0.5 * t * (1.0 + tl.erf(t * SQRT_HALF))
        y = tl.where(tl.rand(seed, offsets) > p, gelu / (1.0 - p), 0.0)
        tl.store(out_ptr + offsets,
                 y + tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32))

    with pytest.raises(CheckFailed, match="past the end of its output"):
        check.fused_chain(_launching(loads_masked_only))


@triton.jit
def _copy(src_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    tl.store(out_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def _eager_then_copy(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
    y = _eager(x, bias, residual, p, seed)
    out = torch.empty_like(x)
    _copy[(triton.cdiv(x.numel(), block_size),)](y, out, x.numel(), BLOCK_SIZE=block_size)
    return out


@needs_triton
def test_eager_work_around_one_launch_fails() -> None:
    with pytest.raises(CheckFailed, match="torch operators on the tensors itself"):
        check.fused_chain(_eager_then_copy)


@triton.jit
def _one_program(x_ptr, bias_ptr, residual_ptr, out_ptr, n_elements, hidden, p, seed,
                 BLOCK_SIZE: tl.constexpr):  # noqa: N803
    for start in range(0, n_elements, BLOCK_SIZE):
        offsets = start + tl.arange(0, BLOCK_SIZE)
        mask = offsets < n_elements
        t = (tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
             + tl.load(bias_ptr + offsets % hidden, mask=mask).to(tl.float32))
        gelu = 0.5 * t * (1.0 + tl.erf(t * SQRT_HALF))
        y = tl.where(tl.rand(seed, offsets) > p, gelu / (1.0 - p), 0.0)
        y += tl.load(residual_ptr + offsets, mask=mask).to(tl.float32)
        tl.store(out_ptr + offsets, y, mask=mask)


def _single_program(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
    out = torch.empty_like(x)
    _one_program[(1,)](x, bias, residual, out, x.numel(), x.shape[-1], p, seed,
                       BLOCK_SIZE=block_size)
    return out


@needs_triton
def test_one_program_for_every_block_fails() -> None:
    with pytest.raises(CheckFailed, match="launch one program per block"):
        check.fused_chain(_single_program)


def _in_place(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
    n = x.numel()
    chain_kernel[(triton.cdiv(n, block_size),)](x, bias, residual, x, n, x.shape[-1], p, seed,
                                                BLOCK_SIZE=block_size)
    return x


@needs_triton
def test_writing_over_the_input_fails() -> None:
    with pytest.raises(CheckFailed, match="changed its input number 1"):
        check.fused_chain(_in_place)


@triton.jit
def _unscaled(x_ptr, bias_ptr, residual_ptr, out_ptr, n_elements, hidden, p, seed,
              BLOCK_SIZE: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    t = (tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
         + tl.load(bias_ptr + offsets % hidden, mask=mask).to(tl.float32))
    gelu = 0.5 * t * (1.0 + tl.erf(t * SQRT_HALF))
    y = tl.where(tl.rand(seed, offsets) > p, gelu, 0.0)  # forgets 1 / (1 - p)
    tl.store(out_ptr + offsets, y + tl.load(residual_ptr + offsets, mask=mask), mask=mask)


def _mask_from_torch(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
    """Dropout's mask drawn by torch in the wrapper: another tensor, and other numbers."""
    keep = _torch_mask(seed, x.shape, p).to(x.dtype)
    out = torch.empty_like(x)
    n = x.numel()
    chain_kernel[(triton.cdiv(n, block_size),)](x, bias, residual, out, n, x.shape[-1], 0.0,
                                                seed, BLOCK_SIZE=block_size)
    return out * keep


@needs_triton
def test_wrong_dropout_fails() -> None:
    with pytest.raises(CheckFailed, match="fused_chain: 1/8"):  # only p = 0 passes
        check.fused_chain(_launching(_unscaled))
    with pytest.raises(CheckFailed, match="torch operators on the tensors itself"):
        check.fused_chain(_mask_from_torch)


def test_the_stub_is_not_done() -> None:
    def stub(x, bias, residual, p, seed, block_size=1024):  # noqa: ANN001, ANN202
        raise NotImplementedError

    with pytest.raises(ExerciseNotDone):
        check.fused_chain(stub)


def test_an_interpreter_switched_on_too_late_is_named(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    import labsim.lab.launches as launches

    monkeypatch.setattr(launches, "interpreting", lambda: True)
    monkeypatch.setattr(launches, "library_interpreted", lambda: False)
    with pytest.raises(CheckFailed, match="TRITON_INTERPRET=1 was set after triton"):
        check.fused_chain(fused)


def test_calling_or_passing_the_reference_fails() -> None:
    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        check.launch_model(fit_launch_model)


def test_a_fit_that_swaps_the_terms_fails() -> None:
    def swapped(nbytes, times_s):  # noqa: ANN001, ANN202
        launch, bw = least_squares(nbytes, times_s)
        return bw, launch
    with pytest.raises(CheckFailed, match="launch_model"):
        check.launch_model(swapped)


@pytest.mark.parametrize("solver", ["torch", "numpy"])
def test_a_library_fit_fails(solver: str) -> None:
    def library(nbytes, times_s):  # noqa: ANN001, ANN202
        if len(set(nbytes)) < 2:
            raise ValueError("need two distinct sizes")
        if solver == "numpy":
            import numpy as np

            slope, intercept = np.polyfit(nbytes, times_s, 1)
            return float(intercept), 1 / float(slope)
        a = torch.tensor([[1.0, x] for x in nbytes], dtype=torch.float64)
        y = torch.tensor(times_s, dtype=torch.float64).unsqueeze(1)
        intercept, slope = torch.linalg.lstsq(a, y).solution.flatten().tolist()
        return intercept, 1 / slope

    with pytest.raises(CheckFailed, match="calls labsim's own reference `numpy.polyfit`"
                                          "|solved the fit with aten::linalg_lstsq"):
        check.launch_model(library)

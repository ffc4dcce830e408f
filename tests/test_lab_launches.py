"""labsim.lab.launches: Triton launches recorded, Triton's own copies out of the operator log,
and the interpreter's loads and stores bounds-checked before they touch memory."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    # Triton's own jitted helpers are made for the interpreter only if it is on when triton
    # is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from labsim.lab.launches import (  # noqa: E402
    LaunchLog,
    OutOfBounds,
    interpreting,
    library_interpreted,
)
from labsim.lab.profile import OpLog  # noqa: E402

pytestmark = pytest.mark.skipif(not (interpreting() and library_interpreted()),
                                reason="needs Triton's interpreter from the first import")


@triton.jit
def _twice(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2, mask=mask)


@triton.jit
def _twice_unmasked_load(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * 2, mask=offsets < n)


@triton.jit
def _twice_unmasked_store(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n, other=0.0) * 2)


@pytest.mark.parametrize("grid", ["tuple", "function"])
def test_a_launch_is_recorded_with_its_programs(grid: str) -> None:
    x = torch.arange(300, dtype=torch.float32)
    out = torch.empty_like(x)
    launch = (3,) if grid == "tuple" else (lambda meta: (triton.cdiv(meta["n"],
                                                                     meta["BLOCK"]),))
    with LaunchLog(bounds=True) as log:
        _twice[launch](x, out, 300, BLOCK=128)
    assert [(lc.kernel, lc.programs, lc.interpreted) for lc in log.launches] == [
        ("_twice", 3, True)]
    assert log.out_of_bounds == [] and torch.equal(out, 2 * x)


def test_triton_s_own_copies_stay_out_of_the_operator_log() -> None:
    x = torch.ones(64)
    out = torch.empty(64)
    with LaunchLog(), OpLog() as ops:
        _twice[(1,)](x, out, 64, BLOCK=64)
    assert dict(ops.counts) == {}
    with OpLog() as ops:  # unwatched, the interpreter copies the arguments with torch
        _twice[(1,)](x, out, 64, BLOCK=64)
    assert ops.counts


@pytest.mark.parametrize(("kernel", "verb"), [(_twice_unmasked_load, "loaded"),
                                              (_twice_unmasked_store, "stored")])
def test_an_access_past_the_end_is_refused_before_it_happens(kernel: object, verb: str) -> None:
    x = torch.arange(300, dtype=torch.float32)
    guard = torch.full((1024,), 7.0)
    out = guard[:300]  # what an unmasked store would overwrite: the rest of ``guard``
    with LaunchLog(bounds=True) as log, pytest.raises(Exception) as raised:
        kernel[(3,)](x, out, 300, BLOCK=128)
    assert isinstance(raised.value.__cause__, OutOfBounds)
    assert log.out_of_bounds == [f"program 2 of {kernel.__name__} {verb} 84 element(s) "
                                 "outside the tensor it was reading or writing"]
    assert bool((guard[300:] == 7.0).all())  # refused before it touched memory


def test_without_bounds_nothing_is_checked_and_everything_is_restored() -> None:
    import triton.runtime.interpreter as interp

    before = interp.InterpretedFunction.run, interp.InterpreterBuilder.create_masked_load
    profile = sys.getprofile()
    x = torch.arange(256, dtype=torch.float32)
    out = torch.empty(256)
    with LaunchLog() as log:
        _twice[(2,)](x, out, 256, BLOCK=128)
    assert log.launches[0].programs == 2
    assert (interp.InterpretedFunction.run, interp.InterpreterBuilder.create_masked_load
            ) == before
    assert sys.getprofile() is profile


def test_a_block_past_the_end_counts_the_neighbour_it_reaches_as_outside() -> None:
    """The host copies of two arguments may lie side by side: a load running 84 elements past
    the first tensor's end into the next one is still 84 elements outside, not 44 inside the
    first and 80 inside its neighbour."""
    import types

    import numpy as np

    log = LaunchLog(bounds=True)
    log._kernel = "k"
    base = 1 << 20
    log._extents = [(base, base + 300 * 4), (base + 300 * 4 + 64, base + 300 * 4 + 64 + 1200)]
    element = types.SimpleNamespace(primitive_bitwidth=32)
    ptrs = types.SimpleNamespace(data=base + 4 * np.arange(256, 384),
                                 get_element_ty=lambda: element)
    mask = types.SimpleNamespace(data=np.ones(128, dtype=bool))
    builder = types.SimpleNamespace(grid_idx=(2, 0, 0))
    with pytest.raises(OutOfBounds, match="84 element"):
        log._check_inside(builder, "loaded", ptrs, mask)

"""labsim.lab.profile: op counts, bytes touched, CPU/CUDA peak memory, result sizes."""

from __future__ import annotations

import torch

from labsim.lab.profile import count_ops, peak_bytes, torch_calls


def test_an_add_is_one_op_moving_three_tensors() -> None:
    a, b = torch.randn(1000), torch.randn(1000)
    counts = count_ops(torch.add, a, b)
    assert counts.by_name() == {"aten::add": 1}
    assert counts.nbytes == 3 * 4 * 1000
    assert counts.kernels == 0 and counts.compiled_regions == 0
    assert "aten::add x1" in repr(counts)


def test_in_place_op_reads_and_writes_its_first_operand() -> None:
    a, b = torch.randn(100), torch.randn(100)
    counts = count_ops(lambda: a.add_(b))
    assert counts.by_name() == {"aten::add_": 1}
    assert counts.nbytes == 3 * 4 * 100


def test_broadcast_output_is_the_full_shape() -> None:
    x, bias = torch.randn(8, 16), torch.randn(16)
    assert count_ops(torch.add, x, bias).nbytes == (128 + 16 + 128) * 4


def test_views_and_allocations_are_not_counted() -> None:
    x = torch.randn(4, 4)
    assert count_ops(lambda: x.view(16)[:3].t()).n_ops == 0
    # reshaping a transposed tensor must copy: that one is real work
    assert count_ops(lambda: x.t().reshape(16)).by_name() == {"aten::copy_": 1}


def test_peak_is_the_largest_moment_not_the_sum() -> None:
    n = 1 << 20

    def two_temporaries(like: torch.Tensor) -> float:
        first = torch.ones(n, device=like.device)  # 4 MiB, freed before the next one is made
        total = float(first.sum())
        del first
        second = torch.ones(n, device=like.device)
        return total + float(second.sum())

    # a CPU tensor argument: with no tensor arguments a machine with a GPU measures CUDA
    peak = peak_bytes(two_temporaries, torch.empty(0))
    assert 4 * n <= peak < 2 * 4 * n


def test_peak_grows_with_the_square_for_a_score_matrix() -> None:
    small, big = torch.randn(256, 16), torch.randn(512, 16)
    p1 = peak_bytes(lambda q: torch.softmax(q @ q.T, -1), small)
    p2 = peak_bytes(lambda q: torch.softmax(q @ q.T, -1), big)
    assert 3.5 < p2 / p1 < 4.5


def test_torch_calls_sees_every_tensor_built_and_every_call() -> None:
    q = torch.randn(64, 8)
    calls = torch_calls(lambda t: torch.softmax(t @ t.T, -1) @ t, q)
    assert calls.result.shape == (64, 8)
    assert calls.largest == 64 * 64
    assert "softmax" in calls.names
    assert torch_calls(lambda t: t[:4].mul_(2), q).largest == 4 * 8


def test_bytes_are_counted_where_profiler_events_carry_no_dtypes(monkeypatch) -> None:
    """Before torch 2.13 a FunctionEvent has no ``input_dtypes`` (seen on torch 2.11 + CUDA
    13.0, where lab 05's first ``count_ops`` raised AttributeError); the Kineto events carry
    the same dtypes, and the counts must not change."""
    from torch.autograd import profiler_util

    x, bias = torch.randn(8, 16), torch.randn(16)
    with_dtypes = count_ops(torch.add, x, bias)
    init = profiler_util.FunctionEvent.__init__
    built = []

    def older_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        self.__dict__.pop("input_dtypes", None)
        built.append(self)

    monkeypatch.setattr(profiler_util.FunctionEvent, "__init__", older_init)
    without = count_ops(torch.add, x, bias)
    assert built and not any(hasattr(e, "input_dtypes") for e in built)
    assert without.nbytes == with_dtypes.nbytes == (128 + 16 + 128) * 4
    assert without.by_name() == with_dtypes.by_name() == {"aten::add": 1}


def test_an_op_that_wraps_other_ops_is_not_counted_twice():
    """``aten::softmax`` runs ``aten::_softmax``; ``masked_fill`` is a copy and an in-place
    fill: only the ops doing the work count, so the bytes are those each moves once."""
    s = torch.randn(32, 32)
    soft = count_ops(torch.softmax, s, -1)
    assert soft.by_name() == {"aten::_softmax": 1}
    assert soft.nbytes == 2 * 32 * 32 * 4
    mask = torch.ones(32, 32, dtype=torch.bool).tril()
    filled = count_ops(lambda: s.masked_fill(~mask, 0.0)).by_name()
    assert "aten::masked_fill" not in filled
    assert filled.get("aten::masked_fill_") == 1

"""Plain data: what crosses between a learner's sandbox and the grader.  It round-trips the
values checks use, refuses anything else, and a hostile file is refused with a reason."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
import torch

from labsim.checks import _plain
from labsim.checks._plain import Limits, PlainDataError, decode, encode, roundtrip


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 2**80, 1.5, math.inf, "héllo", [1, [2.0, None]], (1, (2, "x")),
    {"a": 1, 3: [True], (1, 2): "tuple key", None: 0.5},
    torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.tensor(2.5, dtype=torch.float64),
    torch.zeros(0, 4), torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
    torch.tensor([True, False]), np.arange(4, dtype=np.int32), np.float32(3.0),
])
def test_values_round_trip_exactly(value) -> None:  # noqa: ANN001
    got = roundtrip(value)
    if isinstance(value, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == value.dtype
        assert got.shape == value.shape and torch.equal(got, value)
    elif isinstance(value, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == value.dtype
        assert np.array_equal(got, value)
    elif isinstance(value, np.generic):
        assert got == value.item() and type(got) is float
    else:
        assert got == value and type(got) is type(value)


def test_nan_and_views_survive() -> None:
    assert math.isnan(roundtrip(float("nan")))
    base = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(roundtrip(base.T), base.T)  # non-contiguous: copied in C order


class Mine:
    pass


def _deep(n: int) -> list:
    value: list = [0]
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("value", [Mine(), print, torch, {1, 2}, b"bytes", 1j,
                                   torch.zeros(2, dtype=torch.complex64), _deep(60)])
def test_anything_else_is_refused(value) -> None:  # noqa: ANN001
    with pytest.raises(PlainDataError):
        encode(value)


def _doc(entry: dict) -> str:
    return json.dumps({"$tensor": entry})


@pytest.mark.parametrize(("text", "blob", "why"), [
    (_doc({"kind": "torch", "dtype": "float64", "shape": [4], "offset": 0, "nbytes": 32}),
     b"\0" * 8, "beyond the data"),
    (_doc({"kind": "torch", "dtype": "float64", "shape": [2**30], "offset": 0,
           "nbytes": 2**33}), b"", "elements"),
    (_doc({"kind": "torch", "dtype": "object", "shape": [1], "offset": 0, "nbytes": 8}),
     b"\0" * 8, "dtype"),
    (_doc({"kind": "torch", "dtype": "int8", "shape": [-1], "offset": 0, "nbytes": 1}),
     b"\0", "shape"),
    (_doc({"kind": "torch", "dtype": "int8", "shape": [1], "offset": -1, "nbytes": 1}),
     b"\0", "offset"),
    (json.dumps({"$pickle": "gASVDAAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOULg=="}), b"", "unknown"),
    ("[" * 100_000 + "]" * 100_000, b"", "nested"),
    (json.dumps(_deep(60)), b"", "nested"),
    ("{not json", b"", "not valid JSON"),
    (b"\xff\xfe[1]", b"", "not UTF-8"),
    (json.dumps({"$map": [[1]]}), b"", "pairs"),
    (json.dumps({"$map": [[[1], 2]]}), b"", "key"),
])
def test_hostile_plain_data_is_refused_with_a_reason(text, blob, why: str) -> None:  # noqa: ANN001
    with pytest.raises(PlainDataError, match=why):
        decode(text, blob)


def test_limits_bound_what_is_read() -> None:
    text, blob = encode([torch.zeros(100)] * 3)
    with pytest.raises(PlainDataError):
        decode(text, blob, Limits(tensors=2))
    with pytest.raises(PlainDataError):
        decode(text, blob, Limits(text_bytes=10))
    with pytest.raises(PlainDataError, match="too large"):
        encode(torch.zeros(10), Limits(blob_bytes=8))


def test_a_pickle_is_not_plain_data() -> None:
    evil = pickle.dumps(Mine())
    with pytest.raises(PlainDataError):
        decode(evil, b"")
    assert not hasattr(_plain, "pickle")  # the codec never imports pickle

"""Plain data: the only form in which values cross between a learner's process and the grader.

A check's inputs go into the sandbox and the learner's results come back out in this format,
never as pickle: loading it cannot run code.  A value is JSON text plus one binary blob:

- ``None``, ``bool``, ``int``, ``float`` (NaN and infinities included), ``str``: JSON values;
- ``list``: a JSON list; ``tuple``: ``{"$tuple": [...]}``; ``dict``: ``{"$map": [[k, v], ...]}``
  (keys of any of these kinds, order kept);
- a ``torch.Tensor`` or ``numpy.ndarray`` of an allowed dtype: ``{"$tensor": {"kind", "dtype",
  "shape", "offset", "nbytes"}}``, its bytes at ``offset`` in the blob (C order, little endian);
- numpy scalars become Python numbers.

Anything else (a module, a function, an object of a learner's class) cannot be encoded and
raises ``PlainDataError``.  Decoding checks every size against the blob and the limits
(``Limits``), so a hostile file is refused with a reason, never trusted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
}
NUMPY_DTYPES = {
    "bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32,
    "int64": np.int64, "float16": np.float16, "float32": np.float32, "float64": np.float64,
}
_KEYS = ("$tuple", "$map", "$tensor")


class PlainDataError(ValueError):
    """A value that cannot be sent as plain data, or a file that is not valid plain data."""


@dataclass(frozen=True)
class Limits:
    """What a decoder accepts: JSON bytes, blob bytes, nesting depth, tensors and elements."""

    text_bytes: int = 32 * 2**20
    blob_bytes: int = 512 * 2**20
    depth: int = 40
    tensors: int = 20_000
    numel: int = 64 * 2**20
    containers: int = 500_000  # JSON lists and objects: each costs ~100 bytes decoded

    def __post_init__(self) -> None:
        if min(self.text_bytes, self.blob_bytes, self.depth, self.tensors, self.numel) <= 0:
            raise ValueError("every plain-data limit must be > 0")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


class _Encoder:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.chunks: list[bytes] = []
        self.size = 0
        self.tensors = 0

    def tensor(self, t: torch.Tensor, kind: str) -> dict:
        name = _dtype_name(t.dtype)
        if name not in TORCH_DTYPES:
            raise PlainDataError(f"a tensor of dtype {name} cannot be sent (allowed: "
                                 f"{', '.join(TORCH_DTYPES)})")
        if t.layout != torch.strided or t.is_quantized or t.is_complex():
            raise PlainDataError("only dense real tensors can be sent")
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        self.tensors += 1
        if self.tensors > self.limits.tensors or self.size + len(raw) > self.limits.blob_bytes:
            raise PlainDataError("the value is too large to send (limits: "
                                 f"{self.limits.tensors} tensors, {self.limits.blob_bytes} bytes)")
        entry = {"kind": kind, "dtype": name, "shape": list(t.shape), "offset": self.size,
                 "nbytes": len(raw)}
        self.chunks.append(raw)
        self.size += len(raw)
        return {"$tensor": entry}

    def value(self, v: Any, depth: int = 0) -> Any:
        if depth > self.limits.depth:
            raise PlainDataError(f"nested deeper than {self.limits.depth} levels")
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return float(v)
        if isinstance(v, np.generic):
            return self.value(v.item(), depth)
        if isinstance(v, torch.Tensor):
            return self.tensor(v, "torch")
        if isinstance(v, np.ndarray):
            if v.dtype.byteorder == ">" or _dtype_name(v.dtype) not in NUMPY_DTYPES:
                raise PlainDataError(f"a numpy array of dtype {v.dtype} cannot be sent")
            return self.tensor(torch.from_numpy(np.ascontiguousarray(v)), "numpy")
        if isinstance(v, list):
            return [self.value(x, depth + 1) for x in v]
        if isinstance(v, tuple):
            return {"$tuple": [self.value(x, depth + 1) for x in v]}
        if isinstance(v, dict):
            return {"$map": [[self.value(k, depth + 1), self.value(x, depth + 1)]
                             for k, x in v.items()]}
        raise PlainDataError(f"a {type(v).__name__} cannot be sent as plain data (numbers, "
                             "strings, lists, tuples, dicts and tensors can)")


def encode(value: Any, limits: Limits = Limits()) -> tuple[str, bytes]:
    """``(json_text, blob)`` of ``value``; ``PlainDataError`` if it is not plain data."""
    enc = _Encoder(limits)
    doc = enc.value(value)
    try:
        text = json.dumps(doc, allow_nan=True, ensure_ascii=True)
    except (ValueError, RecursionError) as exc:  # pragma: no cover - values are checked above
        raise PlainDataError(f"cannot write the value: {exc}") from None
    if len(text) > limits.text_bytes:
        raise PlainDataError(f"the value's text is over {limits.text_bytes} bytes")
    return text, b"".join(enc.chunks)


class _Decoder:
    def __init__(self, blob: bytes, limits: Limits) -> None:
        self.blob = blob
        self.limits = limits
        self.tensors = 0
        self.numel = 0

    def tensor(self, entry: Any) -> Any:
        if not isinstance(entry, dict) or set(entry) != {"kind", "dtype", "shape", "offset",
                                                         "nbytes"}:
            raise PlainDataError("malformed tensor entry")
        kind, dtype, shape = entry["kind"], entry["dtype"], entry["shape"]
        offset, nbytes = entry["offset"], entry["nbytes"]
        if kind not in ("torch", "numpy") or dtype not in TORCH_DTYPES:
            raise PlainDataError(f"tensor of unknown kind or dtype ({kind!r}, {dtype!r})")
        if kind == "numpy" and dtype not in NUMPY_DTYPES:
            raise PlainDataError(f"numpy array of dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > 16 or not all(
                type(s) is int and 0 <= s <= 2**40 for s in shape):
            raise PlainDataError("tensor shape must be a list of at most 16 sizes >= 0")
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise PlainDataError("tensor offset and size must be integers >= 0")
        numel = math.prod(shape)
        self.tensors += 1
        self.numel += numel
        if self.tensors > self.limits.tensors or self.numel > self.limits.numel:
            raise PlainDataError(f"more than {self.limits.tensors} tensors or "
                                 f"{self.limits.numel} elements")
        item = torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
        if nbytes != numel * item or offset + nbytes > len(self.blob):
            raise PlainDataError("tensor bytes do not match its shape or lie beyond the data")
        raw = bytearray(self.blob[offset:offset + nbytes])
        flat = (torch.frombuffer(raw, dtype=torch.uint8) if nbytes
                else torch.empty(0, dtype=torch.uint8))
        t = flat.view(TORCH_DTYPES[dtype]).reshape(shape).clone()
        return t.numpy() if kind == "numpy" else t

    def value(self, v: Any, depth: int = 0) -> Any:
        if depth > self.limits.depth:
            raise PlainDataError(f"nested deeper than {self.limits.depth} levels")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [self.value(x, depth + 1) for x in v]
        if isinstance(v, dict):
            if len(v) != 1 or next(iter(v)) not in _KEYS:
                raise PlainDataError("unknown object in plain data")
            key, body = next(iter(v.items()))
            if key == "$tensor":
                return self.tensor(body)
            if not isinstance(body, list):
                raise PlainDataError(f"{key} must hold a list")
            if key == "$tuple":
                return tuple(self.value(x, depth + 1) for x in body)
            out = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise PlainDataError("$map entries must be [key, value] pairs")
                k = self.value(pair[0], depth + 1)
                try:
                    out[k] = self.value(pair[1], depth + 1)
                except TypeError:
                    raise PlainDataError("a $map key that cannot be a dict key") from None
            return out
        raise PlainDataError(f"unexpected {type(v).__name__} in plain data")  # pragma: no cover


def decode(text: str | bytes, blob: bytes = b"", limits: Limits = Limits()) -> Any:
    """The value ``encode`` wrote; ``PlainDataError`` naming the problem for anything else."""
    if len(text) > limits.text_bytes or len(blob) > limits.blob_bytes:
        raise PlainDataError("plain data over the size limits")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PlainDataError(f"not UTF-8 text (byte {exc.start})") from None
    # count the containers before building them: 32 MiB of "[]," would be 11 M lists
    if text.count("[") + text.count("{") > limits.containers:
        raise PlainDataError(f"more than {limits.containers} lists and mappings")
    try:
        doc = json.loads(text)
    except RecursionError:
        raise PlainDataError("nested too deeply") from None
    except json.JSONDecodeError as exc:
        raise PlainDataError(f"not valid JSON (line {exc.lineno}, column {exc.colno}: "
                             f"{exc.msg})") from None
    try:
        return _Decoder(blob, limits).value(doc)
    except RecursionError:  # pragma: no cover - depth is limited above
        raise PlainDataError("nested too deeply") from None


def roundtrip(value: Any) -> Any:
    """``decode(*encode(value))``: the value exactly as the grader would receive it."""
    text, blob = encode(value)
    return decode(text, blob)

"""Units and formatting.

Everything inside labsim is in SI base units: bytes, seconds, FLOP, FLOP/s, bytes/s.  These
constants convert *into* SI at the edges (``80 * GB``) and the ``fmt_*`` helpers turn SI values
into text for people ("80 GB", "312 TFLOP/s").  GB is 1e9 bytes and GiB is 2**30 bytes; the
formatters always say which.
"""

from __future__ import annotations

import math
import re

KB = 1e3
MB = 1e6
GB = 1e9
TB = 1e12
KiB = 2.0**10
MiB = 2.0**20
GiB = 2.0**30
TiB = 2.0**40

US = 1e-6
MS = 1e-3

TFLOPS = 1e12
GFLOPS = 1e9

_SI_PREFIXES = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, "")]


def _scaled(value: float, unit: str, digits: int) -> str:
    for scale, prefix in _SI_PREFIXES:
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g} {prefix}{unit}"
    return f"{value:.{digits}g} {unit}"


def fmt_bytes(nbytes: float, digits: int = 3, binary: bool = False) -> str:
    """``fmt_bytes(80e9) == '80 GB'``; with ``binary=True`` powers of two: '74.5 GiB'."""
    if binary:
        for scale, name in [(TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")]:
            if abs(nbytes) >= scale:
                return f"{nbytes / scale:.{digits}g} {name}"
        return f"{nbytes:.{digits}g} B"
    return _scaled(nbytes, "B", digits).replace("kB", "KB")


def fmt_flops(flops_per_s: float, digits: int = 4) -> str:
    """``fmt_flops(312e12) == '312 TFLOP/s'``."""
    return _scaled(flops_per_s, "FLOP/s", digits)


def fmt_bandwidth(bytes_per_s: float, digits: int = 3) -> str:
    """``fmt_bandwidth(2.039e12) == '2.04 TB/s'``."""
    return _scaled(bytes_per_s, "B/s", digits).replace("kB", "KB")


def fmt_time(seconds: float, digits: int = 3) -> str:
    """Seconds as the most readable unit: '4.2 µs', '12.5 ms', '3.1 s', '2.5 h', '34 days'."""
    s = abs(seconds)
    if s >= 2 * 86400:
        return f"{seconds / 86400:.{digits}g} days"
    if s >= 2 * 3600:
        return f"{seconds / 3600:.{digits}g} h"
    if s >= 1 or s == 0:
        return f"{seconds:.{digits}g} s"
    if s >= 1e-3:
        return f"{seconds * 1e3:.{digits}g} ms"
    if s >= 1e-6:
        return f"{seconds * 1e6:.{digits}g} µs"
    return f"{seconds * 1e9:.{digits}g} ns"


def fmt_usd(dollars: float, digits: int = 3) -> str:
    """US dollars to ``digits`` significant figures with thousands separators:
    ``fmt_usd(23594.4) == '$23,600'``, ``fmt_usd(4.096) == '$4.10'``."""
    if dollars == 0:
        return "$0"
    sign = "-" if dollars < 0 else ""
    x = abs(dollars)
    exponent = math.floor(math.log10(x))
    decimals = max(0, digits - 1 - exponent)
    return f"{sign}${round(x, digits - 1 - exponent):,.{decimals}f}"


def fmt_energy(joules: float, digits: int = 3) -> str:
    """Energy in watt-hours with an SI prefix: ``fmt_energy(3.6e9) == '1 MWh'``."""
    return _scaled(joules / 3600.0, "Wh", digits)


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1.0,
    "b": 1.0,
    "kb": KB,
    "mb": MB,
    "gb": GB,
    "tb": TB,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}


def parse_bytes(text: str | float | int) -> float:
    """Parse '1GiB', '25 MB', '4096' or a number into bytes; raise ValueError naming the fix."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _SIZE_RE.match(text)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(
                f"cannot read {text!r} as a size: write a number with an optional unit, "
                "e.g. '1GiB', '25MB', '4096' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
            )
        value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value < 0:
        raise ValueError(f"size must be >= 0 bytes, got {text!r}")
    return value

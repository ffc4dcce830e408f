"""Checks for the activation-checkpointing exercises.

``checkpointed_forward``: the learner's forward must give the same output and gradients as the
plain network *and* keep exactly the bytes a ``checkpoint_sequential``-style run keeps (so it
cannot pass without really checkpointing).  ``segment_plan``: any plan the learner returns must
be valid, fit the budget under the segment model and recompute as few layers as the best plan,
found here by trying every segmentation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from labsim.checkpointing import (
    every_k,
    recomputed_layers,
    segment_peak_bytes,
    validate_starts,
)
from labsim.checks._core import Case, Outcome, Spec, close, plain_outcome, raises
from labsim.checks._observe import watch
from labsim.experiments.checkpointing import layer_step
from labsim.lab.memory import MemoryMeter
from labsim.lab.models import residual_mlp

_LAYERS, _WIDTH, _TOKENS = 6, 16, 32
FORBID = ("labsim.checks.checkpointing:forward_segments",
          "labsim.checks.checkpointing:plan_segments")


def _forward_case(forward: Callable[..., torch.Tensor], starts: list[int] | None) -> dict:
    blocks = residual_mlp(_LAYERS, _WIDTH, seed=3)
    x = torch.randn(_TOKENS, _WIDTH, generator=torch.Generator().manual_seed(4))
    with MemoryMeter(blocks) as meter:
        out = forward(blocks, x, starts)
    out.square().mean().backward()
    return {
        "output": out.detach(),
        "gradients": [p.grad.detach().clone() for p in blocks.parameters()],
        "bytes saved for backward": meter.saved_bytes,
    }


def _checkpointed_forward_cases() -> list[Case]:
    plans = [
        ("no checkpointing: starts=[0]", [0]),
        ("every layer", every_k(_LAYERS, 1)),
        ("every 2 layers", every_k(_LAYERS, 2)),
        ("uneven segments [0, 1, 4]", [0, 1, 4]),
        ("two segments [0, 5] (last one a single layer)", [0, 5]),
    ]
    return [Case(name, (starts,), expected=_forward_case(forward_segments, starts))
            for name, starts in plans]


def _drive_forward(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                   ) -> list[Outcome]:
    outcomes = []
    for case in cases:
        with watch(spec.forbid, ops=False) as seen:
            try:
                value = _forward_case(fns[0], list(case.args[0]))
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                error: BaseException | None = exc
            else:
                error = None
        outcomes.append(Outcome.of_error(error, seen.summary()) if error is not None
                        else plain_outcome(value, seen.summary()))
    return outcomes


checkpointed_forward = Spec("checkpointed_forward", _checkpointed_forward_cases,
                            drive=_drive_forward, compare=close(rtol=1e-5, atol=1e-7),
                            forbid=FORBID)
"""``fn(blocks, x, starts)`` against ``forward_segments``: same output and gradients, and
exactly the bytes a ``checkpoint_sequential``-style run keeps for backward."""


# --------------------------------------------------------------------------------------
# Planning segments for a budget


def _best_recompute(layer_bytes: Sequence[float], boundary_bytes: Sequence[float],
                    budget: float) -> int | None:
    """Fewest recomputed layers over every segmentation (2**(n-1) of them); None if none fits."""
    n = len(layer_bytes)
    best: int | None = None
    for cuts in itertools.product((False, True), repeat=n - 1):
        starts = [0] + [i + 1 for i, c in enumerate(cuts) if c]
        if segment_peak_bytes(layer_bytes, boundary_bytes, starts) <= budget:
            r = recomputed_layers(n, starts)
            best = r if best is None else min(best, r)
    return best


def _dp_recompute(layer_bytes: Sequence[float], boundary_bytes: Sequence[float],
                  budget: float) -> int | None:
    """The fewest recomputed layers by the reference's dynamic programme (for sizes where
    the exhaustive search cannot run; the two agree on every size both can: tests)."""
    try:
        starts = plan_segments(list(layer_bytes), list(boundary_bytes), budget)
    except ValueError:
        return None
    return recomputed_layers(len(layer_bytes), starts)


def _plan_compare(layer_bytes: Sequence[float], boundary_bytes: Sequence[float],
                  budget: float) -> Callable[[Any, Any], str | None]:
    n = len(layer_bytes)

    def compare(got: Any, expected: Any) -> str | None:
        try:
            starts = [int(s) for s in got]
            peak = segment_peak_bytes(layer_bytes, boundary_bytes, starts)
        except (TypeError, ValueError) as exc:
            return f"not a valid list of segment starts ({exc}): {got!r}"
        if peak > budget:
            return f"starts {starts}: predicted peak {peak:g} B exceeds the budget {budget:g} B"
        r = recomputed_layers(n, starts)
        if r != expected:
            return f"starts {starts} recompute {r} layers; the best plan recomputes {expected}"
        return None

    return compare


def _plan_case(name: str, layer_bytes: list[float], boundary_bytes: list[float],
               budget: float) -> Case:
    best = (_best_recompute(layer_bytes, boundary_bytes, budget) if len(layer_bytes) <= 16
            else _dp_recompute(layer_bytes, boundary_bytes, budget))
    if best is None:
        return Case(name, (layer_bytes, boundary_bytes, budget), compare=raises(ValueError))
    return Case(name, (layer_bytes, boundary_bytes, budget), expected=best,
                compare=_plan_compare(layer_bytes, boundary_bytes, budget))


def _segment_plan_cases() -> list[Case]:
    uniform = [10.0] * 9
    ones = [1.0] * 9
    uneven = [4.0, 12.0, 3.0, 9.0, 9.0, 2.0, 15.0, 5.0, 6.0, 8.0]
    uneven_in = [1.0, 2.0, 1.0, 3.0, 1.0, 1.0, 2.0, 1.0, 1.0, 2.0]
    return [
        _plan_case("budget holds everything: no checkpointing", uniform, ones, 90.0),
        _plan_case("uniform layers, budget between", uniform, ones, 45.0),
        _plan_case("uniform layers, about sqrt(n) segments", uniform, ones, 32.0),
        _plan_case("one layer at a time just fits", uniform, ones, 18.0),
        _plan_case("budget below one layer at a time: ValueError", uniform, ones, 17.0),
        _plan_case("uneven layers and inputs", uneven, uneven_in, 40.0),
        _plan_case("uneven, tight", uneven, uneven_in, 27.0),
        _plan_case("a single layer", [7.0], [1.0], 7.0),
        _plan_case("big inputs make long segments pay", [5.0] * 8, [4.0] * 8, 22.0),
        _plan_case(f"80 layers: 2**79 segmentations, too many to try one by one (a plan "
                   f"within {PLAN_SECONDS:g} s needs the dynamic programme)",
                   [float(3 + (7 * i) % 11) for i in range(80)],
                   [float(1 + (5 * i) % 4) for i in range(80)], 120.0),
    ]


PLAN_SECONDS = 20.0
segment_plan = Spec("segment_plan", _segment_plan_cases, forbid=FORBID, ops=False,
                    case_seconds=PLAN_SECONDS)
"""``fn(layer_bytes, boundary_bytes, budget_bytes)`` against an exhaustive search (and, for
80 layers, the reference's dynamic programme: trying every plan there takes forever, and the
case is stopped after ``PLAN_SECONDS``)."""


def _run(blocks: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def forward_segments(
    blocks: Sequence[nn.Module], x: torch.Tensor, starts: Sequence[int] | None
) -> torch.Tensor:
    """Run ``blocks`` on ``x`` in segments beginning at ``starts``, as ``checkpoint_sequential``.

    ``starts[0]`` must be 0; each segment runs from its start to the next start.  Every
    segment but the last is checkpointed (``use_reentrant=False``); the last one runs
    normally because its backward follows at once.  ``starts=None`` or ``[0]``: no
    checkpointing at all.
    """
    if not starts:
        return _run(blocks, x)
    starts = validate_starts(starts, len(blocks))
    ends = [*starts[1:], len(blocks)]
    for s, e in zip(starts[:-1], ends[:-1]):
        x = checkpoint(_run, blocks[s:e], x, use_reentrant=False)
    return _run(blocks[starts[-1]:], x)


def plan_segments(
    layer_bytes: Sequence[float], boundary_bytes: Sequence[float], budget_bytes: float
) -> list[int]:
    """Segment starts that fit ``budget_bytes`` with the fewest recomputed layers.

    Dynamic programme over prefixes: ``kept[i]`` is the least boundary memory with which
    layers ``[0, i)`` can be split into checkpointed segments that all fit; smaller ``kept``
    never hurts later segments, so keeping the minimum is exact.  The answer is the longest
    un-checkpointed tail ``[i, n)`` with ``kept[i] + sum(layer_bytes[i:]) <= budget``.
    Raises ``ValueError`` if no segmentation fits.
    """
    n = len(layer_bytes)
    if n == 0 or len(boundary_bytes) != n:
        raise ValueError("need one layer_bytes and one boundary_bytes entry per layer (n > 0)")
    inf = math.inf
    kept = [inf] * (n + 1)
    prev = [-1] * (n + 1)
    kept[0] = 0.0
    prefix = [0.0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)
    for i in range(1, n + 1):
        for j in range(i):
            if kept[j] + prefix[i] - prefix[j] <= budget_bytes:
                cand = kept[j] + boundary_bytes[j]
                if cand < kept[i]:
                    kept[i], prev[i] = cand, j
    for tail in range(n):  # tail start; smaller start = fewer recomputed layers
        if kept[tail] + prefix[n] - prefix[tail] <= budget_bytes:
            starts = [tail]
            i = tail
            while i > 0:
                i = prev[i]
                starts.append(i)
            return sorted(set(starts))
    raise ValueError(
        f"no segmentation fits {budget_bytes:.4g} bytes: even one layer at a time needs "
        f"{min(segment_peak_bytes(layer_bytes, boundary_bytes, list(range(n))), inf):.4g}"
    )




# -- selective checkpointing of a transformer layer (create_selective_checkpoint_contexts) --

def _sac_layer(s: int, h: int, a: int, swiglu: bool) -> nn.Module:
    from labsim.lab.models import Block
    from labsim.workload import Transformer

    mlp = {"swiglu": True, "ffn_hidden": 3 * h, "bias": False} if swiglu else {}
    torch.manual_seed(7)
    return Block(Transformer(1, h, a, s, 16, dropout=False, **mlp))


def _sac_cases() -> list[Case]:
    specs = [(96, 64, 4, 2, False), (80, 32, 2, 3, False), (96, 64, 8, 1, True),
             (112, 48, 3, 2, True), (72, 64, 4, 2, False)]
    cases = []
    for s, h, a, b, swiglu in specs:
        layer = _sac_layer(s, h, a, swiglu)
        x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(s + h))
        plain = layer_step(layer, x, None)
        expected = {"gradients": plain["gradients"], "plain_kept": plain["kept"],
                    "plain_flops": plain["flops"], "attention_flops": 4 * b * s * s * h}
        cases.append(Case(f"{'SwiGLU' if swiglu else 'GeLU'} layer, s={s}, h={h}, a={a}, b={b}",
                          (s, h, a, b, swiglu, x), expected=expected, compare=_sac_compare))
    return cases


def _sac_keeps_less(case: Case, out: Outcome) -> str | None:
    if out.observed["scores_kept"]:
        return ("an s x s tensor (scores or probabilities) is kept for backward: recompute the "
                "attention core, save only the linear layers' outputs")
    if out.observed["kept"] >= case.expected["plain_kept"]:
        return (f"keeps {out.observed['kept']} bytes for backward, not less than the plain "
                f"layer's {case.expected['plain_kept']}: the policy saves too much")
    return None


def _sac_recomputes_little(case: Case, out: Outcome) -> str | None:
    extra = out.observed["flops"] - case.expected["plain_flops"]
    if extra > case.expected["attention_flops"] * 1.001:
        return (f"recomputes {extra} FLOPs, more than the attention core's "
                f"{case.expected['attention_flops']} (QK^T and PV): a linear layer is "
                "recomputed; save the outputs of aten.mm / aten.addmm")
    return None


def _sac_compare(got: Any, expected: Any) -> str | None:
    wrong = close(1e-4, 1e-6)(got, expected["gradients"])
    return None if wrong is None else f"gradients differ from the plain layer's: {wrong}"


def _drive_sac(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
               ) -> list[Outcome]:
    outcomes = []
    for case in cases:
        s, h, a, _, swiglu, x = case.args
        with watch(spec.forbid, ops=False) as seen:
            try:
                value = layer_step(_sac_layer(s, h, a, swiglu), x, fns[0])
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                outcomes.append(Outcome.of_error(exc, seen.summary()))
                continue
        observed = {**seen.summary(), **{k: value[k] for k in ("kept", "scores_kept", "flops")}}
        outcomes.append(plain_outcome(value["gradients"], observed))
    return outcomes


selective_policy = Spec("selective_policy", _sac_cases, drive=_drive_sac,
                        rules=(_sac_keeps_less, _sac_recomputes_little), forbid=FORBID)
"""``policy(ctx, op, *args, **kwargs) -> CheckpointPolicy`` for
``torch.utils.checkpoint.create_selective_checkpoint_contexts``: a checkpointed transformer
layer must give the plain layer's gradients, keep less than it and no s x s tensor, and
recompute no more than the attention core's matmuls (Korthikanti et al. 2022's selective
recomputation)."""

"""Checks for lab 10 (tensor parallel): the learner's Megatron-style layers on real gloo
processes against one process running the whole layer in float64 (parallel = serial).

Each check is a ``Spec``: its cases name a *job* (an exercise kind of ``reference.KINDS`` on
one ``reference.Spec`` of sizes) and what of it is compared (``"out"``, ``"grad:<names>"``,
``"sum:<names>"`` for gradients summed over ranks, ``"all"``); the driver launches every job
of the check once on ``NPROCS`` processes, each learner call under
``labsim.lab.comm.CommRecorder`` and the reference tripwire, and returns per case the ranks'
values with what each rank communicated and its matmul FLOPs; the expected values come from
one process on the whole tensors (``reference.serial_job``).  Besides values, the rules hold
the learner to the method (Shoeybi et al. 2019, Korthikanti et al. 2022):

- Megatron's ``f`` is the identity forward and one all-reduce backward; ``g`` the reverse;
- a split MLP or attention layer issues exactly one all-reduce of the ``s b h`` activations
  forward and one backward; with sequence parallelism an all-gather and a reduce-scatter each
  way instead, and no all-reduce;
- each rank executes at most 1/t of the whole block's matmul FLOPs (the block is split, not
  computed whole on every rank);
- vocabulary-parallel cross-entropy never gathers the logits: forward at most 3 all-reduces
  of at most 2 numbers per token, nothing backward;
- nothing of ``labsim.parallel.tensor_parallel`` (the library's own layers) is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec, close
from labsim.checks.tensor_parallel.driver import driver, pick, sizes_of
from labsim.checks.tensor_parallel.reference import (
    ATTENTION_SPECS,
    CE_SPECS,
    MLP_SPECS,
    SP_SPECS,
    serial_flops,
    serial_job,
)
from labsim.checks.tensor_parallel.reference import Spec as Sizes

NPROCS = 2
TOL = close(rtol=1e-9, atol=1e-12)
FORBID = ("labsim.parallel.tensor_parallel:*",)
OPERATOR_NUMEL = 3 * 2 * 4  # reference.operator_inputs
SP_OPERATOR_NUMEL = 2 * NPROCS * 3 * 4  # reference.sp_operator_inputs, the whole tensor
FLOPS_SLACK = 1.05

def _case(name: str, kind: str, sizes: Sizes | None, what: str,
          compare: Callable[[Any, Any], str | None] | None = None) -> Case:
    """A case of job ``(kind, sizes)``: ``what`` of every rank's run, expected from the
    serial oracle."""
    want = serial_job(kind, sizes, NPROCS)
    if what.startswith("sum:"):
        names = what[4:].split(",")
        return Case(name, (kind, _plain_sizes(sizes), what),
                    expected=[want[0].grads[n] for n in names],  # replicated: whole
                    compare=_summed(compare or TOL))
    return Case(name, (kind, _plain_sizes(sizes), what),
                expected=[pick(w.out, w.grads, what) for w in want], compare=compare)


def _plain_sizes(sizes: Sizes | None) -> tuple:
    return dataclasses.astuple(sizes) if sizes is not None else ()


def _summed(inner: Callable[[Any, Any], str | None]) -> Callable[[Any, Any], str | None]:
    """Compare the ranks' gradients summed over ranks with the serial ones."""
    def compare(got: Any, expected: Any) -> str | None:
        if not isinstance(got, list) or not got or not all(
                isinstance(r, list) and len(r) == len(expected) for r in got):
            return "expected one list of gradients per rank"
        if any(g is None for r in got for g in r):
            return "a gradient is missing (None) on some rank"
        return inner([sum(r[i] for r in got) for i in range(len(expected))], expected)
    return compare


# -- rules --------------------------------------------------------------------------------------


def _show(comms: Sequence[Sequence[Any]]) -> str:
    return "[" + ", ".join(f"{k} of {n} elements" for k, n in comms) + "]" if comms else \
        "nothing"


def expected_comms(kind: str, sizes: Sizes | None) -> tuple[list, list] | None:
    """(forward, backward) collectives of one rank for a job, as sorted [kind, elements]."""
    if kind == "f":
        return [], [["all_reduce", OPERATOR_NUMEL]]
    if kind == "g":
        return [["all_reduce", OPERATOR_NUMEL]], []
    if kind == "gather":
        return [["all_gather", SP_OPERATOR_NUMEL]], [["reduce_scatter", SP_OPERATOR_NUMEL]]
    if kind == "scatter":
        return [["reduce_scatter", SP_OPERATOR_NUMEL]], [["all_gather", SP_OPERATOR_NUMEL]]
    if sizes is None or kind == "ce":
        return None
    numel = sizes.seq * sizes.batch * sizes.hidden
    if kind == "sp":
        both = [["all_gather", numel], ["reduce_scatter", numel]]
        return both, list(both)
    return [["all_reduce", numel]], [["all_reduce", numel]]


RULES = {
    "f": "f is the identity forward and one all-reduce of the gradient backward",
    "g": "g is one all-reduce forward and the identity backward",
    "gather": "gather = one all-gather forward, one reduce-scatter backward",
    "scatter": "scatter = one reduce-scatter forward, one all-gather backward",
    "mlp": "the split MLP communicates once forward (g: an all-reduce of the s*b*h output) "
           "and once backward (f: an all-reduce of the input's gradient)",
    "attention": "head-parallel attention communicates once forward (g after the output "
                 "projection) and once backward (f before the QKV projection)",
    "sp": "sequence parallelism replaces each all-reduce by a reduce-scatter and an "
          "all-gather of the s*b*h activations",
}


def comms_rule(case: Case, out: Outcome) -> str | None:
    """Each rank's collectives, forward and backward, are exactly those of the method."""
    kind, raw = str(case.args[0]), case.args[1]
    want = expected_comms(kind, sizes_of(raw))
    if want is None:
        return None
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        fwd = sorted([str(k), int(n)] for k, n in seen["forward"])
        bwd = sorted([str(k), int(n)] for k, n in seen["backward"])
        if fwd != sorted(want[0]) or bwd != sorted(want[1]):
            return (f"{RULES[kind]}; rank {rank} issued forward {_show(fwd)}, backward "
                    f"{_show(bwd)}, expected forward {_show(want[0])}, backward "
                    f"{_show(want[1])}")
    return None


def flops_rule(case: Case, out: Outcome) -> str | None:
    """Each rank executes at most 1/t of the whole block's matmul FLOPs."""
    kind, raw = str(case.args[0]), case.args[1]
    if kind not in ("mlp", "attention", "sp"):
        return None
    budget = serial_flops(kind, Sizes(*raw)) / NPROCS
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        if int(seen["flops"]) > FLOPS_SLACK * budget:
            return (f"each rank computes only its own share of the block: rank {rank} "
                    f"executed {int(seen['flops'])} matmul FLOPs, 1/t of the whole block is "
                    f"{budget:g}")
    return None


def ce_rule(case: Case, out: Outcome) -> str | None:
    """The logits are never gathered: forward at most 3 all-reduces of at most 2 numbers per
    token, backward nothing."""
    if str(case.args[0]) != "ce":
        return None
    tokens = int(case.args[1][0])
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        fwd, bwd = seen["forward"], seen["backward"]
        bad = [c for c in fwd if c[0] != "all_reduce" or int(c[1]) > 2 * tokens]
        if bad or len(fwd) > 3 or bwd:
            return ("the logits are never gathered; forward issues at most 3 all-reduces of "
                    f"at most 2 numbers per token, backward nothing; rank {rank} issued "
                    f"forward {_show(fwd)}, backward {_show(bwd)}")
    return None


# -- the checks ---------------------------------------------------------------------------------


def _mlp_cases() -> list[Case]:
    s0, s1 = MLP_SPECS
    label = [f"MLP {s.seq}x{s.batch} tokens, h={s.hidden}, ffn={s.ffn}" for s in MLP_SPECS]
    return [_case("f forward returns its input unchanged", "f", None, "out"),
            _case("f backward: the gradient summed over the ranks", "f", None, "grad:x"),
            _case("g forward: the input summed over the ranks", "g", None, "out"),
            _case("g backward: the gradient passes unchanged", "g", None, "grad:x"),
            _case(f"{label[0]}: output equals the serial MLP's", "mlp", s0, "out"),
            _case(f"{label[0]}: gradient of x equals the serial MLP's", "mlp", s0, "grad:x"),
            _case(f"{label[0]}: gradients of this rank's weights and biases", "mlp", s0,
                  "grad:w_up,b_up,w_down,b_down"),
            _case(f"{label[1]}: output and every gradient", "mlp", s1, "all")]


parallel_mlp = Spec("parallel_mlp", _mlp_cases, drive=driver({"f": 0, "g": 1, "mlp": 2}, NPROCS),
                    compare=TOL, rules=(comms_rule, flops_rule), forbid=FORBID, functions=3,
                    ops=False)
"""``f`` and ``g``: Megatron's conjugate operators as ``torch.autograd.Function``s;
``mlp(x, w_up, b_up, w_down, b_down)``: ``GeLU(x A) B + b`` from this rank's blocks
(``w_up``: rows = output features, ``w_down``: columns = input features), equal on every rank
to the whole MLP, with one all-reduce forward and one backward.  2 processes, one launch."""


def _attention_cases() -> list[Case]:
    s0, s1 = ATTENTION_SPECS
    label = [f"{s.heads} heads on {NPROCS} ranks, {s.seq}x{s.batch} tokens, h={s.hidden}"
             for s in ATTENTION_SPECS]
    return [_case(f"{label[0]}: output equals the serial layer's", "attention", s0, "out"),
            _case(f"{label[0]}: gradient of x", "attention", s0, "grad:x"),
            _case(f"{label[0]}: gradients of this rank's QKV rows", "attention", s0,
                  "grad:w_qkv,b_qkv"),
            _case(f"{label[0]}: gradients of the output projection", "attention", s0,
                  "grad:w_o,b_o"),
            _case(f"{label[1]}: output and every gradient", "attention", s1, "all")]


head_parallel_attention = Spec(
    "head_parallel_attention", _attention_cases, drive=driver({"attention": 0}, NPROCS),
    compare=TOL, rules=(comms_rule, flops_rule), forbid=FORBID, ops=False)
"""``attention(x, w_qkv, b_qkv, w_o, b_o, head_dim)``: causal self-attention over this rank's
heads (``w_qkv``: its block of the head-major fused QKV rows; ``w_o``: the matching columns
of the output projection), equal on every rank to the whole layer, with one all-reduce
forward and one backward."""


SHARDED = "grad:x,w_up,b_up,w_down"
SHARED = "sum:ln_w,ln_b,b_down"


def _sp_cases() -> list[Case]:
    s0, s1 = SP_SPECS
    label = [f"SP block {s.seq}x{s.batch} tokens, h={s.hidden}, ffn={s.ffn}" for s in SP_SPECS]
    return [_case("all-gather forward: the shards in rank order", "gather", None, "out"),
            _case("all-gather backward: the gradient reduce-scattered", "gather", None,
                  "grad:x"),
            _case("reduce-scatter forward: the sum, this rank's rows", "scatter", None, "out"),
            _case("reduce-scatter backward: the gradient all-gathered", "scatter", None,
                  "grad:x"),
            _case(f"{label[0]}: output equals the serial block's rows", "sp", s0, "out"),
            _case(f"{label[0]}: gradients of x and the split weights", "sp", s0, SHARDED),
            _case(f"{label[0]}: norm and output-bias gradients, summed over ranks", "sp", s0,
                  SHARED),
            _case(f"{label[1]}: output", "sp", s1, "out"),
            _case(f"{label[1]}: gradients of x and the split weights", "sp", s1, SHARDED),
            _case(f"{label[1]}: shared gradients summed over ranks", "sp", s1, SHARED)]


sequence_parallel = Spec(
    "sequence_parallel", _sp_cases, drive=driver({"gather": 0, "scatter": 1, "sp": 2}, NPROCS),
    compare=TOL, rules=(comms_rule, flops_rule), forbid=FORBID, functions=3, ops=False)
"""``gather``: all-gather of the sequence (dimension 0) forward, reduce-scatter backward;
``scatter``: reduce-scatter forward, all-gather backward;
``block(x, ln_w, ln_b, w_up, b_up, w_down, b_down)``: this rank's rows of
``x + MLP(LayerNorm(x))`` from its rows of ``x``, the norm on the shard, the MLP split as in
``parallel_mlp``, and no all-reduce.  The replicated parameters' gradients (norm, output bias)
on each rank are its share: summed over ranks they equal the serial ones."""


def _ce_cases() -> list[Case]:
    names = ["6 tokens, V=10", "logits near +-1000 (subtract the maximum)",
             "every target in the last rank's slice", "a single token"]
    loose = close(rtol=1e-9, atol=1e-9)
    cases = [_case(f"{names[0]}: loss per token equals F.cross_entropy", "ce", CE_SPECS[0],
                   "out"),
             _case(f"{names[0]}: gradient is this rank's slice of the whole gradient", "ce",
                   CE_SPECS[0], "grad:logits"),
             _case(f"{names[1]}: loss", "ce", CE_SPECS[1], "out", loose),
             _case(f"{names[1]}: gradient", "ce", CE_SPECS[1], "grad:logits")]
    return cases + [_case(f"{n}: loss and gradient", "ce", s, "all")
                    for n, s in zip(names[2:], CE_SPECS[2:])]


vocab_parallel_cross_entropy = Spec(
    "vocab_parallel_cross_entropy", _ce_cases, drive=driver({"ce": 0}, NPROCS), compare=TOL,
    rules=(ce_rule,), forbid=FORBID, ops=False)
"""``ce.apply(logits, target, vocab_start)``: per-token cross-entropy from this rank's
``(tokens, V / t)`` slice of the logits (vocabulary ids ``vocab_start ..``), equal to
``F.cross_entropy`` on the whole logits, its gradient the slice of the whole gradient, without
ever gathering the logits."""
